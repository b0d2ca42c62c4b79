"""Adapters registered from a URL (adapters/sources.py), against real servers: moto's S3-compatible HTTP server for
s3://, and a Hub-shaped HTTP server (the endpoints huggingface_hub's snapshot_download calls) for hf://. An adapter
from either serves the same greedy tokens as the same PEFT directory registered from disk, in one batch; a source
that fails halfway (a cut connection, bytes that fail the checksum) leaves nothing registered and nothing in the
cache; the cache's size bound evicts the least recently used entry no registered adapter reads; a scheme the
operator did not enable is refused by name; and the admin API of a real server registers an s3:// adapter."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lora_server.adapters.peft_format import AdapterError
from lora_server.adapters.sources import ADAPTER_FILES
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.servers import Server, free_port, write_adapter
from tests.test_adapter_keys import TINY, save_peft

BUCKET = "adapters"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = [5, 17, 42, 9, 77, 3, 101, 64, 12, 33]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# ---- the real things: a tiny Llama, PEFT adapters for it, S3 (moto) and a Hub-shaped server -----------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama in HF's format, and PEFT adapters made for it by PEFT (a0..a3, each its own weights)."""
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    root = tmp_path_factory.mktemp("sources")
    model.save_pretrained(root / "model")
    for i in range(4):
        torch.manual_seed(10 + i)
        save_peft(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]), root / "local" / f"a{i}")
    return root


@pytest.fixture(scope="module")
def s3(tiny):
    """moto's S3 server on a free port, the adapters uploaded under s3://adapters/a0..a3 (by boto3, as any tool
    would); the environment botocore reads pointed at it for the module."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test-key-id",
        "AWS_SECRET_ACCESS_KEY": "test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for adapter in sorted((tiny / "local").iterdir()):
            for file in ADAPTER_FILES:
                client.upload_file(str(adapter / file), BUCKET, f"{adapter.name}/{file}")
        yield env
    server.stop()


class Hub(ThreadingHTTPServer):
    """The Hub's endpoints that snapshot_download calls, for repos held in memory (``repos``: id -> file -> bytes,
    all at COMMIT, revision ``main`` too). ``fault``: "cut" sends half of adapter_model.safetensors and closes the
    connection (the Hub answers 500 after that), "corrupt" sends the right size with one byte changed."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.fault: str | None = None
        self.cut = False
        self.requests: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class HubHandler(BaseHTTPRequestHandler):
    server: Hub

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        hub = self.server
        hub.requests.append(f"{self.command} {self.path}")
        path = self.path.split("?")[0]
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
            repo, _ = m.groups()
            if repo not in hub.repos:
                return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return self._json(200, {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in hub.repos[repo]]})
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
            files = hub.repos[m.group(1)]
            return self._json(200, [_tree_entry(name, data) for name, data in files.items()])
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, _, name = m.groups()
            data = hub.repos[repo][name]
            lfs = name.endswith(".safetensors")
            if body and lfs and hub.cut:  # the Hub is down once a download was cut
                return self._json(500, {"error": "Internal Error"})
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{_sha256(data) if lfs else _git_sha1(data)}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not body:
                return
            if lfs and hub.fault == "cut":
                hub.cut = True
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            if lfs and hub.fault == "corrupt":
                data = data[:-1] + bytes([data[-1] ^ 1])
            self.wfile.write(data)
            return
        self._json(404, {"error": "not found"})

    def _json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _tree_entry(name: str, data: bytes) -> dict:
    """A file of the Hub's tree listing: LFS files (the weights) carry their sha256, others their git blob id."""
    entry = {"type": "file", "path": name, "size": len(data), "oid": _git_sha1(data)}
    if name.endswith(".safetensors"):
        entry["lfs"] = {"oid": _sha256(data), "size": len(data), "pointerSize": 134}
    return entry


@pytest.fixture(scope="module")
def hub(tiny):
    """The Hub-shaped server, HF_ENDPOINT pointed at it for the module; repo org/a1 holds adapter a1."""
    server = Hub()
    server.repos["org/a1"] = {f: (tiny / "local" / "a1" / f).read_bytes() for f in ADAPTER_FILES}
    server.repos["org/a1"]["README.md"] = b"not downloaded: only the adapter's files are"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", server.url)
        mp.setenv("HF_HUB_CACHE", str(tiny / "hf-cache"))  # huggingface_hub's own cache: not the user's
        yield server
    server.shutdown()


def _engine(tiny: Path, cache: Path, schemes=("hf", "s3"), cache_bytes: int = 64 << 20) -> Engine:
    return Engine(
        EngineConfig(
            model=str(tiny / "model"),
            quantization="none",
            kv_cache_bytes=16 << 20,
            block_size=64,
            max_loras=4,
            show_progress=False,
            adapter_roots=(str(tiny / "local"),),
            adapter_sources=schemes,
            adapter_cache_dir=str(cache),
            adapter_cache_bytes=cache_bytes,
        )
    )


@pytest.fixture(scope="module")
def engine(tiny, s3, hub, tmp_path_factory):
    return _engine(tiny, tmp_path_factory.mktemp("cache"))


def _cache_state(engine: Engine) -> tuple[list[str], list[str]]:
    """The cache's complete entries and anything else in it (but its lock file)."""
    cache = engine.core.adapters.sources.cache_dir
    names = sorted(p.name for p in cache.iterdir() if p.name != ".lock")
    return [n for n in names if (cache / n / "manifest.json").is_file()], [
        n for n in names if not (cache / n / "manifest.json").is_file()
    ]


def _tokens(engine: Engine, adapters: list[str | None]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate([PROMPT] * len(adapters), GREEDY, adapters=adapters)]


# ---- the tests ------------------------------------------------------------------------------------------------


def test_an_s3_adapter_serves_what_its_local_directory_serves(engine, tiny):
    engine.add_adapter("a0-local", tiny / "local" / "a0")
    engine.add_adapter("a0-s3", f"s3://{BUCKET}/a0")
    base, local, remote = _tokens(engine, [None, "a0-local", "a0-s3"])
    assert local == remote and local != base
    info = engine.adapter_info("a0-s3")
    assert info is not None and info.path == f"s3://{BUCKET}/a0"  # the source, not the cache's copy
    [manifest] = [m for m in engine.core.adapters.sources.cache_dir.glob("*/manifest.json") if "a0" in m.read_text()]
    files = json.loads(manifest.read_text())["files"]
    for name in ADAPTER_FILES:  # the sha256 recorded; the ETag (MD5 of a single-part upload) checked
        data = (tiny / "local" / "a0" / name).read_bytes()
        assert files[name]["sha256"] == _sha256(data)
        assert files[name]["published"] == ["md5", hashlib.md5(data).hexdigest()]


def test_a_hub_adapter_serves_what_its_local_directory_serves(engine, tiny, hub):
    engine.add_adapter("a1-local", tiny / "local" / "a1")
    engine.add_adapter("a1-hub", "hf://org/a1")
    engine.add_adapter("a1-hub-pinned", f"hf://org/a1@{COMMIT}")  # the same commit: the same entry, reused
    base, local, remote, pinned = _tokens(engine, [None, "a1-local", "a1-hub", "a1-hub-pinned"])
    assert local == remote == pinned and local != base
    downloads = [r for r in hub.requests if r.startswith("GET /org/a1/resolve/")]
    assert sorted(downloads) == [f"GET /org/a1/resolve/{COMMIT}/{name}" for name in ADAPTER_FILES]  # once; no README
    [manifest] = [
        m for m in engine.core.adapters.sources.cache_dir.glob("*/manifest.json") if "org/a1" in m.read_text()
    ]
    files = json.loads(manifest.read_text())["files"]
    weights = (tiny / "local" / "a1" / "adapter_model.safetensors").read_bytes()
    config = (tiny / "local" / "a1" / "adapter_config.json").read_bytes()
    assert files["adapter_model.safetensors"]["published"] == ["sha256", _sha256(weights)]  # the LFS sha256
    assert files["adapter_config.json"]["published"] == ["git-sha1", _git_sha1(config)]


@pytest.mark.parametrize("fault", ["cut", "corrupt"])
def test_a_source_that_fails_halfway_leaves_nothing_behind(engine, tiny, hub, fault):
    url = f"hf://org/a2-{fault}"
    hub.repos[url[5:]] = {f: (tiny / "local" / "a2" / f).read_bytes() for f in ADAPTER_FILES}
    before = _cache_state(engine)
    hub.fault, hub.cut = fault, False
    try:
        with pytest.raises(AdapterError) as refused:
            engine.add_adapter("a2-hub", url)
    finally:
        hub.fault, hub.cut = None, False
    expected = "cannot be downloaded" if fault == "cut" else "does not match its source"
    assert expected in str(refused.value) and url in refused.value.public
    assert str(engine.core.adapters.sources.cache_dir) not in refused.value.public
    assert "a2-hub" not in engine.adapter_names()
    assert _cache_state(engine) == before  # no new entry, no partial download
    assert _tokens(engine, [None])[0]  # still serving
    engine.add_adapter("a2-hub", url)  # the source repaired: the same URL registers
    engine.remove_adapter("a2-hub")


def test_a_damaged_cache_entry_is_downloaded_again(engine, tiny):
    engine.add_adapter("a3-s3", f"s3://{BUCKET}/a3")
    expected = _tokens(engine, ["a3-s3"])
    engine.remove_adapter("a3-s3")
    [weights] = [
        m.parent / "files" / "adapter_model.safetensors"
        for m in engine.core.adapters.sources.cache_dir.glob("*/manifest.json")
        if f"{BUCKET}/a3" in m.read_text()
    ]
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # same size, other bytes: only a checksum sees it
    engine.add_adapter("a3-s3", f"s3://{BUCKET}/a3")
    assert weights.read_bytes() == (tiny / "local" / "a3" / "adapter_model.safetensors").read_bytes()
    assert _tokens(engine, ["a3-s3"]) == expected


def test_the_size_bound_evicts_the_least_recently_used_unregistered_entry(tiny, s3, tmp_path):
    size = sum((tiny / "local" / "a0" / f).stat().st_size for f in ADAPTER_FILES)
    engine = _engine(tiny, tmp_path / "cache", schemes=("s3",), cache_bytes=int(2.5 * size))  # room for two
    cache = engine.core.adapters.sources.cache_dir

    def entries() -> set[str]:
        return {json.loads(m.read_text())["url"] for m in cache.glob("*/manifest.json")}

    engine.add_adapter("kept", f"s3://{BUCKET}/a0")  # registered throughout: never evicted
    engine.add_adapter("old", f"s3://{BUCKET}/a1")
    engine.remove_adapter("old")
    engine.add_adapter("new", f"s3://{BUCKET}/a2")  # a1 is the least recently used, and unregistered: it goes
    assert entries() == {f"s3://{BUCKET}/a0", f"s3://{BUCKET}/a2"}
    with pytest.raises(AdapterError, match="does not fit in the adapter cache"):
        engine.add_adapter("more", f"s3://{BUCKET}/a3")  # both entries are registered: nothing may go
    assert entries() == {f"s3://{BUCKET}/a0", f"s3://{BUCKET}/a2"} and "more" not in engine.adapter_names()
    engine.remove_adapter("new")
    engine.add_adapter("more", f"s3://{BUCKET}/a3")
    assert entries() == {f"s3://{BUCKET}/a0", f"s3://{BUCKET}/a3"}
    assert _tokens(engine, ["kept", "more"])  # what stayed still serves


def test_a_scheme_not_enabled_is_refused_by_name(tiny, s3, tmp_path):
    engine = _engine(tiny, tmp_path / "cache", schemes=("s3",))
    for url, scheme in (("hf://org/a1", "hf"), ("gs://bucket/a0", "gs"), ("s3a://bucket/a0", "s3a")):
        with pytest.raises(AdapterError) as refused:
            engine.add_adapter("x", url)
        message = str(refused.value)
        assert f"{scheme}://" in message and "not enabled" in message and "--adapter-source" in message
    assert engine.adapter_names() == [] and not (tmp_path / "cache").exists()  # nothing fetched, nothing written
    off = _engine(tiny, tmp_path / "off", schemes=None)  # the default: no scheme at all
    with pytest.raises(AdapterError, match=r"s3:// is not enabled \(enabled: none\)"):
        off.add_adapter("x", f"s3://{BUCKET}/a0")
    for schemes, reason in ((("file",), "--adapter-root"), (("nosuch",), "cannot be enabled"), (("S3",), "lower")):
        with pytest.raises(ValueError, match=reason):
            EngineConfig(adapter_sources=schemes)


def test_root_rules_still_hold_for_local_paths(engine, tiny, tmp_path):
    outside = write_adapter(tmp_path / "outside", seed=1)
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
        engine.add_adapter("outside", outside)
    engine.add_adapter("cached", f"s3://{BUCKET}/a0")
    copy = engine.core.adapters.path("cached")
    assert copy.is_relative_to(engine.core.adapters.sources.cache_dir)
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):  # the cache is a root for URLs only
        engine.add_adapter("sneaky", copy)


@pytest.mark.slow
def test_the_admin_api_registers_an_s3_adapter(s3, tmp_path):
    """Through a real server: POST /admin/adapters with an s3:// path registers it, requests use it, the registry
    records the URL (and its sync leaves it alone); vLLM's /v1/load_lora_adapter refuses a scheme not enabled."""
    import boto3

    write_adapter(tmp_path / "upload", seed=5)
    client = boto3.client("s3")
    for file in ADAPTER_FILES:
        client.upload_file(str(tmp_path / "upload" / file), BUCKET, f"smol/{file}")
    (tmp_path / "data").mkdir()
    (tmp_path / "roots").mkdir()
    extra = ["--allow-anonymous", "--adapter-source", "s3", "--adapter-cache-dir", str(tmp_path / "cache")]
    server = Server(tmp_path / "data", [tmp_path / "roots"], extra, env=s3)
    try:
        r = server.admin("POST", "/admin/adapters", json={"name": "from-s3", "path": f"s3://{BUCKET}/smol"})
        assert r.status_code == 200, r.text
        reply = server.client().chat.completions.create(
            model="from-s3", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert reply.model == "from-s3" and reply.usage.completion_tokens == 3
        info = server.admin("GET", "/admin/adapters/from-s3").json()
        assert info["path"] == f"s3://{BUCKET}/smol" and info["version"] == 1
        r = server.admin("POST", "/v1/load_lora_adapter", json={"lora_name": "hub", "lora_path": "hf://org/a1"})
        assert r.status_code == 400 and "hf://" in r.text and "--adapter-source" in r.text
        r = server.admin("POST", "/admin/adapters", json={"name": "missing", "path": f"s3://{BUCKET}/nothing"})
        assert r.status_code == 400 and "cannot be downloaded" in r.text
        assert server.admin("GET", "/admin/adapters/from-s3").json()["version"] == 1  # not reloaded by the sync
    finally:
        server.stop()
