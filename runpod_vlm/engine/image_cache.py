"""Vision-encoder outputs kept by image, so that an image sent again (every turn of a chat resends its
images; one product photo in many requests) skips the vision encoder.

An image's key is the hash of its decoded pixels and the request's bound on its size (media.image_key);
the processor's own settings are fixed for the worker's life, and so is this cache. Hand-written: a byte-
bounded LRU of tensors is a few lines, and functools.lru_cache bounds entries, not bytes."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Optional

log = logging.getLogger("runpod-vlm")

LOG_EVERY_S = 60.0


class ImageEmbeddingCache:
    """Least recently used first out, within `max_bytes`; counts hits and misses."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
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

    def put(self, key, value) -> None:
        size = _bytes_of(value)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self.held -= _bytes_of(self._entries.pop(key))
            while self._entries and self.held + size > self.max_bytes:
                self.held -= _bytes_of(self._entries.popitem(last=False)[1])
            self._entries[key] = value
            self.held += size

    def __len__(self) -> int:
        return len(self._entries)

    def _log_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.info(
                "image cache: %d hits, %d misses, %d images in %.0f MB",
                self.hits,
                self.misses,
                len(self),
                self.held / 2**20,
            )


def _bytes_of(tensor) -> int:
    return tensor.nelement() * tensor.element_size()
