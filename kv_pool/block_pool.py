"""Fixed-size KV blocks with a free list and reference counts."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """allocate() was asked for more blocks than are free; nothing was allocated."""


class BlockPool:
    """Owns the ids 0 .. num_blocks-1 of the KV cache's blocks.

    Contract: allocate() hands out blocks with reference count 1; share() adds a holder; free() drops one holder
    per block and returns a block to the free list when its count reaches 0. A block id is only valid for the
    holder between allocate/share and its own free(). The pool never touches the KV tensors themselves."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_integrity(self, held: list[list[int]] | None = None) -> None:
        """Assert free + in use = total, no block both free and held, and (when the holders' block tables are
        given) every block's reference count equals the number of tables holding it."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        in_use = {b for b, c in enumerate(self._ref_counts) if c > 0}
        assert not free & in_use, f"blocks both free and in use: {sorted(free & in_use)[:8]}"
        assert len(free) + len(in_use) == self.num_blocks, "free + in use != total"
        if held is not None:
            counts = [0] * self.num_blocks
            for table in held:
                for b in table:
                    counts[b] += 1
            assert counts == self._ref_counts, "reference counts differ from the holders' block tables"
