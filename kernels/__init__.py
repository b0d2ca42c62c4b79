"""Compute kernels: Triton kernels (one per file: ``_x_kernel``, the wrapper ``x``), each with a pure-torch twin
in ``kernels.reference`` (attention, KV writes) or ``kernels.lora_reference`` (LoRA shrink/expand);
``kernels.lora_ops`` dispatches between kernel and twin.

Imports nothing from the rest of the project."""
