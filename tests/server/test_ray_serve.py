"""Two engine replicas under Ray Serve (CPU, the embedded model) behind one address: the same answers as a single
``lora-server serve``, adapter routing against Serve's default routing on one Zipf trace (figures from the
replicas' own counts), and a replica killed under traffic. Needs ``pip install lora-server[ray]``; slow (the
replicas take about a minute to start on a 2-core machine)."""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import openai
import pytest

from lora_server.adapters import DEMO_DIR
from lora_server.config import EngineConfig, ServerConfig
from tests.servers import ADMIN, Server, free_port, write_adapter

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
ray_serve = pytest.importorskip("lora_server.server.ray_serve")

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)
REGISTERED = ("reg1", "reg2", "reg3")
ADAPTERS = ("upper", "pirate", "emoji", *REGISTERED)
WORDS = ("river", "castle", "apple", "winter", "engine", "garden", "violin", "desert", "harbor", "lantern")
AUTH = {"Authorization": f"Bearer {ADMIN}"}


class Cluster:
    """A local Ray cluster (2 CPUs, a small object store) running the lora-server application on ``url``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config, self.routing = config, ""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})

    def deploy(self, routing: str) -> None:
        """(Re)deploy with this routing; returns when the application is ready (fresh replicas)."""
        if routing != self.routing:
            config = replace(self.config, ray_routing=routing)
            serve.run(ray_serve.application(config, ADMIN), name=ray_serve.APP_NAME, route_prefix="/")
            self.routing = routing

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=AUTH, timeout=120, **kw)

    def replica_stats(self) -> dict[str, dict]:
        return {s["replica"]: s for s in self.admin("GET", "/admin/replicas").json()["data"]}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def close(self) -> None:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(REGISTERED):
        write_adapter(root / name, seed=100 + i)
    return root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, roots):
    engine = EngineConfig(
        quantization="none", kv_cache_bytes=int(0.1 * 2**30), max_loras=4, adapter_roots=(str(roots), str(DEMO_DIR))
    )
    config = ServerConfig(engine=engine, data_dir=str(tmp_path_factory.mktemp("registry")), ray_replicas=2)
    c = Cluster(config)
    try:
        c.deploy("adapter")
        for name in REGISTERED:  # through the one address: one replica writes the store, the other reconciles
            r = c.admin("POST", "/admin/adapters", json={"name": name, "path": str(roots / name)})
            assert r.status_code == 200, r.text
        yield c
    finally:
        c.close()


def chat(client: openai.OpenAI, adapter: str, word: str, max_tokens: int = 6) -> str:
    reply = client.chat.completions.create(
        model=adapter,
        messages=[{"role": "user", "content": f"Tell me about the {word}."}],
        temperature=0,
        max_tokens=max_tokens,
    )
    return reply.choices[0].message.content or ""


def test_answers_equal_a_single_server(cluster, roots, tmp_path):
    """Greedy answers through the replicas (each adapter, both replicas) equal a plain lora-server serve's."""
    cluster.deploy("adapter")
    single = Server(tmp_path, [roots, DEMO_DIR])
    try:
        for name in REGISTERED:
            assert single.admin("POST", "/admin/adapters", json={"name": name, "path": str(roots / name)}).is_success
        asked = [(a, w) for a in ("SmolLM2-135M-Instruct", *ADAPTERS) for w in WORDS[:2]]
        want = [chat(single.client(), a, w) for a, w in asked]
    finally:
        single.stop()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda aw: chat(cluster.client(), *aw), asked))
    assert got == want
    listed = {m.id for m in cluster.client().models.list().data}
    assert set(ADAPTERS) <= listed


def zipf_trace(n: int, alpha: float, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** alpha for i in range(len(ADAPTERS))]
    return [(rng.choices(ADAPTERS, weights)[0], rng.choice(WORDS)) for _ in range(n)]


def run_trace(cluster: Cluster, trace: list[tuple[str, str]]) -> dict[str, float]:
    """The trace at 4 requests in flight; the replicas' counts before and after give the figures."""
    before = cluster.replica_stats()
    assert len(before) == 2
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda aw: chat(cluster.client(), *aw, max_tokens=4), trace))
    duration = time.monotonic() - start
    after = cluster.replica_stats()
    assert all(answers) and after.keys() == before.keys()

    def delta(field: str) -> int:
        return sum(after[r][field] - before[r][field] for r in after)

    served = delta("adapter_requests")
    assert served == len(trace)
    return {
        "resident_share": delta("resident_at_arrival") / served,
        "loads_per_100": 100 * delta("adapter_loads") / served,
        "per_replica": {r: after[r]["adapter_requests"] - before[r]["adapter_requests"] for r in after},
        "seconds": duration,
    }


def test_adapter_routing_keeps_adapters_where_they_are(cluster):
    """Over one Zipf trace, routing by adapter finds the adapter already on the replica's device more often, and
    loads adapters less often, than Serve's default routing."""
    trace = zipf_trace(48, alpha=1.0, seed=0)
    cluster.deploy("adapter")
    by_adapter = run_trace(cluster, trace)
    cluster.deploy("random")
    by_default = run_trace(cluster, trace)
    log.info("adapter routing %s; random routing %s", by_adapter, by_default)
    assert by_adapter["resident_share"] > by_default["resident_share"]
    assert by_adapter["loads_per_100"] < by_default["loads_per_100"]


def test_adapter_changes_reach_every_replica(cluster, roots):
    """An adapter registered, then deleted, through the one address is served, then refused, by both replicas."""
    cluster.deploy("random")
    path = write_adapter(roots / "late", seed=7)
    assert cluster.admin("POST", "/admin/adapters", json={"name": "late", "path": str(path)}).status_code == 200
    body = {"model": "late", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}

    def answers() -> list[httpx.Response]:
        with ThreadPoolExecutor(2) as pool:
            return list(
                pool.map(lambda _: httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120), range(12))
            )

    served = answers()
    assert [r.status_code for r in served] == [200] * 12
    assert len({r.headers["x-lora-server-replica"] for r in served}) == 2
    assert cluster.admin("DELETE", "/admin/adapters/late").status_code == 200
    refused = answers()
    assert [r.status_code for r in refused] == [404] * 12
    assert len({r.headers["x-lora-server-replica"] for r in refused}) == 2


def test_a_killed_replica(cluster):
    """Requests in flight on a replica that is killed get 503 with Retry-After (or, once streaming, an error
    event), none hangs; later requests are served by the survivor; the registry stays whole."""
    cluster.deploy("random")
    body = {"model": "upper", "messages": [{"role": "user", "content": "Count to fifty."}], "temperature": 0}
    long = {**body, "max_tokens": 48, "ignore_eos": True}

    def call(_: int) -> httpx.Response:
        return httpx.post(f"{cluster.url}/v1/chat/completions", json=long, timeout=120)

    with (
        ThreadPoolExecutor(6) as pool,
        httpx.stream(
            "POST", f"{cluster.url}/v1/chat/completions", json={**long, "stream": True}, timeout=120
        ) as stream,
    ):
        victim = stream.headers["x-lora-server-replica"]
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is streaming
        inflight = [pool.submit(call, i) for i in range(6)]
        time.sleep(2)
        [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{victim}")]
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        rest = [line for line in lines if line]
        results = [f.result(timeout=120) for f in inflight]
    assert any('"replica_unavailable"' in line for line in rest) and rest[-1] == "data: [DONE]"
    failed = [r for r in results if r.status_code != 200]
    assert failed and len(failed) < len(results)  # some were on the victim, the others on the survivor
    for r in failed:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "replica_unavailable"
    after = [httpx.post(f"{cluster.url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=120)]
    after += [httpx.post(f"{cluster.url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=120)]
    assert [r.status_code for r in after] == [200, 200]
    assert victim not in {r.headers["x-lora-server-replica"] for r in after}
    names = {a["name"] for a in cluster.admin("GET", "/admin/adapters").json()["data"]}
    assert set(ADAPTERS) <= names
