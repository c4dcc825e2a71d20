"""Free list of KV-cache block ids (bookkeeping only; the KV tensors live in the runner's pool)."""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1. Each block holds `block_size` token positions.

    `allocate` raises ValueError when fewer than `n` blocks are free (callers check
    `can_allocate` first, so a shortage there is a caller bug). Freeing a block that is already
    free fails an assertion.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))   # oldest freed first
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """The fraction of blocks in use, 0 to 1 (vLLM's `vllm:kv_cache_usage_perc`)."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert 0 <= block_id < self.num_blocks, f"KV block {block_id} out of range"
            assert not self._is_free[block_id], f"double free of KV block {block_id}"
            self._is_free[block_id] = True
            self._free.append(block_id)
