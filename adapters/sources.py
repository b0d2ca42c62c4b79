"""Adapters registered from a URL: ``hf://ORG/NAME[@REVISION]`` (the Hugging Face Hub, through huggingface_hub) and
``SCHEME://PATH`` of an fsspec filesystem (``s3://BUCKET/PREFIX`` through s3fs), downloaded into a local cache
directory that the registry then reads like any local adapter.

Contracts:
- Only the schemes the operator enabled are fetched; any other URL is an AdapterError naming its scheme and the flag.
- A download lands in a temporary directory inside the cache and is renamed into place only once it is complete
  and verified: every size, and the checksum the source publishes where it has one (an S3 single-part ETag is the
  object's MD5 unless SSE-KMS or SSE-C encrypted it; the Hub gives its LFS files' sha256 and its other files' git
  blob sha1). A source that fails halfway leaves nothing in the cache.
- Each file's download stops the moment it passes the size its source listed (a larger Content-Length stops it
  before the first byte): the listed sizes are what room was made for, so a source that sends more than it listed
  never takes the cache past ``max_bytes`` (hf: not by a byte, the excess is never written; fsspec filesystems
  count after they write, by at most one read: 64 KiB for s3). Its partial file is removed and the AdapterError
  says so. A filesystem whose get_file reports no progress to its callback is checked after the download only.
- An entry's manifest records the sha256 of each of its files; reusing an entry checks them again.
- The cache holds at most ``max_bytes``: the least recently used entries go first, never one ``in_use`` names; a
  download that cannot fit is refused before it starts. One process per cache directory (an flock serializes
  downloads, but another process's registered adapters are not known here).
- Every AdapterError's texts (``public``, and the operator's) name the URL without credentials, ``public`` never a
  local path.
- Credentials and endpoints come from the environment, as each library reads them: huggingface_hub (HF_TOKEN,
  HF_ENDPOINT), botocore for s3 (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...). A URL that carries credentials
  (``user:password@``) is refused before anything is fetched, and shown with them masked (_shown). Those libraries
  are imported when a URL is fetched, never when this module is."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_server import envs
from lora_server.adapters.peft_format import AdapterError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what is downloaded of a PEFT directory
LOCAL_SCHEMES = ("file", "local")  # local files are registered by path, under an --adapter-root
FLAG = "--adapter-source"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_HF_URL = re.compile(r"hf://([\w.-]+/[\w.-]+)(?:@([^@\s]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ENTRY = re.compile(
    r"[0-9a-f]{32}"
)  # an entry's directory name: a hash of its source's identity (where, which version)
_READ = 1 << 20  # bytes of one read of a Hub download


def source_scheme(path: str | Path) -> str | None:
    """The scheme of a source URL (``hf``, ``s3``...), lower case; None for a local path (a Path always is one)."""
    match = _SCHEME.match(path) if isinstance(path, str) else None
    return match.group(1).lower() if match else None


def check_schemes(schemes: Iterable[str]) -> None:
    """ValueError unless each scheme can be enabled: ``hf``, or an fsspec protocol whose package is installed."""
    for scheme in schemes:
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
            raise ValueError(f"adapter source {scheme!r} is not a URL scheme in lower case (hf, s3, gs...)")
        if scheme in LOCAL_SCHEMES:
            raise ValueError(f"adapter source {scheme!r}: local adapters are registered by path, under --adapter-root")
        if scheme == "hf":
            continue
        import fsspec

        try:
            fsspec.get_filesystem_class(scheme)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"adapter source {scheme!r} cannot be enabled: {exc}") from None


def _shown(url: str) -> str:
    """The URL as messages show it: its user information (``user:password@``) masked as ``***@``. A URL has some
    when its authority (after ``://``, to the first ``/``) holds ``@``, or holds ``:`` while an ``@`` follows: a
    secret may hold ``/`` (AWS secret keys do), so all up to the last ``@`` is masked; masking too much (an ``@``
    in the path of ``http://host:port/...``) is the safe mistake."""
    match = _SCHEME.match(url)
    rest = url[match.end() :] if match else ""
    authority = rest.split("/", 1)[0]
    if match is None or "@" not in rest or not ("@" in authority or ":" in authority):
        return url
    return f"{url[: match.end()]}***@{rest.rsplit('@', 1)[1]}"


@dataclass(frozen=True, slots=True)
class _Remote:
    """One file to download: its name in the entry, where its source keeps it, its size, and the checksum the
    source publishes for it (algorithm, hex digest), if any."""

    name: str
    location: str
    size: int
    published: tuple[str, str] | None


class AdapterSources:
    """The enabled schemes and the cache they download into (``cache_dir``: entries ``KEY/manifest.json`` and
    ``KEY/files/``, downloads in progress in ``.tmp-*``). Thread-safe: one fetch at a time."""

    def __init__(self, schemes: Iterable[str] = (), cache_dir: str | Path | None = None, max_bytes: int = 0) -> None:
        self.schemes = frozenset(schemes)
        if self.schemes and cache_dir is None:
            raise ValueError("adapter sources need a cache directory")
        self.cache_dir = Path(cache_dir or ".").expanduser().resolve()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._urls: dict[Path, str] = {}  # entry directory -> the URL it was fetched from
        self._fresh: set[Path] = set()  # entries the latest fetch of each downloaded (not reused): discard's

    def url_of(self, path: Path) -> str | None:
        """The URL an adapter path in the cache was fetched from (None: not a cache entry's)."""
        return next((url for entry, url in list(self._urls.items()) if path.is_relative_to(entry)), None)

    def fetch(self, url: str, in_use: Callable[[], Collection[Path]]) -> Path:
        """The local copy of ``url``'s adapter (its PEFT directory, or the one file the URL names), downloaded now or
        reused; AdapterError if the scheme is not enabled or the source cannot be read or verified. ``in_use()``
        gives the paths that registered adapters read (called under this cache's lock); their entries are never
        evicted. The copy returned is protected only once it is registered: callers that check and install apart
        serialize registrations (the server does, under EngineAdapters.lock)."""
        scheme, shown = source_scheme(url), _shown(url)
        if scheme not in self.schemes:
            enabled = ", ".join(sorted(self.schemes)) or "none"
            raise AdapterError(f"adapter source {scheme}:// is not enabled (enabled: {enabled}); enable it with {FLAG}")
        if shown != url:  # never handed to a library, whose errors would show them
            raise AdapterError(
                f"{shown}: credentials in an adapter URL are not read (and not shown): {scheme}:// takes them from the "
                "server's environment (HF_TOKEN for hf, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3); "
                "register the URL without user:password@"
            )
        given, url = url, url.rstrip("/")
        with self._lock, self._exclusive():
            try:
                source = _Hub(url) if scheme == "hf" else _Objects(url, scheme)
                identity = source.identity()
            except AdapterError:
                raise
            except Exception as exc:  # whatever the client library raises: the source cannot be read now
                raise _unreadable(shown, exc) from exc
            entry = self.cache_dir / hashlib.sha256(identity.encode()).hexdigest()[:32]
            if entry.is_dir() and self._reusable(entry, in_use(), shown):
                os.utime(entry / "manifest.json")  # its last use: the LRU order
                self._fresh.discard(entry)
            else:
                self._download(source, url, entry, in_use)
                self._fresh.add(entry)
            self._urls[entry] = given  # as the caller spelled it: what it recorded elsewhere (the registry store)
            return entry / json.loads((entry / "manifest.json").read_text())["path"]

    def discard(self, path: Path, in_use: Callable[[], Collection[Path]]) -> None:
        """Remove the entry ``path`` (what ``fetch`` returned) lies in, if that fetch downloaded it and no path of
        ``in_use()`` lies in it: for a registration refused after its download, which so leaves the cache as it
        was but for the unregistered entries evicted to make room. An entry the fetch reused stays."""
        with self._lock, self._exclusive():
            entry = next((e for e in self._fresh if path.is_relative_to(e)), None)
            if entry is not None and not _used(entry, in_use()):
                self._fresh.discard(entry)
                self._urls.pop(entry, None)
                shutil.rmtree(entry, ignore_errors=True)

    def _download(self, source: _Hub | _Objects, url: str, entry: Path, in_use: Callable[[], Collection[Path]]) -> None:
        shown = _shown(url)
        try:
            remotes = source.files()
        except AdapterError:
            raise
        except Exception as exc:
            raise _unreadable(shown, exc) from exc
        self._make_room(sum(r.size for r in remotes), in_use(), shown)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.cache_dir))
        try:
            try:
                source.download(remotes, tmp / "files", shown)
            except AdapterError:  # one that sent more than it listed (_Cap)
                raise
            except Exception as exc:
                raise _unreadable(shown, exc) from exc
            files = {r.name: _verified(tmp / "files" / r.name, r, shown) for r in remotes}
            manifest = {"url": shown, "path": source.local_path, "files": files, "fetched_at": time.time()}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            os.rename(tmp, entry)  # complete and verified: only now does it exist under its name
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _reusable(self, entry: Path, in_use: Collection[Path], shown: str) -> bool:
        """Whether an entry's files still have the sizes and sha256 its manifest recorded. A damaged entry is
        removed (AdapterError when a registered adapter still reads it)."""
        try:
            manifest = json.loads((entry / "manifest.json").read_text())
            intact = all(
                _digests(entry / "files" / name) == (meta["size"], {"sha256": meta["sha256"]})
                for name, meta in manifest["files"].items()
            )
        except (OSError, ValueError, KeyError, TypeError):
            intact = False
        if not intact:
            if _used(entry, in_use):
                raise AdapterError(
                    f"the cached copy of {shown} ({entry}) no longer matches its checksums "
                    "and a registered adapter reads it; unload those adapters and register again",
                    f"the cached copy of {shown} no longer matches its checksums; unload the adapters that use it and "
                    "register again",
                )
            shutil.rmtree(entry)
        return intact

    def _make_room(self, need: int, in_use: Collection[Path], shown: str) -> None:
        """Evict the least recently used entries no registered adapter reads until ``need`` more bytes fit."""
        if need > self.max_bytes:
            raise AdapterError(f"{shown} is {_mib(need)}, more than the adapter cache holds ({_mib(self.max_bytes)})")
        entries = sorted(self._entries(), key=lambda e: e[1])  # least recently used first
        held = sum(size for _, _, size in entries)
        for entry, _, size in entries:
            if held + need <= self.max_bytes:
                break
            if not _used(entry, in_use):
                shutil.rmtree(entry)
                self._urls.pop(entry, None)
                self._fresh.discard(entry)
                held -= size
        if held + need > self.max_bytes:
            raise AdapterError(
                f"{shown} ({_mib(need)}) does not fit in the adapter cache ({_mib(self.max_bytes)}): registered "
                f"adapters hold {_mib(held)} of it; unload some, or raise --adapter-cache-gb"
            )

    def _entries(self) -> Iterator[tuple[Path, float, int]]:
        """Every complete entry: its directory, last use (its manifest's mtime) and bytes."""
        for entry in self.cache_dir.iterdir():
            manifest = entry / "manifest.json"
            if not (_ENTRY.fullmatch(entry.name) and manifest.is_file()):
                continue
            try:
                files = json.loads(manifest.read_text())["files"]
                yield entry, manifest.stat().st_mtime, sum(int(meta["size"]) for meta in files.values())
            except (OSError, ValueError, KeyError, TypeError):  # a damaged manifest: first to go
                yield entry, 0.0, 0

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The cache directory to this fetch alone, across processes too; leftovers of a process that died while it
        downloaded (``.tmp-*``) are removed first."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cache_dir / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for partial in self.cache_dir.glob(".tmp-*"):
                shutil.rmtree(partial, ignore_errors=True)
            yield


class _Hub:
    """``hf://ORG/NAME[@REVISION]`` (default revision: main): the PEFT files at one commit, each streamed from its
    resolve URL through huggingface_hub's HTTP session with its token (dropped on a redirect to another host, the
    CDN), each chunk counted before it is written (_Cap). Not snapshot_download: it checks a file's size only once
    the whole file is on disk, and may fetch through hf_xet, which no count reaches."""

    local_path = "files"

    def __init__(self, url: str) -> None:
        from huggingface_hub import HfApi

        match = _HF_URL.fullmatch(url)
        if match is None:
            raise AdapterError(f"{_shown(url)} is not of the form hf://ORG/NAME[@REVISION]")
        self.repo, self.revision = match.group(1), match.group(2) or "main"
        self.api = HfApi(endpoint=envs.hf_endpoint())  # None: huggingface_hub's own default
        self.commit = ""

    def identity(self) -> str:
        """The repo at the commit the revision names now (a commit id is one already: no request)."""
        pinned = _COMMIT.fullmatch(self.revision)
        self.commit = self.revision if pinned else str(self.api.model_info(self.repo, revision=self.revision).sha)
        return f"hf://{self.repo}@{self.commit}"

    def files(self) -> list[_Remote]:
        from huggingface_hub.hf_api import RepoFile

        tree = self.api.list_repo_tree(self.repo, revision=self.commit)
        found = {f.path: f for f in tree if isinstance(f, RepoFile)}
        missing = [name for name in ADAPTER_FILES if name not in found]
        if missing:
            raise AdapterError(f"hf://{self.repo}@{self.commit} has no {missing[0]}")
        return [
            _Remote(name, name, f.size, ("sha256", f.lfs.sha256) if f.lfs else ("git-sha1", f.blob_id))
            for name, f in ((name, found[name]) for name in ADAPTER_FILES)
        ]

    def download(self, remotes: list[_Remote], dest: Path, shown: str) -> None:
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        dest.mkdir()
        headers = {**build_hf_headers(), "Accept-Encoding": "identity"}  # the bytes as listed: counted as they come
        for r in remotes:
            url = hf_hub_url(self.repo, r.location, revision=self.commit, endpoint=self.api.endpoint)
            timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
            with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=timeout) as answer:
                hf_raise_for_status(answer)
                cap = _Cap(r, shown)
                if "content-encoding" not in answer.headers:  # its length is the file's
                    cap(int(answer.headers.get("content-length", 0)), 0)
                got = 0
                with (dest / r.name).open("wb") as file:
                    for chunk in answer.iter_bytes(_READ):
                        cap(None, got + len(chunk))  # before it is written: the excess never is
                        file.write(chunk)
                        got += len(chunk)


class _Objects:
    """``SCHEME://PATH`` of an fsspec filesystem: the PEFT files in the "directory" PATH, or PATH itself when it is
    one object (e.g. a .gguf LoRA). A fresh filesystem object per fetch: credentials and endpoint as the environment
    has them now."""

    def __init__(self, url: str, scheme: str) -> None:
        import fsspec

        self.scheme = scheme
        self.fs = fsspec.filesystem(scheme, skip_instance_cache=True)
        self.path = self.fs._strip_protocol(url)
        self.local_path = "files"
        self._listing: list[dict[str, Any]] = []

    def identity(self) -> str:
        """The objects' names, sizes and versions (ETag, or modification time): what changes when they do."""
        info = self.fs.info(self.path)
        if info["type"] == "file":
            self._listing = [info]
            self.local_path = f"files/{posixpath.basename(info['name'])}"
        else:
            found = {
                posixpath.basename(i["name"]): i for i in self.fs.ls(self.path, detail=True) if i["type"] == "file"
            }
            missing = [name for name in ADAPTER_FILES if name not in found]
            if missing:
                raise AdapterError(f"{self.scheme}://{self.path} has no {missing[0]}")
            self._listing = [found[name] for name in ADAPTER_FILES]
        listing = (f"{i['name']} {i['size']} {_object_version(i)}" for i in self._listing)
        return "\n".join([f"{self.scheme}://{self.path}", *listing])

    def files(self) -> list[_Remote]:
        return [
            _Remote(posixpath.basename(i["name"]), i["name"], int(i["size"]), self._published_md5(i["name"]))
            for i in self._listing
        ]

    def download(self, remotes: list[_Remote], dest: Path, shown: str) -> None:
        """Each file with the filesystem's get_file, its callback counting (_Cap). For s3 one GET streamed in 64 KiB
        reads: s3fs's concurrent download of a large object sizes its file by the GET's Content-Length and reads
        whole ranges into memory, before any count."""
        from fsspec.callbacks import Callback

        dest.mkdir()
        sequential = {"max_concurrency": 1} if self.scheme in ("s3", "s3a") else {}
        for r in remotes:
            self.fs.get_file(
                r.location, str(dest / r.name), callback=Callback(hooks={"cap": _Cap(r, shown)}), **sequential
            )

    def _published_md5(self, location: str) -> tuple[str, str] | None:
        """An S3 object's MD5: its ETag when it was uploaded in one part and is not encrypted with SSE-KMS or SSE-C
        (those ETags are something else); None on other filesystems."""
        if self.scheme not in ("s3", "s3a"):
            return None
        bucket, key, _ = self.fs.split_path(location)
        head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        etag = str(head.get("ETag", "")).strip('"')
        encrypted = str(head.get("ServerSideEncryption", "")).startswith("aws:kms") or head.get("SSECustomerAlgorithm")
        return ("md5", etag) if re.fullmatch(r"[0-9a-f]{32}", etag) and not encrypted else None


def _object_version(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "VersionId", "LastModified", "mtime", "updated"):
        if info.get(key):
            return str(info[key])
    return ""


@dataclass(frozen=True, slots=True)
class _Cap:
    """A download's check as its bytes come (an fsspec callback hook: called with the size the answer announces,
    None if it does not, and the bytes so far): AdapterError once either passes the size the source listed."""

    remote: _Remote
    shown: str

    def __call__(self, size: int | None, value: int, **_: object) -> None:
        if max(size or 0, value) > self.remote.size:
            said = f"it announced {size}" if size and size > self.remote.size else f"it sent {value} or more"
            raise AdapterError(
                f"{self.shown}: {self.remote.name} is larger than its source listed ({self.remote.size} bytes; "
                f"{said}): the download was stopped there and removed; nothing was registered"
            )


def _verified(path: Path, remote: _Remote, shown: str) -> dict[str, Any]:
    """The manifest's record of a downloaded file (size, sha256), once its size and published checksum match."""
    if not path.is_file():
        raise AdapterError(f"{shown}: {remote.name} was not downloaded")
    algorithm, published = remote.published or (None, None)
    size, digests = _digests(path, algorithm)
    if size != remote.size or (algorithm is not None and digests[algorithm] != published):
        said = "" if algorithm is None else f", {algorithm} {published}"
        raise AdapterError(
            f"{shown}: {remote.name} does not match its source (got {size} bytes, "
            f"{', '.join(f'{a} {d}' for a, d in digests.items())}; the source says {remote.size} bytes{said}); "
            "nothing was registered",
            f"{shown}: {remote.name} does not match its source's size or checksum; nothing was registered",
        )
    return {"size": size, "sha256": digests["sha256"], **({"published": [algorithm, published]} if algorithm else {})}


def _digests(path: Path, algorithm: str | None = None) -> tuple[int, dict[str, str]]:
    """A file's size and sha256, and ``algorithm``'s digest too (md5, or git-sha1: git's blob id), in one read."""
    hashers = {"sha256": hashlib.sha256()}
    if algorithm == "md5":
        hashers["md5"] = hashlib.md5(usedforsecurity=False)
    elif algorithm == "git-sha1":
        hashers["git-sha1"] = hashlib.sha1(b"blob %d\0" % path.stat().st_size, usedforsecurity=False)
    size = 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            size += len(chunk)
            for hasher in hashers.values():
                hasher.update(chunk)
    return size, {name: hasher.hexdigest() for name, hasher in hashers.items()}


def _used(entry: Path, in_use: Collection[Path]) -> bool:
    return any(p.is_relative_to(entry) for p in in_use)


def _unreadable(shown: str, exc: Exception) -> AdapterError:
    """A source's failure: the library's message for the operator; for anyone else only its kind (it may name a
    local path)."""
    return AdapterError(
        f"{shown} cannot be downloaded: {type(exc).__name__}: {exc}; nothing was registered",
        f"{shown} cannot be downloaded ({type(exc).__name__}); nothing was registered",
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
