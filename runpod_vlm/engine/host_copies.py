"""Copies between the host and the GPU that never wait for it.

CUDA copies a host tensor of more than STAGED_BYTES in pageable memory to the GPU only as the GPU reaches the copy:
the thread asking waits for everything the GPU was given before, the prefill or decode steps launched ahead. From
page-locked memory the copy is only queued. At each group's first pixels the engine thread waited 12-82 ms for the
prefill before."""

from __future__ import annotations

from typing import Any, NamedTuple

STAGED_BYTES = 64 * 1024  # what CUDA stages at once (its pageable copies up to this size never wait)


def page_locked(value):
    """`value` where a copy of it to the GPU waits for nothing: a large host tensor in page-locked memory (a
    repeated row, stride 0, as one row: `to_without_copying_repeats` moves it once), anything else as it is."""
    import torch

    if not isinstance(value, torch.Tensor) or str(value.device) != "cpu":
        return value
    if value.numel() * value.element_size() <= STAGED_BYTES or value.is_pinned():
        return value
    repeated = value.stride(0) == 0 and value.shape[0] > 1
    row = value[:1] if repeated else value
    if row.numel() * row.element_size() <= STAGED_BYTES:
        return value
    # Contiguous: a strided source is first made contiguous by the copy itself, in pageable memory again.
    return row.contiguous().pin_memory().expand(value.shape) if repeated else value.contiguous().pin_memory()


def to_device(value, device):
    """`value` on `device`; to a GPU the copy queued without waiting for it."""
    if str(device).startswith("cuda"):
        value = page_locked(value)
    return value.to(device, non_blocking=True)


def copy_into(buffer, value) -> None:
    """`value` copied into `buffer`; to a GPU queued without waiting for it."""
    buffer.copy_(page_locked(value) if buffer.is_cuda else value, non_blocking=True)


class Launched(NamedTuple):
    """Decode steps or a prefill launched on the GPU, their tokens on their way to the host."""

    steps: int
    tokens: Any  # [bucket, steps] on the host, complete once `done` has passed ([rows, 1] for a prefill's)
    logprobs: tuple  # the log-probability rings likewise, when a row asked
    done: Any  # a CUDA event recorded after the copies; None on the CPU
    rows: tuple = ()  # a prefill's rows, in the order of its first tokens; () for decode steps (row n at n)


def to_host(steps: int, tokens, logprobs, rows: tuple = ()) -> Launched:
    """`tokens` and `logprobs` copied to the host: on the GPU into page-locked memory, not waiting."""
    import torch

    done = torch.cuda.Event() if tokens.is_cuda else None
    tokens, *logprobs = (part.to("cpu", non_blocking=True, copy=True) for part in (tokens, *logprobs))
    if done is not None:
        done.record()
    return Launched(steps, tokens, tuple(logprobs), done, rows)
