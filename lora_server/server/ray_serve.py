"""``lora-server serve --ray-replicas N``: N engine replicas under Ray Serve behind one address (the ingress of
``ray_ingress``; each replica is ``ray_replica``'s whole server). Ray is an optional extra: ``pip install
lora-server[ray]``; nothing else imports this module."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import replace
from typing import Any

import ray
import torch
from ray import serve

from lora_server.config import MIB, ServerConfig
from lora_server.server.ray_ingress import Ingress
from lora_server.server.ray_replica import replica_class
from lora_server.server.serve import RANDOM_KEY, resolve_admin_key

log = logging.getLogger("lora_server")
APP_NAME = "lora-server"
OBJECT_STORE_BYTES = 256 * MIB  # requests and answers pass through it; the weights never do


def application(config: ServerConfig, admin_key: str) -> Any:
    """The Serve application: the ingress (1 replica, no CPU of its own) over ``config.ray_replicas`` engine
    replicas (1 CPU each, and 1 GPU each where the engine runs on CUDA). Every replica gets ``config`` as it is:
    they must share one registry store (the same --data-dir on one machine, or --redis-url).

    With --tensor-parallel-size N each replica is a tensor-parallel group: Serve reserves a placement group of N
    bundles on one node (STRICT_PACK) for it, the replica (rank 0) in the first, and the N - 1 worker ranks it
    starts as processes of its own take the others' share of that node, so Ray places no other work on it."""
    on_cuda = config.engine.device == "cuda" or (config.engine.device == "auto" and torch.cuda.is_available())
    bundle = {"CPU": 1, "GPU": 1} if on_cuda else {"CPU": 1}
    group: dict[str, Any] = {}
    if config.engine.tensor_parallel_size > 1:
        group = dict(
            placement_group_bundles=[bundle] * config.engine.tensor_parallel_size,
            placement_group_strategy="STRICT_PACK",
        )
    engines = serve.deployment(
        name="engine",
        num_replicas=config.ray_replicas,
        max_ongoing_requests=config.engine.max_num_seqs,
        ray_actor_options={"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)},
        health_check_period_s=2,
        graceful_shutdown_timeout_s=config.shutdown_timeout,
        **group,
    )(replica_class(config.engine.max_loras))
    ingress = serve.deployment(
        name="ingress", num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}
    )(Ingress)
    return ingress.bind(engines.bind(config, admin_key), config.ray_routing, admin_key, config.ray_replicas)


def serve_ray(config: ServerConfig) -> int:
    """Start (or join, with --ray-address) a Ray cluster, run the application on --host/--port until SIGINT or
    SIGTERM, then shut Serve down."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    admin_key, key_source = resolve_admin_key(config)
    if key_source == RANDOM_KEY:
        print(f"admin key (random, for this run): {admin_key}", file=sys.stderr, flush=True)
    if config.ray_address:
        ray.init(address=config.ray_address)
    else:
        ray.init(include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(application(replace(config, admin_key=admin_key), admin_key), name=APP_NAME, route_prefix="/")
    log.info(
        "serving %d replicas under Ray Serve on http://%s:%d (routing: %s; admin key: %s)",
        config.ray_replicas,
        config.host,
        config.port,
        config.ray_routing,
        key_source,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
