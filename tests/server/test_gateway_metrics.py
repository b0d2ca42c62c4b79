"""/metrics of a real server read as the Gateway API Inference Extension reads it (its model-server protocol:
queued and running requests, KV-cache utilization, the cache's block size and number of blocks, and
``vllm:lora_requests_info`` with the adapters on the device, those waiting, and ``max_lora``), plus vLLM's proposed
per-adapter residency gauges, before, during and after traffic.

The server is small enough that which adapters are on the device is known by hand: two adapter slots
(``--max-loras 2``), the LRU policy (``lru-separate``), one pinned adapter, one request running at a time. Slow: a
server start."""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import Server, write_adapter

pytestmark = pytest.mark.slow

# SmolLM2-135M in fp32 (--quantization none): 30 layers x 3 KV heads x 64 dims, K and V, 4 bytes, 16 tokens a block
BLOCK_SIZE = 16
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * BLOCK_SIZE
NUM_GPU_BLOCKS = int(0.1 * 2**30) // BLOCK_BYTES  # --kv-cache-gb 0.1 (tests.servers)
PROMPT = list(range(1000, 1040))  # 40 token ids: a prompt of known length
RANKS = {"upper": 8, "pirate": 16, "emoji": 4, "keep": 4}  # r in the demo adapters' configs; "keep": write_adapter's
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    """The adapter root, with one adapter to register: "keep"."""
    path = tmp_path_factory.mktemp("adapters")
    write_adapter(path / "keep", seed=1)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, root):
    flags = ["--max-loras", "2", "--pool-policy", "lru-separate", "--max-num-seqs", "1", "--allow-anonymous"]
    s = Server(tmp_path_factory.mktemp("gateway"), [root], flags)
    yield s
    s.stop()


class Scrape:
    """One reading of /metrics, through prometheus_client's own parser."""

    def __init__(self, server: Server) -> None:
        r = httpx.get(server.url + "/metrics", timeout=10)
        assert r.status_code == 200
        self.taken = time.time()
        self.families = {f.name: f for f in text_string_to_metric_families(r.text)}

    def value(self, name: str) -> float:
        (sample,) = self.families[name].samples
        return sample.value

    def lora_info(self) -> tuple[dict[str, str], float]:
        """The one series of vllm:lora_requests_info: its labels and value."""
        (sample,) = self.families["vllm:lora_requests_info"].samples
        return sample.labels, sample.value

    def loaded(self) -> dict[str, tuple[str, str]]:
        """vllm:lora_adapter_loaded as adapter -> (level, pinned); every value is 1, every rank the adapter's."""
        samples = self.families["vllm:lora_adapter_loaded"].samples
        assert all(s.value == 1 for s in samples)
        assert all(s.labels["rank"] == str(RANKS[s.labels["adapter_name"]]) for s in samples)
        return {s.labels["adapter_name"]: (s.labels["level"], s.labels["pinned"]) for s in samples}

    def loads(self) -> dict[str, tuple[int, float]]:
        """vllm:lora_adapter_load_seconds: transition -> (count, sum); its buckets are cumulative up to the count."""
        samples = self.families["vllm:lora_adapter_load_seconds"].samples
        out = {}
        for transition in ("load", "activate"):
            mine = [s for s in samples if s.labels["transition"] == transition]
            count = next(s.value for s in mine if s.name.endswith("_count"))
            buckets = [s.value for s in mine if s.name.endswith("_bucket")]
            assert buckets == sorted(buckets) and buckets[-1] == count
            out[transition] = (int(count), next(s.value for s in mine if s.name.endswith("_sum")))
        return out

    def check_residency(self, expected: dict[str, tuple[str, str]], waiting: str = "") -> None:
        """The residency gauges and lora_requests_info agree with ``expected`` (adapter -> (level, pinned))."""
        assert self.loaded() == expected
        on_device = sorted(name for name, (level, _) in expected.items() if level == "gpu")
        assert self.value("vllm:num_gpu_loaded_lora_adapters") == len(on_device)
        assert self.value("vllm:num_cpu_loaded_lora_adapters") == len(expected)  # host copies: every adapter
        labels, updated = self.lora_info()
        assert labels == {
            "running_lora_adapters": ",".join(on_device),
            "waiting_lora_adapters": waiting,
            "max_lora": "2",
        }
        assert abs(updated - self.taken) < 5  # the update time, as a unix timestamp


def until(server: Server, ready, what: str, timeout: float = 30) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        scrape = Scrape(server)
        if ready(scrape):
            return scrape
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def idle(scrape: Scrape) -> bool:
    return scrape.value("vllm:num_requests_running") == 0 and scrape.value("vllm:num_requests_waiting") == 0


def complete(server: Server, model: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=300)


def test_gateway_protocol_and_residency(server: Server, root):
    cpu, gpu = ("cpu", "false"), ("gpu", "false")

    # before any traffic: nothing on the device, nothing queued; the demo adapters are staged in host memory by the
    # loader thread after start-up (a scrape may come first on a busy machine)
    start = until(server, lambda s: len(s.loaded()) == 3, "the demo adapters staged at start")
    (cache,) = start.families["vllm:cache_config_info"].samples
    assert cache.labels == {"block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(NUM_GPU_BLOCKS)}
    assert cache.value == 1
    assert idle(start) and start.value("vllm:kv_cache_usage_perc") == 0
    start.check_residency({"upper": cpu, "pirate": cpu, "emoji": cpu})
    assert start.value("vllm:max_gpu_lora_adapters") == 2
    loads = start.loads()  # the three demo adapters read from disk at start, none on the device yet
    assert loads["load"][0] == 3 and 0 < loads["load"][1] < 30 and loads["activate"] == (0, 0)

    # a pinned adapter goes to the device on its own and stays there
    r = server.admin("POST", "/admin/adapters", json={"name": "keep", "path": str(root / "keep"), "pinned": True})
    assert r.status_code == 200, r.text
    pinned = ("gpu", "true")
    until(server, lambda s: s.loaded().get("keep") == pinned, "the pinned adapter on the device")
    pinned_on = Scrape(server)
    pinned_on.check_residency({"keep": pinned, "upper": cpu, "pirate": cpu, "emoji": cpu})
    assert pinned_on.loads()["load"][0] == 4 and pinned_on.loads()["activate"][0] == 1

    # one slot left for the others: the last one used holds it (LRU)
    for model in ("upper", "pirate"):
        assert complete(server, model).status_code == 200
    after = until(server, idle, "idle")
    after.check_residency({"keep": pinned, "upper": cpu, "pirate": gpu, "emoji": cpu})
    assert after.value("vllm:kv_cache_usage_perc") == 0  # finished requests hold no blocks (cached ones are free)

    # during traffic: one request runs (emoji, streaming), one waits behind it (upper)
    body = {"model": "emoji", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as stream:
        lines = stream.iter_lines()  # held open: closing the connection aborts the request
        while not next(lines).startswith("data: "):
            pass
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(complete(server, "upper")))
        waiter.start()
        during = until(server, lambda s: s.value("vllm:num_requests_waiting") == 1, "a waiting request")
        assert during.value("vllm:num_requests_running") == 1
        during.check_residency({"keep": pinned, "upper": cpu, "pirate": cpu, "emoji": gpu}, waiting="upper")
        # the running request holds the blocks of its prompt and of what it generated so far
        usage = during.value("vllm:kv_cache_usage_perc")
        fewest, most = math.ceil(len(PROMPT) / BLOCK_SIZE), math.ceil((len(PROMPT) + MAX_TOKENS) / BLOCK_SIZE) + 1
        assert fewest / NUM_GPU_BLOCKS <= usage <= most / NUM_GPU_BLOCKS < 1
    waiter.join(timeout=300)
    assert [r.status_code for r in queued] == [200]

    # after: the waiting request ran, its adapter took the unpinned slot
    end = until(server, idle, "idle")
    end.check_residency({"keep": pinned, "upper": gpu, "pirate": cpu, "emoji": cpu})
    assert end.value("vllm:kv_cache_usage_perc") == 0
    # copies into the arena: keep, then upper, pirate, emoji and upper again in the one LRU slot; no disk read more
    loads = end.loads()
    assert loads["activate"][0] == 5 and 0 < loads["activate"][1] < 30 and loads["load"][0] == 4
