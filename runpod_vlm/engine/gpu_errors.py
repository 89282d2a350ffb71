"""What a failed CUDA call means: out of memory (recovered from), or a context that is lost for good."""

from __future__ import annotations


def is_out_of_memory(error: Exception) -> bool:
    return type(error).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(error)


def is_fatal_gpu_error(error: Exception) -> bool:
    """CUDA errors after which the context is unusable (unlike out-of-memory, which is recovered)."""
    text = str(error)
    return not is_out_of_memory(error) and (
        type(error).__name__ == "AcceleratorError"
        or any(s in text for s in ("illegal memory access", "device-side assert", "ECC error", "unspecified launch"))
    )
