"""Vision-encoder outputs kept by image, so that an image sent again (every turn of a chat resends its
images; one product photo in many requests) skips the vision encoder.

An image's key is the digest of its decoded pixels and the request's bound on its size (media.image_key);
the processor's own settings are fixed for the worker's life, and so is this cache."""

from __future__ import annotations

from runpod_vlm.lru import BytesLRU


class ImageEmbeddingCache(BytesLRU):
    """(embeddings, the processor's grid for the image) by image key, within `max_bytes` of GPU memory."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, _bytes_of, "image embedding cache")

    def holding(self, held: dict) -> HeldFirst:
        return HeldFirst(self, held)


class HeldFirst:
    """The cache as a forward reads it, with the entries its items took when they were prepared (`peek`): those
    answer even if the cache let them go meanwhile (then counted a miss, though nothing is encoded)."""

    def __init__(self, cache: ImageEmbeddingCache, held: dict):
        self.cache, self.held = cache, held

    def get(self, key):
        found = self.cache.get(key)
        return found if found is not None else self.held.get(key)

    def put(self, key, value) -> None:
        self.cache.put(key, value)


def _bytes_of(entry) -> int:
    embeds = entry[0]
    return embeds.nelement() * embeds.element_size()
