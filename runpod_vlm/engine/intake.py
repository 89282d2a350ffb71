"""Items turned into the model's inputs on threads while the GPU decodes."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from runpod_vlm.engine.host_copies import page_locked
from runpod_vlm.families.base import to_without_copying_repeats
from runpod_vlm.vocabulary import GenerationRequest

# Pixels prepared on the GPU and not yet admitted, at most: a burst's worth of 448x448 images (2.4 MB each in bf16),
# out of the share of the GPU that `VLM_GPU_MEMORY_UTILIZATION` leaves free (a tenth by default).
PREPARED_ON_GPU_BYTES = 256 << 20
THREADS = 2  # at most, one CPU left to the engine thread (why two: Intake's docstring)


class Intake:
    """Threads that run each item's processor call alone (its `batch_inputs` of one item) and hand back
    its inputs, first image's input size and the image-cache entries it took as a Future. Threads, not
    processes: the processors' image work runs in PIL, numpy and torch, which release the GIL, and their
    tensors need no copying between processes; four or eight worker processes served bursts no faster. Two: with
    eight, the engine thread waited for the GIL at every kernel launch of a prefill (500 ms a prefill of six 720p
    images on the H200)."""

    def __init__(
        self,
        adapter,
        processor,
        dtype,
        timings: collections.Counter,
        image_cache=None,
        pin=False,
        image_device: str | None = None,
        image_bytes: int = PREPARED_ON_GPU_BYTES,
    ):
        """`pin`: inputs left on the host are for a GPU (`page_locked`). `image_device`: a GPU where torchvision-backed
        image processors rescale, normalize and cut into patches the images resized on the host (`host_resized`), on
        a stream of their own, while the pixels the items prepared there hold, not yet admitted, stay under
        `image_bytes`; past it, or out of its memory, an item's go on the host."""
        self.adapter, self.processor, self.dtype, self.timings = adapter, processor, dtype, timings
        self.image_cache, self.pin = image_cache, pin
        self.image_device, self.image_bytes, self.held_on_device = image_device, image_bytes, 0
        self._held_lock = threading.Lock()
        self._stream = None
        if str(image_device).startswith("cuda"):
            import torch

            self._stream = torch.cuda.Stream(image_device)
        self.pool = ThreadPoolExecutor(
            max_workers=max(1, min(THREADS, (os.cpu_count() or 2) - 1)), thread_name_prefix="vlm-intake"
        )
        # Items with videos on a thread of their own: a video's frames take seconds to decode, and images never
        # queue behind them.
        self.video_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-video")
        self._first, self._warm = threading.Lock(), False

    def submit(self, item: GenerationRequest, when_done: Callable[[], None]) -> Future:
        future = (self.video_pool if item.videos else self.pool).submit(self.prepare, item)
        future.add_done_callback(lambda _: when_done())
        return future

    def close(self) -> None:
        for pool in (self.pool, self.video_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def prepare(self, item: GenerationRequest):
        """The first call runs alone: a fast tokenizer sets its padding state then, which concurrent calls race for."""
        started = time.perf_counter()
        processor, held = self._recalled(item)
        if item.videos:  # their frames first, outside the first call's lock
            self.adapter.decode_videos(processor, item)
        with self._first if not self._warm else contextlib.nullcontext():
            inputs, sizes = self._on_device(processor, item) if self._room_on_device() else (None, None)
            if inputs is None:
                inputs, sizes = self.adapter.batch_inputs(processor, [item], "cpu", self.dtype)
            self._warm = True
        if self.pin:  # here, not on the engine thread where they go to the GPU
            for name, value in inputs.items():
                inputs[name] = page_locked(value)
        self.timings["intake_s"] += time.perf_counter() - started
        return inputs, sizes[0], held

    def _room_on_device(self) -> bool:
        with self._held_lock:
            return self.image_device is not None and self.held_on_device < self.image_bytes

    def _on_device(self, processor, item: GenerationRequest):
        """`batch_inputs` with the images processed on `image_device`, or (None, None) when that runs out of memory.
        Its own stream: on the engine's, the image's copy to the GPU would wait for the steps launched before it.
        The pixels are ready when this returns, and their memory is not reused before the engine's stream (the
        default one) has read them."""
        import torch

        from runpod_vlm.engine.gpu_errors import is_out_of_memory

        try:
            with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
                inputs, sizes = self.adapter.batch_inputs(
                    processor, [item], "cpu", self.dtype, image_device=self.image_device
                )
            if self._stream:
                self._stream.synchronize()
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            return None, None
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.device == torch.device(self.image_device):
                if value.is_cuda:
                    value.record_stream(torch.cuda.default_stream(value.device))
                self._hold(value)
        return inputs, sizes

    def _hold(self, value) -> None:
        """Counts `value`'s bytes as held on the device until the tensor is dropped (once admitted, the engine
        joins or reads it into tensors of its own)."""
        size = value.untyped_storage().nbytes()
        with self._held_lock:
            self.held_on_device += size
        weakref.finalize(value, self._release, size)

    def _release(self, size: int) -> None:
        with self._held_lock:
            self.held_on_device -= size

    def _recalled(self, item: GenerationRequest) -> tuple:
        """The processor for `item`, and the image-cache entries it holds on to: where every image's encoding is
        cached, one that skips their pixels (its family's), holding the entries until the forward reads them."""
        cache = self.image_cache
        if cache is None or not item.image_keys or item.videos:
            return self.processor, {}
        entries = [cache.peek(key) for key in item.image_keys]
        if any(entry is None for entry in entries):
            return self.processor, {}
        recalled = self.adapter.recalled_images_processor(self.processor, [grid for _, grid in entries])
        if recalled is None:
            return self.processor, {}
        return recalled, dict(zip(item.image_keys, entries))


def on_device(inputs, device, floating_only: bool = False, kept: tuple = ()):
    """`inputs` with its tensors (`floating_only`: the pixels; never those named in `kept`) on `device`, each copy
    queued without waiting for the GPU's earlier work (`host_copies`); a repeated row goes once."""
    import torch

    for_gpu = str(device).startswith("cuda")

    def moved(name, value):
        if not isinstance(value, torch.Tensor) or (floating_only and not value.is_floating_point()) or name in kept:
            return value
        return to_without_copying_repeats(page_locked(value) if for_gpu else value, device, non_blocking=True)

    return type(inputs)({name: moved(name, value) for name, value in inputs.items()})


def with_generated(inputs, ids: list[int], token_types: dict) -> None:
    """A one-item prompt's inputs followed by `ids` it had generated, in every per-token tensor: the attention
    mask, and the others as `token_types` names them, else 0 (text, e.g. in Qwen's mm_token_type_ids)."""
    import torch

    shape = tuple(inputs["input_ids"].shape)
    for name, value in list(inputs.items()):
        if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
            kind = 1 if name == "attention_mask" else token_types.get(name, 0)
            tail = ids if name == "input_ids" else [kind] * len(ids)
            inputs[name] = torch.cat([value, torch.tensor([tail], dtype=value.dtype, device=value.device)], dim=1)
