"""OpenMP workers are given back: a thread that ran a parallel torch op holds worker threads of its own until it
releases them (lora_server.engine.openmp), and the adapter loader's thread ends once it has nothing to stage, so
no second team of workers slows the engine's thread (the reason is in the module's docstring). Counted with the
process's threads in /proc, an independent view of what libgomp holds."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lora_server.engine.openmp import release_openmp_workers
from tests.adapters.test_adapter_arena import _engine

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2, reason="needs Linux and 2 torch threads"
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    (torch.ones(1 << 20) * 2).sum()  # large enough for torch to run it on every thread


def test_release_gives_the_workers_back():
    result: dict[str, object] = {}

    def work() -> None:  # in a fresh thread: it has no team yet, whatever ran before in the process
        before = _threads()
        _parallel_op()
        result["grown"] = _threads() - before
        result["released"] = release_openmp_workers()
        result["after"] = _threads() - before

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert result == {"grown": torch.get_num_threads() - 1, "released": True, "after": 0}


@pytest.mark.slow
def test_the_loader_thread_ends_when_idle(tmp_path):
    from tests.servers import write_adapter

    engine = _engine(24)
    engine.adapters.add("a", write_adapter(tmp_path / "a", seed=5, r=8))
    engine.adapters.stage(["a"], timeout_s=30)
    deadline = threading.Event()
    for _ in range(50):  # it ends right after publishing its last staging
        if not any(t.name == "adapter-loader" for t in threading.enumerate()):
            break
        deadline.wait(0.1)
    assert not any(t.name == "adapter-loader" for t in threading.enumerate())
    assert engine.pool_report().device_memory.adapter_stagings == 1
    engine.adapters.add("b", write_adapter(tmp_path / "b", seed=6, r=8))
    engine.adapters.stage(["b"], timeout_s=30)  # a new thread stages the next one
    assert engine.pool_report().device_memory.adapter_stagings == 2
    engine.shutdown()
