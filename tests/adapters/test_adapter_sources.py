"""Adapters registered from a URL (adapters/sources.py), against real servers: moto's S3-compatible HTTP server for
s3://, and a Hub-shaped HTTP server (the endpoints huggingface_hub calls) for hf://. An adapter from either serves
the same greedy tokens as the same PEFT directory registered from disk, in one batch; a source that fails halfway (a
cut connection, bytes that fail the checksum) leaves nothing registered and nothing in the cache; a source that
sends more than it listed (the Hub server, and a proxy in front of moto) is stopped at the listed size, the cache
never holding more, as the lying server itself measures while it sends; a URL carrying credentials is refused
without showing them; the cache's size bound evicts the least recently used entry no registered adapter reads; a
scheme the operator did not enable is refused by name; and the admin API of a real server registers an s3://
adapter, refusing a lying source and credentials in a URL with a 400."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lora_server.adapters.peft_format import AdapterError
from lora_server.adapters.sources import ADAPTER_FILES, AdapterSources
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.adapters.test_adapter_keys import TINY, save_peft
from tests.servers import Server, free_port, write_adapter

BUCKET = "adapters"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = [5, 17, 42, 9, 77, 3, 101, 64, 12, 33]
LIE = 200 << 20  # what a lying source sends of adapter_model.safetensors, whatever it listed
LIE_CACHE = 20 << 20  # the cache it meets (the security review's figures: 200 MiB sent into 20 MiB)
READ = 64 << 10  # the most a download may overshoot its listed size before it stops: s3fs's read (hf: none)
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


class Watch:
    """What a lying server sees of the cache under test while it sends its lie: before each MiB it sends, the bytes
    of every file under ``cache`` (downloads in progress included); ``peak`` the most it saw, ``sent`` what it got
    to send. The peak is a lower bound of the cache's true peak (what is in flight is not yet written)."""

    def __init__(self, cache: Path | None = None) -> None:
        self.cache, self.peak, self.sent = cache, 0, 0

    def sample(self) -> None:
        held = 0
        for folder, _, names in os.walk(self.cache) if self.cache else ():
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # removed while we walk: a refused download going
                    held += os.lstat(os.path.join(folder, name)).st_size
        self.peak = max(self.peak, held)


def _send_lie(handler: BaseHTTPRequestHandler, lie: str, watch: Watch, headers: dict[str, str]) -> None:
    """A 200 answer of LIE zero bytes, whatever the listing said: with a Content-Length that says so ("sized"), or
    none (the body ends when the connection closes: the client can only count); ``watch`` samples before each MiB."""
    handler.send_response(200)
    for key, value in headers.items():
        handler.send_header(key, value)
    if lie == "sized":
        handler.send_header("Content-Length", str(LIE))
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.close_connection = True
    chunk = bytes(1 << 20)
    try:
        for _ in range(LIE // len(chunk)):
            watch.sample()
            handler.wfile.write(chunk)
            watch.sent += len(chunk)
        handler.wfile.flush()
    except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: what the fix does
        pass
    watch.sample()


class Hub(ThreadingHTTPServer):
    """The Hub's endpoints that huggingface_hub calls, for repos held in memory (``repos``: id -> file -> bytes,
    all at COMMIT, revision ``main`` too). ``fault``: "cut" sends half of adapter_model.safetensors and closes the
    connection (the Hub answers 500 after that), "corrupt" sends the right size with one byte changed; "sized" and
    "unsized" send LIE bytes of it (_send_lie), ``watch`` watching."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.fault: str | None = None
        self.cut = False
        self.requests: list[str] = []
        self.watch = Watch()

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
            if body and lfs and hub.fault in ("sized", "unsized"):
                return _send_lie(self, hub.fault, hub.watch, {"X-Repo-Commit": COMMIT})
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


class S3Liar(ThreadingHTTPServer):
    """moto's S3 behind a proxy that passes every request on, but for the GET of an object ``liar/...safetensors``
    when ``lie`` is "sized" or "unsized": then it sends LIE bytes (_send_lie, ``watch`` watching), whatever the
    listing (moto's, of the object it holds) said."""

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), S3LiarHandler)
        self.upstream = upstream.removeprefix("http://")
        self.lie: str | None = None
        self.watch = Watch()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class S3LiarHandler(BaseHTTPRequestHandler):
    server: S3Liar

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._forward()

    def do_GET(self) -> None:
        key = self.path.split("?")[0]
        if self.server.lie and re.fullmatch(rf"/{BUCKET}/liar/.*\.safetensors", key):
            return _send_lie(self, self.server.lie, self.server.watch, {"ETag": '"0"'})
        self._forward()

    def _forward(self) -> None:
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=60)
        upstream.request(self.command, self.path, headers=dict(self.headers))
        answer = upstream.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        hop = ("connection", "transfer-encoding", "server", "date", "content-length")
        for key, value in answer.getheaders():
            if key.lower() not in hop:
                self.send_header(key, value)
        self.send_header("Content-Length", answer.getheader("Content-Length") or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        upstream.close()


@pytest.fixture(scope="module")
def s3_liar(s3, tiny):
    """The lying proxy in front of moto; adapter a0 uploaded under s3://adapters/liar (its true sizes listed)."""
    import boto3

    client = boto3.client("s3")
    for file in ADAPTER_FILES:
        client.upload_file(str(tiny / "local" / "a0" / file), BUCKET, f"liar/{file}")
    server = S3Liar(s3["AWS_ENDPOINT_URL"])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
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


def _cache(engine: Engine) -> Path:
    """The directory adapters from sources are downloaded into."""
    return Path(engine.config.adapter_cache_path).expanduser().resolve()


def _cache_state(engine: Engine) -> tuple[list[str], list[str]]:
    """The cache's complete entries and anything else in it (but its lock file)."""
    cache = _cache(engine)
    names = sorted(p.name for p in cache.iterdir() if p.name != ".lock")
    return [n for n in names if (cache / n / "manifest.json").is_file()], [
        n for n in names if not (cache / n / "manifest.json").is_file()
    ]


def _tokens(engine: Engine, adapters: list[str | None]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate([PROMPT] * len(adapters), GREEDY, adapters=adapters)]


# ---- the tests ------------------------------------------------------------------------------------------------


def test_an_s3_adapter_serves_what_its_local_directory_serves(engine, tiny):
    engine.adapters.add("a0-local", tiny / "local" / "a0")
    engine.adapters.add("a0-s3", f"s3://{BUCKET}/a0")
    base, local, remote = _tokens(engine, [None, "a0-local", "a0-s3"])
    assert local == remote and local != base
    info = engine.adapters.info("a0-s3")
    assert info is not None and info.path == f"s3://{BUCKET}/a0"  # the source, not the cache's copy
    [manifest] = [m for m in _cache(engine).glob("*/manifest.json") if "a0" in m.read_text()]
    files = json.loads(manifest.read_text())["files"]
    for name in ADAPTER_FILES:  # the sha256 recorded; the ETag (MD5 of a single-part upload) checked
        data = (tiny / "local" / "a0" / name).read_bytes()
        assert files[name]["sha256"] == _sha256(data)
        assert files[name]["published"] == ["md5", hashlib.md5(data).hexdigest()]


def test_a_hub_adapter_serves_what_its_local_directory_serves(engine, tiny, hub):
    engine.adapters.add("a1-local", tiny / "local" / "a1")
    engine.adapters.add("a1-hub", "hf://org/a1")
    engine.adapters.add("a1-hub-pinned", f"hf://org/a1@{COMMIT}")  # the same commit: the same entry, reused
    base, local, remote, pinned = _tokens(engine, [None, "a1-local", "a1-hub", "a1-hub-pinned"])
    assert local == remote == pinned and local != base
    downloads = [r for r in hub.requests if r.startswith("GET /org/a1/resolve/")]
    assert sorted(downloads) == [f"GET /org/a1/resolve/{COMMIT}/{name}" for name in ADAPTER_FILES]  # once; no README
    [manifest] = [m for m in _cache(engine).glob("*/manifest.json") if "org/a1" in m.read_text()]
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
            engine.adapters.add("a2-hub", url)
    finally:
        hub.fault, hub.cut = None, False
    expected = "cannot be downloaded" if fault == "cut" else "does not match its source"
    assert expected in str(refused.value) and url in refused.value.public
    assert str(_cache(engine)) not in refused.value.public
    assert "a2-hub" not in engine.adapters.names()
    assert _cache_state(engine) == before  # no new entry, no partial download
    assert _tokens(engine, [None])[0]  # still serving
    engine.adapters.add("a2-hub", url)  # the source repaired: the same URL registers
    engine.adapters.remove("a2-hub")


@pytest.mark.parametrize("lie", ["sized", "unsized"])
@pytest.mark.parametrize("scheme", ["s3", "hf"])
def test_a_source_that_sends_more_than_it_listed_is_stopped_at_the_listing(
    tiny, s3_liar, hub, tmp_path, monkeypatch, scheme, lie
):
    """A source lists adapter a0's true sizes (a few KiB), then sends LIE (200 MiB) of its weights into a 20 MiB
    cache, saying so in its Content-Length or not: the download stops at the listed size, the refusal says so, and
    nothing stays in the cache. The lying server samples the cache before each MiB it sends: the most it sees is
    within one read of the listed size (before the fix: about 200 MiB, the whole lie). Once the source is honest
    again the same URL registers."""
    engine = _engine(tiny, tmp_path / "cache", cache_bytes=LIE_CACHE)
    listed = sum((tiny / "local" / "a0" / f).stat().st_size for f in ADAPTER_FILES)
    watch = Watch(_cache(engine))
    if scheme == "hf":
        hub.repos["org/liar"] = {f: (tiny / "local" / "a0" / f).read_bytes() for f in ADAPTER_FILES}
        url, hub.watch, hub.fault = "hf://org/liar", watch, lie
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_liar.url)  # read per fetch: this test's requests go to the liar
        url, s3_liar.watch, s3_liar.lie = f"s3://{BUCKET}/liar", watch, lie
    try:
        with pytest.raises(AdapterError) as refused:
            engine.adapters.add("liar", url)
    finally:
        hub.fault = s3_liar.lie = None
    print(
        f"\n{scheme} {lie}: listed {listed} bytes, the liar sent {watch.sent / (1 << 20):.0f} MiB of {LIE >> 20}, "
        f"the cache's peak it saw {watch.peak} bytes ({watch.peak / (1 << 20):.2f} MiB; bound {LIE_CACHE >> 20} MiB)"
    )
    assert watch.peak <= listed + READ
    for text in (str(refused.value), refused.value.public):
        assert url in text and "larger than its source listed" in text, text
    assert str(watch.cache) not in refused.value.public
    assert _cache_state(engine) == ([], []) and engine.adapters.names() == []
    engine.adapters.add("liar", url)  # the source honest again: it registers
    assert _tokens(engine, ["liar"])


@pytest.mark.parametrize(
    "url",
    [
        f"s3://key-id:secret-pass@{BUCKET}/a0",
        f"s3://AKIAEXAMPLEKEYID:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@{BUCKET}/a0",  # a secret with slashes
        f"s3://AKIAEXAMPLEKEYID@{BUCKET}/a0",
        "hf://someone:hf_secrettoken@org/a1",
    ],
)
def test_credentials_in_a_url_are_refused_never_shown(engine, url):
    """Credentials come from the environment: a URL carrying user:password@ (the password may hold slashes, as AWS
    secret keys do) is refused before anything is fetched, and neither text of the refusal shows any part of it."""
    secrets = re.split(r"[:/]", url.split("://")[1].rsplit("@", 1)[0])  # each part, each piece of a secret
    before = _cache_state(engine)
    with pytest.raises(AdapterError) as refused:
        engine.adapters.add("creds", url)
    for text in (str(refused.value), refused.value.public):
        assert not [s for s in secrets if s in text], text
        assert "credentials" in text
    assert _cache_state(engine) == before and "creds" not in engine.adapters.names()


def test_discard_leaves_the_cache_as_it_was_before_a_download(s3, tmp_path):
    """AdapterSources.discard, for a registration refused after its download: the entry that fetch downloaded goes
    (the cache as it was before), one it reused stays, and so does one a registered adapter reads."""
    sources = AdapterSources(("s3",), tmp_path / "cache", 64 << 20)
    nothing: tuple[Path, ...] = ()
    kept = sources.fetch(f"s3://{BUCKET}/a0", lambda: nothing)
    before = sorted(os.listdir(sources.cache_dir))
    fresh = sources.fetch(f"s3://{BUCKET}/a1", lambda: nothing)
    sources.discard(fresh, lambda: nothing)
    assert sorted(os.listdir(sources.cache_dir)) == before and sources.url_of(fresh) is None
    reused = sources.fetch(f"s3://{BUCKET}/a0", lambda: nothing)
    sources.discard(reused, lambda: nothing)
    assert reused == kept and kept.is_dir()
    read = sources.fetch(f"s3://{BUCKET}/a1", lambda: nothing)
    sources.discard(read, lambda: (read,))
    assert read.is_dir() and sources.url_of(read) == f"s3://{BUCKET}/a1"


def test_a_damaged_cache_entry_is_downloaded_again(engine, tiny):
    engine.adapters.add("a3-s3", f"s3://{BUCKET}/a3")
    expected = _tokens(engine, ["a3-s3"])
    engine.adapters.remove("a3-s3")
    [weights] = [
        m.parent / "files" / "adapter_model.safetensors"
        for m in _cache(engine).glob("*/manifest.json")
        if f"{BUCKET}/a3" in m.read_text()
    ]
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # same size, other bytes: only a checksum sees it
    engine.adapters.add("a3-s3", f"s3://{BUCKET}/a3")
    assert weights.read_bytes() == (tiny / "local" / "a3" / "adapter_model.safetensors").read_bytes()
    assert _tokens(engine, ["a3-s3"]) == expected


def test_the_size_bound_evicts_the_least_recently_used_unregistered_entry(tiny, s3, tmp_path):
    size = sum((tiny / "local" / "a0" / f).stat().st_size for f in ADAPTER_FILES)
    engine = _engine(tiny, tmp_path / "cache", schemes=("s3",), cache_bytes=int(2.5 * size))  # room for two
    cache = _cache(engine)

    def entries() -> set[str]:
        return {json.loads(m.read_text())["url"] for m in cache.glob("*/manifest.json")}

    engine.adapters.add("kept", f"s3://{BUCKET}/a0")  # registered throughout: never evicted
    engine.adapters.add("old", f"s3://{BUCKET}/a1")
    engine.adapters.remove("old")
    engine.adapters.add("new", f"s3://{BUCKET}/a2")  # a1 is the least recently used, and unregistered: it goes
    assert entries() == {f"s3://{BUCKET}/a0", f"s3://{BUCKET}/a2"}
    with pytest.raises(AdapterError, match="does not fit in the adapter cache"):
        engine.adapters.add("more", f"s3://{BUCKET}/a3")  # both entries are registered: nothing may go
    assert entries() == {f"s3://{BUCKET}/a0", f"s3://{BUCKET}/a2"} and "more" not in engine.adapters.names()
    engine.adapters.remove("new")
    engine.adapters.add("more", f"s3://{BUCKET}/a3")
    assert entries() == {f"s3://{BUCKET}/a0", f"s3://{BUCKET}/a3"}
    assert _tokens(engine, ["kept", "more"])  # what stayed still serves


def test_a_scheme_not_enabled_is_refused_by_name(tiny, s3, tmp_path):
    engine = _engine(tiny, tmp_path / "cache", schemes=("s3",))
    for url, scheme in (("hf://org/a1", "hf"), ("gs://bucket/a0", "gs"), ("s3a://bucket/a0", "s3a")):
        with pytest.raises(AdapterError) as refused:
            engine.adapters.add("x", url)
        message = str(refused.value)
        assert f"{scheme}://" in message and "not enabled" in message and "--adapter-source" in message
    assert engine.adapters.names() == [] and not (tmp_path / "cache").exists()  # nothing fetched, nothing written
    off = _engine(tiny, tmp_path / "off", schemes=None)  # the default: no scheme at all
    with pytest.raises(AdapterError, match=r"s3:// is not enabled \(enabled: none\)"):
        off.adapters.add("x", f"s3://{BUCKET}/a0")
    for schemes, reason in ((("file",), "--adapter-root"), (("nosuch",), "cannot be enabled"), (("S3",), "lower")):
        with pytest.raises(ValueError, match=reason):
            EngineConfig(adapter_sources=schemes)


def test_root_rules_still_hold_for_local_paths(engine, tiny, tmp_path):
    outside = write_adapter(tmp_path / "outside", seed=1)
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
        engine.adapters.add("outside", outside)
    engine.adapters.add("cached", f"s3://{BUCKET}/a0")
    copy = engine.adapters.files("cached")
    assert copy.is_relative_to(_cache(engine))
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):  # the cache is a root for URLs only
        engine.adapters.add("sneaky", copy)


@pytest.mark.slow
def test_the_admin_api_registers_an_s3_adapter(s3, s3_liar, tmp_path):
    """Through a real server (its S3 requests through the lying proxy, honest but for what it is told to lie about):
    POST /admin/adapters with an s3:// path registers it, requests use it, the registry records the URL (and its
    sync leaves it alone); vLLM's /v1/load_lora_adapter refuses a scheme not enabled; a source that sends more
    than it listed, and a URL with credentials, are 400s that leave the cache as it was, the credentials shown
    neither in the answer nor in the server's log."""
    import boto3

    write_adapter(tmp_path / "upload", seed=5)
    client = boto3.client("s3")
    for file in ADAPTER_FILES:
        client.upload_file(str(tmp_path / "upload" / file), BUCKET, f"smol/{file}")
    (tmp_path / "data").mkdir()
    (tmp_path / "roots").mkdir()
    extra = ["--allow-anonymous", "--adapter-source", "s3", "--adapter-cache-dir", str(tmp_path / "cache")]
    server = Server(tmp_path / "data", [tmp_path / "roots"], extra, env={**s3, "AWS_ENDPOINT_URL": s3_liar.url})
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
        cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
        s3_liar.lie = "unsized"
        try:
            r = server.admin("POST", "/admin/adapters", json={"name": "liar", "path": f"s3://{BUCKET}/liar"})
        finally:
            s3_liar.lie = None
        assert r.status_code == 400 and "larger than its source listed" in r.text, r.text
        secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
        path = f"s3://AKIAEXAMPLEKEYID:{secret}@{BUCKET}/smol"
        r = server.admin("POST", "/admin/adapters", json={"name": "creds", "path": path})
        assert r.status_code == 400 and "credentials" in r.text, r.text
        for part in ("AKIAEXAMPLEKEYID", *secret.split("/")):
            assert part not in r.text and part not in server.log_text()
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == cached
    finally:
        server.stop()


def test_a_download_refused_after_it_arrived_leaves_the_cache_as_it_was(engine, tiny, tmp_path):
    """An adapter downloaded, then refused by the checks every adapter takes (here its config sets a key the server
    does not implement): the 400, and no entry of it left in the cache."""
    import boto3

    bad = tmp_path / "bad"
    shutil.copytree(tiny / "local" / "a0", bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "layer_replication": [[0, 1]]}))
    client = boto3.client("s3")
    for file in ADAPTER_FILES:
        client.upload_file(str(bad / file), BUCKET, f"bad/{file}")
    before = _cache_state(engine)
    with pytest.raises(AdapterError, match="layer_replication"):
        engine.adapters.add("bad", f"s3://{BUCKET}/bad")
    assert _cache_state(engine) == before and "bad" not in engine.adapters.names()
