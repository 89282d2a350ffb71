"""The engine's background compile: the decode step's decoder layers compiled one row bucket after the
other on a thread of their own, then the vision blocks and the prefill's decoder layers with dynamic shapes, from
saved artifacts when they match, and all switched to at a step boundary the engine thread chooses."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from runpod_vlm.engine.blocks import BLOCK_SIZE
from runpod_vlm.engine.compile import (
    compile_cache_key,
    decoder_layers,
    dynamic_forwards,
    load_compile_artifacts,
    model_view,
    run_blocks_compiled,
    run_layers_compiled,
    save_compile_artifacts,
    vision_blocks,
    with_compiled_layers,
)
from runpod_vlm.engine.projections import one_product_per_input, with_shared_products
from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn

log = logging.getLogger("runpod-vlm")

COMPILE_AFTER_FIRST_ANSWER_S = 10.0  # a new worker's first job is answered before the background compile slows it
# The most the compile waits, before it takes the GPU for its next shape, for a decode step's graph the engine thread
# could not record while the compile held it: those steps run eagerly meanwhile, beside the compile on the GIL. 16 jobs
# at once ran at 125-190 tokens/s through a fresh worker's compile, 2,354 where nothing compiled.
RECORDING_FIRST_S = 2.0
# Traces one layer class's forward may keep: one a decode bucket (six at 256 rows) for each kind of layer it has
# (Llama 4's full layers skip RoPE: two), and the prefill's dynamic ones. Past dynamo's default 8 the rest ran eagerly.
TRACES_PER_LAYER_CLASS = 32


class BackgroundCompiler:
    """The compile thread, what it made, and the switch to it. It reads the model and its processor; the engine
    tells it how to make a shadow decoder (`make_decoder`), whether a decode step waits for a recording the compile
    would hold up (`recording_wanted`), and is told when compiled code is ready (`on_ready`)."""

    def __init__(
        self,
        model,
        processor,
        adapter,
        settings,
        dtype,
        *,
        compiles_vision: bool,
        compiles_prefill: bool,
        make_decoder: Callable,
        recording_wanted: Callable[[], bool],
        on_ready: Callable[[], None],
    ):
        self.model, self.processor, self.adapter, self.settings, self.dtype = model, processor, adapter, settings, dtype
        self.compiles_vision, self.compiles_prefill = compiles_vision, compiles_prefill
        self.make_decoder, self.recording_wanted, self.on_ready = make_decoder, recording_wanted, on_ready
        self.forward = None  # the decode step's compiled forward, over a view of the model
        self.shapes: set = set()  # row buckets compiled
        self.capture_lock = threading.Lock()  # no CUDA graph is recorded while a shape compiles
        self.answered = threading.Event()  # set at the engine's first answer; the compile waits for it
        self.closed = False
        self._lock = threading.Lock()
        self._ready: list = []  # buckets compiled, not yet switched to
        self._vision = None  # the vision blocks' compiled forwards, likewise
        self._prefill = None  # the prefill's decoder layers' compiled forwards, likewise
        self._executor: Optional[ThreadPoolExecutor] = None

    def start(self, buckets: list[int]) -> None:
        """Compile the decoder's row buckets in the background (from saved artifacts when they match); decoding goes
        on with CUDA graphs of the plain forward, and switches at a step boundary (`switch`)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-compile")
        future = self._executor.submit(self._compile_shapes, buckets)
        future.add_done_callback(
            lambda f: (
                f.exception()
                and log.error("background compilation failed; decoding stays uncompiled", exc_info=f.exception())
            )
        )

    def finish(self) -> None:
        """Wait for what was started (tests)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def close(self) -> None:
        self.closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def switch_due(self) -> bool:
        """Whether compiled code is ready for the engine thread to switch to."""
        with self._lock:
            return bool(self._ready) or self._vision is not None or self._prefill is not None

    def switch(self, decoder) -> None:
        """At a step boundary (no graph in flight): buckets whose compiled forward is ready decode with it from now on,
        and the vision blocks and the prefill's decoder layers run compiled."""
        with self._lock:
            ready, self._ready = self._ready, []
            vision, self._vision = self._vision, None
            prefill, self._prefill = self._prefill, None
        if vision is not None:
            run_blocks_compiled(vision_blocks(self.model), vision)
            log.info("the vision blocks run compiled from now on")
        if prefill:
            run_layers_compiled(decoder_layers(self.model), prefill)
            log.info("prefills run the compiled decoder layers from now on")
        for bucket in ready:
            if decoder is not None:
                decoder.use_forward(bucket, self.forward)
                decoder.step_graphs.ask_ahead(bucket)
                log.info("decoding %d-row steps with the compiled forward from now on", bucket)

    def use_compiled(self, decoder) -> None:
        """A new decoder decodes its compiled buckets with the compiled forward."""
        for bucket in decoder.buckets:
            if bucket in self.shapes:
                decoder.use_forward(bucket, self.forward)

    def holding_the_gpu(self) -> threading.Lock:
        """The capture lock, for a compile's GPU work, once a decode step's graph the engine thread waits for is
        recorded (at most RECORDING_FIRST_S: it records at the next interval it launches); none is waited for when
        the engine has no rows decoding."""
        deadline = time.monotonic() + RECORDING_FIRST_S
        while time.monotonic() < deadline and not self.closed and self.recording_wanted():
            time.sleep(0.005)
        return self.capture_lock

    def _compile_shapes(self, buckets: list[int]) -> None:
        import torch

        self.answered.wait(COMPILE_AFTER_FIRST_ANSWER_S)
        if self.closed:
            return
        # Inductor's kernel-compiling processes made prefills 12x slower, compiling no faster (bench/contention.py).
        options = {} if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") else {"options": {"compile_threads": 1}}
        if self.forward is None:  # here, not on the engine thread: importing the compiler takes seconds
            view = model_view(self.model)
            step_options = options
            if with_shared_products(view):
                passes = {"pre_grad_custom_pass": one_product_per_input()}
                step_options = {"options": {**options.get("options", {}), **passes}}
            self.forward = with_compiled_layers(view, **step_options)
        rows, interval = self.settings.max_batch_size, self.settings.sync_interval
        key = compile_cache_key(
            self.settings.model,
            config=self.model.config,
            dtype=self.dtype,
            shapes={
                "rows": rows,
                "buckets": buckets,
                "interval": interval,
                "compiled": "decoder layers around paged attention",
                "vision_blocks": self.compiles_vision,
                "prefill_layers": self.compiles_prefill,
            },
        )  # older artifacts hold other shapes
        loaded = load_compile_artifacts(self.settings, key)  # never raises: a bad file is skipped
        with torch._dynamo.config.patch(recompile_limit=TRACES_PER_LAYER_CLASS):
            done = [
                bucket
                for bucket in buckets  # a second try: a CUDA graph capture may void the first
                if not self.closed and (self.compile_shape(bucket) or self.compile_shape(bucket))
            ]
        vision = self._compile_vision_blocks(options) if self.compiles_vision and not self.closed else None
        prefill = self.compile_prefill_layers(options) if self.compiles_prefill and not self.closed else None
        whole = (vision is not None or not self.compiles_vision) and (prefill is not None or not self.compiles_prefill)
        if len(done) == len(buckets) and whole and not loaded:
            save_compile_artifacts(self.settings, key)
        # All shapes switch at once: compiled code run while another shape is traced fails (process-wide state).
        with self._lock:
            self.shapes.update(done)
            self._ready.extend(done)
            self._vision, self._prefill = vision, prefill
        self.on_ready()

    def _compile_vision_blocks(self, options: dict):
        """The vision blocks' compiled forwards, traced on a view of the model for one image alone and for
        two of other sizes; None when that failed (they stay eager)."""
        import torch
        from PIL import Image

        started = time.perf_counter()
        view = model_view(self.model)
        blocks = vision_blocks(view)
        forwards = dynamic_forwards(blocks, **options)
        run_blocks_compiled(blocks, forwards, recompile=True)
        params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False)
        try:
            with self.holding_the_gpu(), torch.inference_mode():
                for sizes in ([(224, 224)], [(336, 224), (224, 448)]):
                    turns = [[Turn("user", [Image.new("RGB", size), "Describe."])] for size in sizes]
                    items = [GenerationRequest("caption", t, params) for t in turns]
                    inputs, _ = self.adapter.batch_inputs(self.processor, items, self.model.device, self.dtype)
                    view(**inputs, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
        except Exception:
            log.warning("compiling the vision blocks failed; they stay uncompiled", exc_info=True)
            return None
        log.info("compiled the vision blocks in the background in %.1fs", time.perf_counter() - started)
        return forwards

    def compile_prefill_layers(self, options: dict):
        """The decoder layers' compiled forwards for prefills, traced on a shadow decoder over a view of the model
        for two prompts packed together, then one prompt in two chunks; none when the family prefills padded, None
        when that failed (prefills stay eager either way)."""
        import torch

        started = time.perf_counter()
        view = model_view(self.model)
        layers = decoder_layers(view)
        forwards = dynamic_forwards(layers, **options)
        params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False)
        texts = ["Describe the picture.", "What is written on the sign, and in which language is it written?"]
        items = [GenerationRequest("chat", [Turn("user", [text])], params) for text in texts]
        try:
            limit = torch._dynamo.config.patch(recompile_limit=TRACES_PER_LAYER_CLASS)
            with self.holding_the_gpu(), torch.inference_mode(), limit:
                inputs, _ = self.adapter.batch_inputs(self.processor, items, self.model.device, self.dtype)
                blocks = 3 * -(-inputs["input_ids"].shape[1] // BLOCK_SIZE) + 1
                shadow = self.make_decoder(view, blocks=blocks, use_graph=False)
                shadow.prompts.prefill(inputs, [0, 1], [params] * 2)  # eager: whether the family packs its prompts
                if not shadow.prompts.packs:
                    log.info("prefills stay eager: the %s family prefills padded", self.adapter.name)
                    return {}
                for row in (0, 1):
                    shadow.release(row)
                run_layers_compiled(layers, forwards, recompile=True)
                shadow.prompts.prefill(inputs, [0, 1], [params] * 2)
                alone, _ = self.adapter.batch_inputs(self.processor, items[1:], self.model.device, self.dtype)
                chunked = shadow.prompts.begin_chunks(alone, 2, params)
                while shadow.prompts.prefill_chunk(chunked, chunked.length // 2 + 1) is None:
                    pass
                torch.cuda.synchronize()
        except Exception:
            log.warning("compiling the decoder layers for prefills failed; prefills stay eager", exc_info=True)
            return None
        log.info("compiled the decoder layers for prefills in the background in %.1fs", time.perf_counter() - started)
        return forwards

    def compile_shape(self, bucket: int) -> bool:
        """Trace and compile one decode shape on a shadow decoder of the same rows (own buffers and a small
        pool of its own), so the engine's own state is never touched from this thread."""
        import torch

        started = time.perf_counter()
        try:
            with self.holding_the_gpu(), torch.inference_mode():
                params = GenerationParams(max_new_tokens=4, temperature=0.0, top_p=1.0, do_sample=False)
                items = [GenerationRequest("chat", [Turn("user", ["warm up"])], params)] * bucket
                inputs, _ = self.adapter.batch_inputs(self.processor, items, self.model.device, self.dtype)
                blocks = bucket * -(-(inputs["input_ids"].shape[1] + 2) // BLOCK_SIZE) + 1
                shadow = self.make_decoder(model_view(self.model), blocks=blocks, use_graph=False)
                shadow.prompts.prefill(inputs, list(range(bucket)), [params] * bucket)
                shadow.use_forward(bucket, self.forward)
                for row in range(bucket):
                    shadow.grow(row, shadow.lengths[row] + 2)
                for _ in range(2):
                    shadow.advance(bucket, shadow.span(2))
                torch.cuda.synchronize()
        except Exception:
            log.warning("compiling the %d-row decode step failed; it stays uncompiled", bucket, exc_info=True)
            return False
        log.info("compiled the %d-row decode step in the background in %.1fs", bucket, time.perf_counter() - started)
        return True
