"""The paged KV cache's bookkeeping: fixed-size blocks handed to sequences as their tokens grow."""

from __future__ import annotations

import array
import collections
import hashlib
from collections.abc import Hashable
from typing import NamedTuple, Optional

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default): a row wastes at most 15 slots


class BlockPool:
    """`blocks` blocks of `block_size` tokens. Block 0 is never handed out: idle decode rows write there.

    A holder (a decoder row) holds the blocks of its own tokens, in order: its block table. A full block of
    a prompt may be remembered by its prefix digest (`prefix_digests`); a later holder whose prompt starts
    with the same tokens shares it (`share`), counted once per holder. A block no holder holds but that is
    remembered stays cached: it counts as free and is handed out again, least recently used first, only
    when no block is empty. Empty freed blocks go to the back of the free list."""

    def __init__(self, blocks: int, block_size: int):
        if blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks, not {blocks}")
        self.block_size = block_size
        self.capacity = blocks - 1  # blocks that can be handed out
        self._free = collections.deque(range(1, blocks))  # empty
        self._held: dict[Hashable, list[int]] = {}
        self._holders: collections.Counter[int] = collections.Counter()  # block -> holders sharing it
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by none, remembered

    @property
    def free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        """Blocks remembered by digest that no holder holds."""
        return len(self._cached)

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
        new = [self._take() for _ in range(max(0, missing))]
        self._holders.update(new)
        held.extend(new)
        return new

    def release(self, holder: Hashable) -> int:
        """Let go of every block of `holder`; how many it held."""
        blocks = self._held.pop(holder, [])
        for block in blocks:
            self._holders[block] -= 1
            if self._holders[block] == 0:
                del self._holders[block]
                if block in self._digest_of:
                    self._cached[block] = None  # the most recently used end
                else:
                    self._free.append(block)
        return len(blocks)

    def cached_prefix(self, digests: list[bytes]) -> list[int]:
        """The remembered blocks of the longest leading run of `digests`."""
        blocks = []
        for digest in digests:
            block = self._by_digest.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, holder: Hashable, blocks: list[int]) -> None:
        """`holder`, which holds nothing, starts with `blocks` (a cached prefix), shared with their other holders."""
        assert not self.table(holder), "a holder shares a prefix before it holds any block"
        for block in blocks:
            self._cached.pop(block, None)
        self._holders.update(blocks)
        self._held[holder] = list(blocks)

    def remember(self, holder: Hashable, digests: list[bytes]) -> None:
        """`holder`'s leading blocks hold the prefixes of `digests` (one per full block of its prompt)."""
        for block, digest in zip(self.table(holder), digests):
            if digest not in self._by_digest and block not in self._digest_of:
                self._by_digest[digest], self._digest_of[block] = block, digest

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._cached.popitem(last=False)  # the least recently used cached block is forgotten
        del self._by_digest[self._digest_of.pop(block)]
        return block


def prefix_digests(ids: list[int], block_size: int, images: list[tuple[int, bytes]] = ()) -> list[bytes]:
    """One digest per full block of `ids`: a hash chain over every token up to the block's end, so two prompts
    share a block's digest only when they share all tokens before it. `images`: each image's first token and
    key; the block holding that token takes the key too (an image's tokens are the same ids whatever the
    image), and the chain carries it on. A cryptographic hash, not hash(): a prompt crafted to collide with
    another's would read its cache."""
    chain, digests = b"", []
    for start in range(0, len(ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(chain, digest_size=16)
        digest.update(array.array("q", ids[start : start + block_size]).tobytes())
        for first, key in images:
            if start <= first < start + block_size:
                digest.update(key)
        chain = digest.digest()
        digests.append(chain)
    return digests


class SharedPrefix(NamedTuple):
    """Where a prompt's first `count` full blocks come from instead of being computed: `cached` blocks of the pool,
    or (`earlier`) the first `count` blocks of an earlier prompt of the same prefill, computed there."""

    count: int = 0
    cached: list[int] = []
    earlier: Optional[int] = None


class PoolExhausted(Exception):
    def __init__(self, missing: int):
        super().__init__(f"{missing} more KV blocks needed than are free")
        self.missing = missing
