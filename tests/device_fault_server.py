"""``lora-server serve`` with a device fault injected: a request with max_tokens 77 makes the model's forward pass
raise the error CUDA raises after an illegal memory access. Run by test_server_faults.py as its own process:
``python -m tests.device_fault_server serve ARGS...``."""

from __future__ import annotations

import sys

from lora_server import cli
from lora_server.model.runner import ModelRunner

FAULT_MAX_TOKENS = 77
_prepare = ModelRunner.prepare


def _prepare_or_fault(self, items):
    if any(request.params.max_tokens == FAULT_MAX_TOKENS for request, _ in items):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return _prepare(self, items)


ModelRunner.prepare = _prepare_or_fault  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
