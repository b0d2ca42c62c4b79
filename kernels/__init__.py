"""Compute kernels: Triton kernels (one per file: ``_x_kernel``, the wrapper ``x``), each with a pure-torch twin in
``kernels.reference`` (attention, KV writes), ``kernels.lora_reference`` (LoRA shrink/expand) or
``kernels.quant_reference`` (quantized matmuls and dequantizers; ``kernels.quant_tiles`` holds their GPU launch table)
or ``kernels.gguf_reference`` (GGUF blocks: the decoder and the matmul). ``kernels.ops`` holds the one switch between
kernel and twin (``use_kernels(device)``) and the ops the model calls through it; ``kernels.checks`` the argument checks
that the wrappers share.

Imports nothing from the rest of the project."""
