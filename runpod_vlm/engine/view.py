"""What the engine holds at a moment, read-only: for metrics, the boot log, tests and benchmarks, which read the
engine through this and never through its private names."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class EngineView:
    """A snapshot of the engine (taken off its thread: each count is exact, together they may be a step apart)."""

    queued: int  # items submitted, not yet given a row
    running: int  # rows decoding
    prefilling: int  # prompts entering in chunks (0 or 1)
    kv_blocks: int  # blocks the KV pool can hand out (0 before the pool is made)
    kv_blocks_free: int  # ... free now, the cached ones included
    kv_blocks_cached: int  # ... held by no row, kept for their prompt prefix
    block_size: int
    row_cap: Optional[int]  # rows given at most for a while after a decode step ran out of memory
    decode_graphs: int  # decode steps recorded as CUDA graphs
    compiled_row_buckets: tuple[int, ...]  # row buckets whose decode step runs compiled
    image_cache_hits: int  # images whose vision-encoder output was found cached
    image_cache_misses: int
    timings: dict  # seconds and counts by phase; prompt_tokens and prefix_cached_tokens (read from cached blocks)
    thread_alive: bool = False  # the engine thread runs (started at the first submit or warm-up; ended by close)

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks - self.kv_blocks_free
