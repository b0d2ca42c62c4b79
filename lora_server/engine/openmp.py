"""Releasing a thread's OpenMP workers, for the CPU.

torch's CPU ops run their parallel regions on OpenMP (libgomp), which keeps a team of worker threads for each
thread that ran one, for as long as that thread lives. When two threads hold teams, the workers outnumber small
CPUs and libgomp stops spinning between regions: every parallel op of either thread then pays a sleep and a wake
(docs/benchmarks.md, "OpenMP teams on a small CPU"). The engine's step runs on one thread; a thread
that ran torch ops before it and stays alive (the one that built the engine, then serves HTTP) gives its workers
back with ``release_openmp_workers``."""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1  # OpenMP 5.0: free the threads, keep what is cheap to keep


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's own copy), found in /proc/self/maps; None where there is none
    (another OpenMP runtime, or not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libgomp" in line), None)
    except OSError:
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    return lib if hasattr(lib, "omp_pause_resource_all") else None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (a later parallel op of this thread starts new ones).
    Returns whether it could: False without libgomp's omp_pause_resource_all. Never call it inside a parallel
    region; torch ops running on other threads keep their own workers."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def run_ops_alone() -> bool:
    """Make the calling thread's torch ops run on it alone, with no OpenMP team of its own (for a thread beside the
    engine's that copies memory, such as the adapter loader's workers: its team would compete with the engine's).
    torch sets a thread's OpenMP thread count when that thread first asks for it (at::lazy_init_num_threads), so it
    asks first and sets it to 1 after. Returns whether it could (False without libgomp)."""
    import torch

    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_set_num_threads"):
        return False
    torch.get_num_threads()  # torch's per-thread initialization, which would undo what follows if it came later
    lib.omp_set_num_threads(1)
    return True
