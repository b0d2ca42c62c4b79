"""``lora-server serve``: builds the engine, the registry store, its sync and the app, preloads adapters, runs
uvicorn."""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from lora_server import envs
from lora_server.adapters import demo_adapters
from lora_server.adapters.peft_format import AdapterError
from lora_server.admin.store import RegistryStore, StoreStatus, validate_name
from lora_server.admin.store.change_feed import POLL_S
from lora_server.admin.store.open import open_store
from lora_server.config import EngineConfig, ServerConfig
from lora_server.engine import Engine
from lora_server.engine.adapter_registry import AdapterSpec
from lora_server.model.loader import default_model_path
from lora_server.server.app import build_app
from lora_server.server.http_edge import connection_cap, guarded_protocol, raise_descriptor_limit
from lora_server.server.openai_serving import model_tool_parser
from lora_server.server.registry_sync import RegistrySync

log = logging.getLogger("lora_server")
DEAD_EXIT_S = 5.0
RANDOM_KEY = "random, for this run"  # resolve_admin_key's source of a key it made up


def model_id(config: EngineConfig) -> str:
    """The base model's id: the model file or directory name without a GGUF quantization suffix."""
    path = Path(config.model) if config.model else default_model_path()
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16)$", "", path.stem if path.suffix == ".gguf" else path.name)


def serve(config: ServerConfig) -> int:
    """Run the server until it is stopped (0) or its engine dies of a fault it cannot recover from (1, within
    a few seconds, so that a supervisor restarts the process)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    admin_key, key_source = resolve_admin_key(config)
    built = build(config, admin_key, key_source)
    if key_source == RANDOM_KEY:  # once the server is built: a start that fails says only why
        print(f"admin key (random, for this run): {admin_key}", file=sys.stderr, flush=True)
    engine = built.engine
    server = _draining_server(uvicorn, built.app, engine, config)
    built.start()
    threading.Thread(target=_exit_when_dead, args=(engine, server), name="engine-watchdog", daemon=True).start()
    try:
        server.run()
    finally:
        built.close()
    return 1 if engine.dead.is_set() else 0


def resolve_admin_key(config: ServerConfig) -> tuple[str, str]:
    """The admin key and where it came from: --admin-key, $LORA_SERVER_ADMIN_KEY, else a random one (RANDOM_KEY:
    the caller prints it)."""
    if config.admin_key is not None:
        return config.admin_key, "--admin-key"
    if (key := envs.admin_key()) is not None:
        return key, "$LORA_SERVER_ADMIN_KEY"
    return secrets.token_urlsafe(24), RANDOM_KEY


@dataclass(frozen=True, slots=True)
class Built:
    """One server's parts, as ``build`` leaves them: the engine not started, the registry in step with the store but
    not yet following it."""

    engine: Engine
    store: RegistryStore
    registry: RegistrySync
    app: FastAPI

    def start(self) -> None:
        """Start the engine thread and follow the registry's changes."""
        self.engine.start()
        self.registry.start()

    def close(self) -> None:
        self.registry.stop()
        self.engine.shutdown()
        self.store.close()


def build(config: ServerConfig, admin_key: str, key_source: str) -> Built:
    """The engine, the registry store, its sync and the app of one server; preloads the configured adapters,
    catches up with the registered ones and logs the summary. ``lora-server serve`` runs one; each Ray Serve
    replica builds one."""
    engine = Engine(config.engine)
    data_dir, data_dir_source = (config.data_dir, "--data-dir") if config.data_dir else envs.data_dir()
    store = open_store(data_dir, config.redis_url)
    status = store.status()
    if status.persistent is False:
        log.warning(
            "the registry's Redis keeps nothing on disk (no AOF, no RDB): every tenant and adapter is lost "
            "when it restarts; enable appendonly or save"
        )
    demos = demo_adapters()
    preloaded = []
    # the demo adapters are the embedded model's: another --model, or --adapter-dir, starts with none unless --adapter
    # names some
    default = list(demos) if config.engine.model is None and not config.adapter_dirs else []
    for spec in config.adapters if config.adapters is not None else default:
        name, _, path = spec.partition("=")
        if not path and name not in demos:
            raise AdapterError(
                f"--adapter {name}: no shipped demo adapter of that name ({', '.join(demos)}); use NAME=PATH"
            )
        engine.adapters.add(name, path or demos[name], source="command line" if path else "demo")
        preloaded.append(name)
    preloaded += add_adapter_dirs(engine, config.adapter_dirs or ())
    # the adapters given at start wait in host memory: their first requests read no disk
    engine.adapters.stage(preloaded)
    base_id = config.served_model_name or model_id(config.engine)
    app = build_app(engine, store, config, base_id, admin_key)
    registry = RegistrySync(store, engine, app.state.control.lock, app.state.tenants.changed)
    registry.catch_up()  # the adapters registered through the admin API earlier, or by another replica
    place = getattr(store, "address", None) or f"{data_dir} ({data_dir_source})"  # Redis: host:port (no password)
    log.info("%s", summary(config, engine, base_id, status, place, key_source))
    return Built(engine, store, registry, app)


def add_adapter_dirs(engine: Engine, dirs: Sequence[str]) -> list[str]:
    """Register every subdirectory of ``dirs`` as an adapter named after it (Engine.adapters.add_many: read on several
    threads), in name order; one that cannot be served, or whose name the admin API would refuse, is logged and
    skipped. Returns the names registered. AdapterError for a folder that is not one."""
    specs: list[AdapterSpec] = []
    for folder in map(Path, dirs):
        if not folder.is_dir():
            raise AdapterError(f"--adapter-dir {folder} is not a directory")
        for path in sorted(p for p in folder.iterdir() if p.is_dir()):
            try:
                validate_name(path.name, "adapter name")
            except ValueError as exc:
                log.warning("adapter directory %s skipped: %s", path, exc)
                continue
            specs.append(AdapterSpec(path.name, path))
    started = time.monotonic()
    results = engine.adapters.add_many(specs, source="adapter dir")
    refused = [(spec, r) for spec, r in zip(specs, results, strict=True) if isinstance(r, AdapterError)]
    for spec, error in refused:
        log.warning("adapter %s from %s not served: %s", spec.name, spec.path, error)
    if specs:
        log.info(
            "%d adapters registered from %s in %.1f s%s",
            len(specs) - len(refused),
            ", ".join(dirs),
            time.monotonic() - started,
            f" ({len(refused)} refused, see above)" if refused else "",
        )
    return [spec.name for spec, r in zip(specs, results, strict=True) if not isinstance(r, AdapterError)]


def _names(names: list[str], shown: int = 8) -> str:
    """Names for a log line: all of a few, else how many and the first ones."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{len(names)} ({', '.join(names[:shown])}, ...)"


def summary(config: ServerConfig, engine: Engine, base_id: str, store: StoreStatus, place: str, key_source: str) -> str:
    """What the server serves, in a few lines for its log at start; ``place``: where the registry store is."""
    info, pool = engine.describe(), engine.snapshot().pool
    a = info.arch
    blocks, block_size, memory = pool.gpu_blocks, pool.block_size, pool.device_memory
    adapters = [(n, engine.adapters.info(n)) for n in engine.adapters.names()]
    by_source: dict[str, list[str]] = {}
    for name, adapter in adapters:
        if adapter is not None:
            by_source.setdefault(adapter.source, []).append(name)
    gib, dtype = 2**30, str(info.dtype).removeprefix("torch.")
    followed = "replicas heard at once (pub/sub)" if store.backend == "redis" else f"processes read every {POLL_S:g} s"
    return "\n".join(
        [
            f"serving {base_id}: {info.format} weights from {info.path or 'dummy weights'}",
            f"  model: {a.num_layers} layers, hidden {a.hidden_size}, {a.num_heads}/{a.num_kv_heads} heads, context "
            f"{info.max_model_len}; quantization {config.engine.quantization}, dtype {dtype}, device {info.device}; "
            f"resident weights {info.weight_bytes / 2**20:.0f} MiB",
            f"  device memory: weights {memory.weights_bytes / gib:.2f} GiB + arena "
            f"{memory.arena_bytes / gib:.2f} GiB + workspace {memory.workspace_bytes / 2**20:.1f} MiB; the "
            f"arena: {blocks} pages of {pool.block_bytes / 2**20:.2f} MiB, each {block_size} tokens of KV or part "
            f"of an adapter (as many resident as policy {pool.policy} keeps; at most {config.engine.max_loras} in "
            "one batch); host tier "
            f"{pool.host_blocks} pages ({memory.host_tier_bytes / gib:.2f} GiB); adapters staged in host memory: "
            f"{memory.staged_adapters} in {memory.staged_adapter_bytes / gib:.2f} of "
            f"{memory.staged_adapter_budget_bytes / gib:.2f} GiB"
            + ("" if config.engine.max_cpu_loras is None else f", at most {config.engine.max_cpu_loras}"),
            "  start-up: "
            + ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in info.startup_s.items())
            + (
                f" (warm-up compiled every kernel variant the steps can reach; the largest step's activations "
                f"{info.activation_bytes / gib:.2f} GiB, decode graphs {info.graph_bytes / gib:.2f} GiB)"
                if "warm-up" in info.startup_s
                else ""
            ),
            "  adapters: " + ("; ".join(f"{src}: {_names(names)}" for src, names in by_source.items()) or "none"),
            f"  adapter roots: {', '.join(config.engine.adapter_roots or ()) or 'any path'}",
            f"  tool calls: {tool_calls_summary(engine, config.tool_call_parser)}",
            f"  registry: {store.backend} at {place}; changes by other {followed}",
            f"  admin key: {key_source}; /v1 access: "
            + (
                "--api-key or a tenant's key"
                if config.api_key
                else "anyone"
                if config.allow_anonymous
                else "anyone while no tenant exists, then a tenant's key"
            ),
            f"  listening on http://{config.host}:{config.port} (OpenAI API at /v1, admin at /admin, status page at "
            "/admin/ui)",
        ]
    )


def tool_calls_summary(engine: Engine, parser_name: str | None) -> str:
    """How tool calls are made and read on this model, for the start-up summary."""
    tokenizer = engine.tokenizer
    parser = model_tool_parser(tokenizer, parser_name)
    if parser is None:
        return 'the model\'s format is unknown: tool_choice "auto" is refused (--tool-call-parser NAME names it)'
    source = "--tool-call-parser" if parser_name else "the chat template"
    try:
        shown = tokenizer is not None and tokenizer.template_renders_tools
    except ValueError:  # no template, or one that does not parse
        shown = False
    where = "" if shown else "; the chat template shows no tools: they are written into the system prompt"
    return f"the {parser.name} format (from {source}){where}"


def _exit_when_dead(engine: Engine, server) -> None:
    """When the engine dies, stop serving (/health already answers 503) and exit non-zero: at once through
    uvicorn, or by force after DEAD_EXIT_S if it does not stop."""
    engine.dead.wait()
    log.critical("the engine has stopped (%r): exiting so that a supervisor restarts the server", engine.dead_error)
    time.sleep(0.5)  # in-flight requests receive their 503s
    server.should_exit = server.force_exit = True
    time.sleep(DEAD_EXIT_S)
    os._exit(1)


def _draining_server(uvicorn, app, engine: Engine, config: ServerConfig):
    """A uvicorn server whose first SIGINT/SIGTERM starts a drain: new requests get 503 with Retry-After (the app's
    ``draining`` flag) while the engine finishes what it has, for at most ``timeout`` seconds; then uvicorn shuts
    down as usual. A second signal stops at once. Its connections are GuardedH11Protocol's (http_edge.py)."""
    timeout = config.shutdown_timeout

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if app.state.draining:  # the second signal: stop now, without waiting for connections
                log.info("second signal: stopping at once")
                self.should_exit = self.force_exit = True
                return
            app.state.draining = True
            log.info(
                "draining: new requests get 503; waiting up to %.0f s for %d in flight",
                timeout,
                engine.num_unfinished(),
            )
            threading.Thread(target=self._drain, args=(sig, frame), name="drain", daemon=True).start()

        def _drain(self, sig: int, frame) -> None:
            deadline = time.monotonic() + timeout
            while engine.num_unfinished() and time.monotonic() < deadline:
                time.sleep(0.05)
            super().handle_exit(sig, frame)

    cap = connection_cap(config.max_connections, raise_descriptor_limit())
    protocol = guarded_protocol(config.request_head_timeout, config.request_body_timeout, cap)
    log.info(
        "at most %d open connections; a request head must arrive in %g s, its body in %g s",
        cap,
        config.request_head_timeout,
        config.request_body_timeout,
    )
    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="info",
            timeout_graceful_shutdown=timeout,
            timeout_keep_alive=config.keep_alive_timeout,
            http=protocol,
        )
    )
