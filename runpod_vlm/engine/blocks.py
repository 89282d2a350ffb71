"""The paged KV cache's bookkeeping: fixed-size blocks handed to sequences as their tokens grow."""

from __future__ import annotations

import collections
from collections.abc import Hashable

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default): a row wastes at most 15 slots


class BlockPool:
    """`blocks` blocks of `block_size` tokens. Block 0 is never handed out: idle decode rows write there.

    A holder (a decoder row) holds the blocks of its own tokens, in order: its block table. Freed blocks
    go to the back of the free list, so the most recently freed is reused last."""

    def __init__(self, blocks: int, block_size: int):
        if blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks, not {blocks}")
        self.block_size = block_size
        self.capacity = blocks - 1  # blocks that can be handed out
        self._free = collections.deque(range(1, blocks))
        self._held: dict[Hashable, list[int]] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.capacity * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def table(self, holder: Hashable) -> list[int]:
        return self._held.get(holder, [])

    def shortfall(self, holder: Hashable, tokens: int) -> int:
        """How many more free blocks `holder` would need to hold `tokens` tokens (0: it can now)."""
        return max(0, self.blocks_for(tokens) - len(self.table(holder)) - self.free)

    def grow(self, holder: Hashable, tokens: int) -> list[int]:
        """Give `holder` the blocks to hold `tokens` tokens; the new ones, in order. All or nothing:
        raises `PoolExhausted` (taking nothing) when too few are free."""
        held = self._held.setdefault(holder, [])
        missing = self.blocks_for(tokens) - len(held)
        if missing > self.free:
            if not held:
                del self._held[holder]
            raise PoolExhausted(missing - self.free)
        new = [self._free.popleft() for _ in range(max(0, missing))]
        held.extend(new)
        return new

    def release(self, holder: Hashable) -> int:
        """Free every block of `holder`; how many."""
        blocks = self._held.pop(holder, [])
        self._free.extend(blocks)
        return len(blocks)


class PoolExhausted(Exception):
    def __init__(self, missing: int):
        super().__init__(f"{missing} more KV blocks needed than are free")
        self.missing = missing
