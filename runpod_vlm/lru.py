"""A least-recently-used map bounded in bytes that counts its hits and misses, logged now and then: the vision
encoder's outputs (engine/image_cache.py) and the decoded images (media.py) are kept in one. Hand-written:
functools.lru_cache bounds entries, not bytes, and a few lines do it."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

log = logging.getLogger("runpod-vlm")

LOG_EVERY_S = 60.0


class BytesLRU:
    """Least recently used first out, within `max_bytes` as `size_of` counts an entry; thread-safe."""

    def __init__(self, max_bytes: int, size_of: Callable[[Any], int], label: str):
        self.max_bytes, self.size_of, self.label = max_bytes, size_of, label
        self.held = 0
        self.hits = self.misses = 0
        self._entries: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._logged = time.monotonic()

    def get(self, key) -> Optional[Any]:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                self._entries.move_to_end(key)
        self._log_now_and_then()
        return value

    def peek(self, key) -> Optional[Any]:
        """The value, if held, counted neither a hit nor a miss: for a look ahead of the use that counts."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key, value) -> None:
        size = self.size_of(value)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self.held -= self.size_of(self._entries.pop(key))
            while self._entries and self.held + size > self.max_bytes:
                self.held -= self.size_of(self._entries.popitem(last=False)[1])
            self._entries[key] = value
            self.held += size

    def __len__(self) -> int:
        return len(self._entries)

    def _log_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.info(
                "%s: %d hits, %d misses, %d held in %.0f MB",
                self.label,
                self.hits,
                self.misses,
                len(self),
                self.held / 2**20,
            )
