"""What the kernel tests share. conftest.py imports it before any test module: without a CUDA GPU it sets
TRITON_INTERPRET=1 before triton is imported (torch does not import it), so the kernels run in the Triton
interpreter on the CPU; with one, the same tests run compiled on it.

Tolerances per dtype of a kernel against its torch twin (the twin rounds like the kernel), and of a result against
an exact float64 computation (one rounding of the output). ``force_path`` sends kernels.ops down one branch."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

TOL_VS_TWIN = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},  # 2 ulps: the interpreter rounds fp32 -> bf16 toward zero
}
TOL_VS_EXACT = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 8e-3, "rtol": 8e-3},
}


def force_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make kernels.ops take the Triton kernels (path "kernels"; on the CPU they run in the interpreter) or the
    torch twins ("twins") on every device, for the rest of the test."""
    from lora_server.kernels import ops

    assert path in ("kernels", "twins"), path
    monkeypatch.setattr(ops, "use_kernels", lambda device: path == "kernels")
