"""Tensor parallelism on torch.distributed (gloo on the CPU): rank 0 is the engine's model runner, ranks 1..N-1 are
worker processes it starts; each rank holds its shard of the weights, of the KV heads and of the arena."""
