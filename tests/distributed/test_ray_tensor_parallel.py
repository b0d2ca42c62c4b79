"""Ray Serve replicas that are tensor-parallel groups (`--ray-replicas 2 --tensor-parallel-size 3`): each replica
gets a placement group of three bundles on one node (STRICT_PACK), rank 0 in the first and its two worker ranks
in the others' share; the answers through the one address, base model and demo adapters, equal a single
`lora-server serve`'s at TP=1 (float32: the same greedy tokens). Needs ``pip install lora-server[ray]``; slow (six
ranks of the embedded model start on a 2-core machine)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from lora_server.adapters import DEMO_DIR
from lora_server.config import EngineConfig, ServerConfig
from tests.server.test_ray_serve import chat
from tests.servers import ADMIN, Server, free_port

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")  # comes with ray
serve = pytest.importorskip("ray.serve")
ray_serve = pytest.importorskip("lora_server.server.ray_serve")

pytestmark = pytest.mark.slow
TP, REPLICAS = 3, 2


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The application on a local Ray cluster of 6 logical CPUs: two replicas' placement groups of 3 bundles."""
    engine = EngineConfig(
        quantization="none",
        kv_cache_bytes=int(0.1 * 2**30),
        max_loras=4,
        adapter_roots=(str(DEMO_DIR),),
        tensor_parallel_size=TP,
    )
    config = ServerConfig(engine=engine, data_dir=str(tmp_path_factory.mktemp("registry")), ray_replicas=REPLICAS)
    port = free_port()
    ray.init(num_cpus=REPLICAS * TP, object_store_memory=200 * 2**20, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_serve.application(config, ADMIN), name=ray_serve.APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_each_replica_is_a_tp_group_on_its_placement_group(url):
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == REPLICAS, groups
    for group in groups:
        assert group["strategy"] == "STRICT_PACK"
        assert list(group["bundles"].values()) == [{"CPU": 1.0}] * TP
    assert ray.available_resources().get("CPU", 0) == 0  # the ranks' CPUs are reserved: Ray places nothing else
    # each replica's process (Ray titles it ray::ServeReplica:...:engine) runs its TP - 1 worker ranks as children
    replicas = [p for p in psutil.process_iter(["cmdline"]) if "ServeReplica:lora-server:engine" in _title(p)]
    assert len(replicas) == REPLICAS
    for replica in replicas:
        ranks = [c for c in replica.children() if "spawn_main" in _title(c)]
        assert len(ranks) == TP - 1, [_title(c) for c in replica.children()]


def _title(process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone meanwhile, or not ours to read
        return ""


def test_answers_equal_a_single_server_at_tp1(url, tmp_path):
    import openai

    asked = [(a, w) for a in ("SmolLM2-135M-Instruct", "upper", "pirate", "emoji") for w in ("river", "castle")]
    single = Server(tmp_path, [DEMO_DIR])
    try:
        want = [chat(single.client(), a, w) for a, w in asked]
    finally:
        single.stop()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda aw: chat(client, *aw), asked))
    assert got == want
