"""Vision-encoder outputs kept by image, so that an image sent again (every turn of a chat resends its
images; one product photo in many requests) skips the vision encoder.

An image's key is the digest of its decoded pixels and the request's bound on its size (media.image_key);
the processor's own settings are fixed for the worker's life, and so is this cache."""

from __future__ import annotations

from runpod_vlm.lru import BytesLRU


class ImageEmbeddingCache(BytesLRU):
    """Embedding tensors by image key, within `max_bytes` of GPU memory."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, _bytes_of, "image embedding cache")


def _bytes_of(tensor) -> int:
    return tensor.nelement() * tensor.element_size()
