"""Model execution: the architecture, loading, quantization, LoRA application, the runner and the sampler."""
