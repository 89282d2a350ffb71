"""The engine thread: items queued, admitted into the decoder, decoded, answered."""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Optional

from runpod_vlm.engine.background_compile import BackgroundCompiler
from runpod_vlm.engine.blocks import BLOCK_SIZE
from runpod_vlm.engine.compile import decoder_layers, set_torch_cache_dirs, vision_blocks
from runpod_vlm.engine.decoder import PagedDecoder
from runpod_vlm.engine.gpu_errors import is_fatal_gpu_error
from runpod_vlm.engine.grammar import Grammars
from runpod_vlm.engine.image_cache import ImageEmbeddingCache
from runpod_vlm.engine.intake import PREPARED_ON_GPU_BYTES, Intake
from runpod_vlm.engine.loading import load_model
from runpod_vlm.engine.long_rope import per_row_long_rope
from runpod_vlm.engine.memory import kv_pool_tokens
from runpod_vlm.engine.one_at_a_time import OneAtATime
from runpod_vlm.engine.paged_attention import use_paged_attention
from runpod_vlm.engine.prefill_graphs import GRAPH_TOKENS
from runpod_vlm.engine.projections import share_weights
from runpod_vlm.engine.runner import Runner
from runpod_vlm.engine.scheduler import Scheduler
from runpod_vlm.engine.ticket import Ticket
from runpod_vlm.engine.view import EngineView
from runpod_vlm.engine.vision_attention import use_packed_vision_attention
from runpod_vlm.families.base import end_tokens
from runpod_vlm.settings import Settings, SettingsError
from runpod_vlm.vocabulary import (
    GENERATION_FAILED,
    GPU_FAILURE,
    WORKER_STOPPING,
    GenerationRequest,
    RequestError,
    as_request_error,
    join_param,
)

log = logging.getLogger("runpod-vlm")

# A graph asked for ahead of need (not of a shape met) is recorded only after the engine has had nothing to do for
# this long: a request that arrives during a recording waits for it (100-200 ms on the H200), and a client sending its
# next request on each answer met one per request in a fresh worker.
RECORD_AHEAD_AFTER_IDLE_S = 0.25


def _close_at_exit(engine: weakref.ref) -> None:
    live = engine()
    if live is not None:
        live.close()


class Engine:
    """The loaded model, its processor and family adapter. One per process."""

    def __init__(self, settings: Settings, quantize: Optional[str] = None, on_fatal: Callable[[], None] = lambda: None):
        """`on_fatal()` is called once the GPU has failed for good (the worker should be replaced)."""
        self.settings = settings
        self.on_fatal = on_fatal
        self.on_finished: Optional[Callable[[Ticket, Any], None]] = None  # told of each item's end (metrics)
        self.model_id = settings.model
        self.quantize = quantize or settings.quantize
        self.broken = False  # a fatal GPU error happened: nothing more runs here
        self._stop_by: Optional[float] = None  # after SIGTERM: when the items still running fail
        self._closed = False  # close(): the engine thread ends, nothing more runs here
        self._worked_at = time.monotonic()  # when the engine thread last had something to do
        self._load()
        self.image_cache = ImageEmbeddingCache(settings.image_cache_mb * 2**20) if settings.image_cache_mb else None
        self._wake = threading.Condition()  # guards the scheduler's queue; the engine thread waits on it
        on_gpu = str(self.model.device).startswith("cuda")
        self.compiler = BackgroundCompiler(
            self.model,
            self.processor,
            self.adapter,
            settings,
            self.dtype,
            # A packed vision tower's blocks (1.5x for 23 images; on the CPU its attention runs per image, which
            # dynamo would trace anew for every count) and, for prompts packed, the prefill's decoder layers.
            compiles_vision=self.packed_vision and on_gpu and bool(vision_blocks(self.model)),
            compiles_prefill=self.continuous and on_gpu and bool(decoder_layers(self.model)),
            make_decoder=self._make_decoder,
            recording_wanted=self._recording_wanted,
            on_ready=self.wake_up,
        )
        # The queue, the rows, the chunking prompt, the row cap and the KV pool's bookkeeping: the plan of each step.
        self.scheduler = Scheduler(
            settings.max_batch_tokens,
            self.media_token_ids,
            self.context_length,
            self.adapter.prefills_alone or self.recompute_at is not None,  # a forward's factors fit one prompt
            self.recompute_at,
        )
        # The items of a family outside the batch (the remote-code ones): one at a time.
        self.alone = OneAtATime(self.loaded, self.tokenizer, self.eos_ids, self.scheduler.context_error)
        self._thread: Optional[threading.Thread] = None
        self._intake: Optional[Intake] = None
        self.timings: collections.Counter = collections.Counter()  # seconds and counts by phase (benchmarks)
        # The decoder and its KV pool, made at boot (`warm_up`) or at the engine thread's first step (`start_decoder`),
        # and the runner that carries out the scheduler's plan on it.
        self.decoder: Optional[PagedDecoder] = None
        self.runner: Optional[Runner] = None
        self._decoder_lock = threading.Lock()
        self.grammars: Optional[Grammars] = None  # made at boot (warm_up) or the first request for structured output

    # ---- loading ----------------------------------------------------------------------------

    def _load(self) -> None:
        started = time.perf_counter()
        self.loaded = loaded = load_model(self.settings, self.quantize)
        self.model, self.processor, self.adapter = loaded.model, loaded.processor, loaded.adapter
        self.model_type, self.dtype = loaded.model_type, loaded.dtype
        self.eos_ids = end_tokens(self.model, self.tokenizer)
        text_config = self.model.config.get_text_config(decoder=True)
        self.context_length = getattr(text_config, "max_position_embeddings", None)
        self.use_graphs = self._cuda_graphs_possible()
        self.compile = self.use_graphs and self.settings.compile
        # Rows join and leave a running batch through the paged cache; remote-code chat() APIs cannot, and answer
        # one item at a time. Sliding-window layers (Gemma 3) and chunked attention (Llama 4) read their rows' keys
        # within their limits (`PagedStep.limits`); LongRoPE's factors (Phi-4) are chosen per row (long_rope.py).
        kinds = set(getattr(text_config, "layer_types", None) or ())
        self.continuous = (
            self.adapter.native
            and kinds <= {"full_attention", "sliding_attention", "chunked_attention"}
            and use_paged_attention(self.model)
        )
        # where a row's LongRoPE factors switch: it is prefilled again there (long_rope.py)
        self.recompute_at = per_row_long_rope(self.model) if self.continuous else None
        if self.compile and self.continuous:
            share_weights(self.model)  # one product a group of projections in the compiled decode step
        self.prefix_caching = self.settings.prefix_caching and self.adapter.prefix_caching and self.continuous
        self.packed_vision = self.adapter.packed_vision and use_packed_vision_attention(self.model)
        names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "vision_start_token_id")
        # Phi-4-multimodal's placeholder is its vision config's
        configs = (self.model.config, getattr(self.model.config, "vision_config", None))
        self.media_token_ids = {v for c in configs for v in (getattr(c, n, None) for n in names) if isinstance(v, int)}
        log.info("loaded %s (%s) in %.1fs", self.model_id, self.adapter.name, time.perf_counter() - started)

    def start_decoder(self) -> PagedDecoder:
        """The decoder and its KV pool, made once (at boot, else at the engine thread's first step; tests and
        benchmarks that look at it before any job), and the background compile of its shapes queued. Raises
        SettingsError where the GPU cannot hold the KV pool VLM_KV_CACHE_TOKENS asks for."""
        with self._decoder_lock:
            if self.decoder is not None:
                return self.decoder
            decoder = self.new_decoder()
            self.scheduler.pool = decoder.pool
            self.runner = Runner(
                decoder,
                self.scheduler,
                self.loaded,
                self._wake,
                self.timings,
                image_cache=self.image_cache,
                prefix_caching=self.prefix_caching,
                grammars=self._grammars,
                accept=self._accept,
                gpu_failed=self._gpu_failed,
            )
            self.decoder = decoder
        missing = [b for b in decoder.buckets if b not in self.compiler.shapes]
        if self.compile and missing:
            self.compiler.start(missing)
        return decoder

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    def describe(self) -> dict:
        """What this engine runs, as an operator reads it in the boot log."""
        return {
            "model": self.model_id,
            "family": self.adapter.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(getattr(self.model, "device", "?")),
            "quantize": self.quantize,
            "batching": "continuous" if self.continuous else "one request at a time",
            "rows": self.settings.max_batch_size,
            "kv_cache_tokens": self.decoder.pool.capacity_tokens if self.decoder else None,
            "kv_block_size": BLOCK_SIZE,
            "max_batch_tokens": self.scheduler.token_budget,
            "compiled_decode": self.compile,
            "cuda_graphs": self.use_graphs,
        }

    def view(self) -> EngineView:
        """What the engine holds now (callable from any thread)."""
        decoder, scheduler = self.decoder, self.scheduler
        chunking, cap = scheduler.chunking, scheduler.row_cap
        pool = decoder.pool if decoder is not None else None
        return EngineView(
            queued=len(scheduler.waiting),
            running=len(scheduler.running),
            prefilling=int(chunking is not None),
            kv_blocks=pool.capacity if pool else 0,
            kv_blocks_free=pool.free if pool else 0,
            kv_blocks_cached=pool.cached if pool else 0,
            block_size=BLOCK_SIZE,
            row_cap=cap[0] if cap else None,
            decode_graphs=len(decoder.step_graphs.graphs) if decoder is not None else 0,
            compiled_row_buckets=tuple(sorted(self.compiler.shapes)),
            image_cache_hits=self.image_cache.hits if self.image_cache else 0,
            image_cache_misses=self.image_cache.misses if self.image_cache else 0,
            timings=dict(self.timings),
            thread_alive=self._thread is not None and self._thread.is_alive(),
        )

    def _cuda_graphs_possible(self) -> bool:
        import torch

        on_cuda = torch.cuda.is_available() and str(self.model.device).startswith("cuda")
        return bool(self.quantize in ("none", "fp8") and self.adapter.native and on_cuda)

    # ---- generation: the engine thread ------------------------------------------------------

    def submit(self, item: GenerationRequest, listener: Callable[[Any], None], stream: bool = False) -> Ticket:
        """Queue an item. `listener` is called from the engine thread with StreamDelta events (when
        `stream`) and then exactly once with the final Generation or RequestError."""
        return self.submit_all([item], [listener], stream)[0]

    def submit_all(
        self, items: list[GenerationRequest], listeners: list, stream: bool = False, same_prompt: bool = False
    ) -> list[Ticket]:
        """Queue items together (a batch call's): they are admitted together when rows allow. `same_prompt`: the items
        are choices of one request (the same prompt and images): prepared once, and admitted one after the other so
        that each later one reads the first's prompt from the prefix cache instead of computing it again."""
        tickets = [Ticket(item, listener, stream, self.on_finished) for item, listener in zip(items, listeners)]
        if self.broken or self._closed:
            return [ticket.fail(GPU_FAILURE if self.broken else WORKER_STOPPING) for ticket in tickets]
        for ticket in tickets:
            if ticket.item.videos and not self.adapter.takes_video(self.model_type):
                message = f"this model ({self.adapter.name}) takes no video; send images"
                ticket.finish(RequestError("unsupported_video", message, ticket.item.videos[0].param))
        queued = [ticket for ticket in tickets if not ticket.done]
        if not queued:
            return tickets
        if self.continuous:
            call = object()  # the items of one call are admitted together
            for ticket in queued:
                ticket.call = call
                if same_prompt and ticket is not queued[0]:
                    ticket.prepared, ticket.group_limit = queued[0].prepared, 1
                else:
                    ticket.prepared = self.intake().submit(ticket.item, self.wake_up)
                params = ticket.item.params
                if params.json_schema is not None:
                    param = join_param(ticket.item.param, params.schema_param)
                    limit = params.max_new_tokens, join_param(ticket.item.param, "max_new_tokens")
                    ticket.grammar = self._grammars().start(params.json_schema, param, limit)
                    ticket.grammar.add_done_callback(lambda _: self.wake_up())
        with self._wake:
            self.scheduler.add(queued)
            self._wake.notify()
            self._start_thread()
        return tickets

    def intake(self) -> Intake:
        """The intake: each item's processor call on its threads (made at the first batched submit)."""
        with self._wake:
            if self._intake is None:
                self._intake = Intake(
                    self.adapter,
                    self.processor,
                    self.dtype,
                    self.timings,
                    self.image_cache,
                    pin=str(self.model.device).startswith("cuda"),
                    image_device=str(self.model.device) if self._images_on_gpu() else None,
                )
            return self._intake

    def wake_up(self) -> None:
        """Have the engine thread look at its queue and the compile again (an item prepared, a grammar built, a
        compiled shape ready)."""
        with self._wake:
            self._wake.notify()

    def _idle(self) -> bool:
        """Nothing to do until woken (call with `_wake` held): no queued call whose items are all prepared, none
        decoding."""
        busy = self.scheduler.busy() or (self.runner is not None and self.runner.launched)
        return not busy and not self.scheduler.has_admissible() and not self.compiler.switch_due()

    def _captures_ahead_due(self, ahead: Optional[bool] = None) -> bool:
        """A graph to record while idle (`ahead` of need too: by default once `_quiet`), and no item queued (call with
        `_wake` held): one still in the intake would wait for the whole recording when it is ready a few ms later."""
        ahead = self._quiet() if ahead is None else ahead
        return not self.scheduler.waiting and self.decoder is not None and self.decoder.step_graphs.due(ahead)

    def _quiet(self) -> bool:
        return self._quiet_in_s() <= 0

    def _quiet_in_s(self) -> float:
        """How long until the engine has had nothing to do for RECORD_AHEAD_AFTER_IDLE_S (<= 0: it has)."""
        return RECORD_AHEAD_AFTER_IDLE_S - (time.monotonic() - self._worked_at)

    def _idle_wait_s(self) -> Optional[float]:
        """How long the idle engine thread waits unless woken: until a graph asked for ahead may be recorded, or a
        little while after SIGTERM (for its deadline); else until woken."""
        waits = [0.05] if self._stop_by is not None else []
        if self._captures_ahead_due(ahead=True):
            waits.append(self._quiet_in_s())
        return min(waits, default=None)

    def start_thread(self) -> None:
        """Start the engine thread now (else at the first submit, or at `warm_up` where the step compiles), awake."""
        with self._wake:
            self._start_thread()
            self._wake.notify()

    def _start_thread(self) -> None:
        """Start the engine thread once (call with `_wake` held), and end it at the interpreter's exit: a daemon
        thread still recording a CUDA graph while the interpreter tears down aborted the process (bench/paged.py's
        workers, "terminate called without an active exception")."""
        if self._thread is None:
            atexit.register(_close_at_exit, weakref.ref(self))
            # Intake threads and the background compile hold the GIL between the engine thread's kernel
            # launches: it takes the GIL back within 0.5 ms, not Python's 5 (a third of batch-1 speed while compiling).
            sys.setswitchinterval(0.0005)
            self._thread = threading.Thread(target=self._serve, name="vlm-engine", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """The engine thread: admit queued items at step boundaries, decode, hand out tokens."""
        import torch

        with torch.inference_mode():
            self._serve_forever()

    def _serve_forever(self) -> None:
        while True:
            with self._wake:
                while (idle := self._idle()) and not self._closed and not self._captures_ahead_due():
                    self._wake.wait(self._idle_wait_s())
                if self._closed:
                    break
                waiting = self.scheduler.drop_cancelled()
            started = time.perf_counter()
            try:
                if self._stop_by is not None and time.monotonic() >= self._stop_by:
                    self._fail_all(WORKER_STOPPING, queued=True)  # on every path: one at a time too
                    continue
                if idle:  # the GPU has nothing else to do
                    self.decoder.step_graphs.capture_one_ahead(self._quiet())
                    self.timings["recording_ahead_s"] += time.perf_counter() - started  # a job arriving waits for it
                    continue
                if not self.continuous:
                    if waiting:
                        self._take(waiting[:1])
                        self.alone.run(waiting[0])
                    continue
                self.start_decoder()  # at the first step, unless made at boot
                if self.compiler.switch_due():
                    self.runner.hand_out_all()  # the switch drops graphs: none may be in flight
                    self.compiler.switch(self.decoder)
                self.runner.step(waiting)
            except SettingsError as error:  # a KV pool the GPU cannot hold, made at the first step (no warm-up)
                self._fail_all(as_request_error(error), queued=True)
            except Exception as error:
                if is_fatal_gpu_error(error):
                    self._gpu_failed()
                    continue
                log.exception("the engine failed a step; failing the items in flight (the queued ones if none)")
                self._fail_all(GENERATION_FAILED, queued=not self.scheduler.running)  # else it would come again
            finally:
                self.timings["busy_s"] += time.perf_counter() - started  # the engine thread's time not waiting
                if not idle:
                    self._worked_at = time.monotonic()
                waiting = None  # nothing of an answered item held while the thread waits

    def _take(self, tickets: list[Ticket]) -> None:
        with self._wake:
            self.scheduler.take(tickets)

    # ---- structured output --------------------------------------------------------------------

    def _grammars(self) -> Grammars:
        """The grammar builder (llguidance's view of the tokenizer is made on its thread as it starts)."""
        if self.grammars is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            end = min(i for i in self.eos_ids if i < vocab)
            self.grammars = Grammars(self.tokenizer, vocab, end, self.settings.schema_timeout_s)
        return self.grammars

    def _accept(self, ticket: Ticket, tokens: list[int], logprobs: Optional[list] = None) -> None:
        """New tokens for a row (`Ticket.take`); at its end the row is freed and the item answered."""
        if not ticket.take(tokens, logprobs, self.eos_ids):
            return
        self.compiler.answered.set()
        self.decoder.release(ticket.row)
        self.scheduler.finished(ticket.row)
        if not ticket.cancelled:
            ticket.finish(ticket.result or ticket.answer(self.tokenizer, self.eos_ids))

    def _fail_all(self, error: RequestError, queued: bool = False) -> None:
        """Fail the items in flight (and the queued ones too when `queued`)."""
        if self.runner is not None:
            self.runner.launched.clear()
        with self._wake:
            self.scheduler.fail_all(error, queued, lambda row: self.decoder.release(row))

    def _gpu_failed(self) -> None:
        """A fatal CUDA error (illegal access, device-side assert, ECC): the context is unusable. Every
        item fails with `gpu_failure`, later ones at once, and `on_fatal` asks for a new worker."""
        log.critical("fatal GPU error: failing every request and asking RunPod for a new worker", exc_info=True)
        self.broken = True
        self.on_fatal()
        self._fail_all(GPU_FAILURE, queued=True)

    # ---- the decoder, its KV pool and its compiled step ----------------------------------------

    def new_decoder(self) -> PagedDecoder:
        """A decoder with the engine's KV pool and step (`start_decoder` keeps the one it makes). A fault hook too:
        tests make it raise, as a pool the GPU cannot allocate at the first job does."""
        set_torch_cache_dirs(self.settings)  # before the decode kernel or the compile builds anything
        decoder = self._make_decoder(self.model, self._kv_pool_blocks(), self.use_graphs)
        self.compiler.use_compiled(decoder)
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens) for up to %d rows",
            decoder.pool.capacity,
            BLOCK_SIZE,
            decoder.pool.capacity_tokens,
            decoder.rows,
        )
        return decoder

    def _make_decoder(self, model, blocks: int, use_graph: bool) -> PagedDecoder:
        decoder = PagedDecoder(
            model,
            self.eos_ids,
            rows=self.settings.max_batch_size,
            blocks=blocks,
            block_size=BLOCK_SIZE,
            use_graph=use_graph,
            interval=self.settings.sync_interval,
            max_row_tokens=self.context_length,
            prefill_tokens=self.scheduler.token_budget,
        )
        decoder.step_graphs.capture_lock = self.compiler.capture_lock
        return decoder

    def _recording_wanted(self) -> bool:
        """Whether a decode step ran eagerly for want of a graph the compile's GPU work held up (rows decoding)."""
        decoder = self.decoder
        return decoder is not None and decoder.step_graphs.recording_wanted and bool(self.scheduler.running)

    def wait_until_compiled(self, timeout: float) -> bool:
        """Whether every shape of the current decoder decodes compiled (benchmarks, tests); False at once where
        nothing compiles (compile off, or no CUDA graphs: a CPU)."""
        deadline = time.monotonic() + timeout
        while not ((decoder := self.decoder) and decoder.steps_only_with(self.compiler.forward)):
            if not self.compile or time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _images_on_gpu(self) -> bool:
        """Whether the intake finishes the images on the model's GPU (VLM_PREPROCESS_ON_GPU, where the family can)."""
        on_gpu = str(self.model.device).startswith("cuda")
        return on_gpu and self.settings.preprocess_on_gpu and self.adapter.images_finish_on_gpu(self.processor)

    def _kv_pool_blocks(self) -> int:
        graph_tokens = min(GRAPH_TOKENS, self.scheduler.token_budget) if self.use_graphs else 0
        pixels = PREPARED_ON_GPU_BYTES if self._images_on_gpu() else 0
        return max(2, kv_pool_tokens(self.model, self.settings, self.dtype, graph_tokens, pixels) // BLOCK_SIZE + 1)

    def warm_up(self) -> None:
        """Make the decoder and its KV pool (a VLM_KV_CACHE_TOKENS the GPU cannot hold fails the boot, not a request),
        and start compiling the decode step in the background; the engine switches shape by shape."""
        if not self.continuous:
            return
        self._grammars()  # llguidance reads the tokenizer on its own thread meanwhile, not in the first request
        if self.compile:
            with self._wake:
                self._start_thread()
        self.start_decoder()

    def close(self) -> None:
        """End the engine thread, failing what is queued or running with `worker_stopping`, and let go of the
        KV pool (handler.reset_engine: tests and benchmarks that load another engine in the same process)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self.scheduler.busy():  # their rows' state was made in inference mode, on the engine thread
            import torch

            with torch.inference_mode():
                self._fail_all(WORKER_STOPPING, queued=True)
        self._fail_all(WORKER_STOPPING, queued=True)
        if self._intake is not None:
            self._intake.close()
        self.compiler.close()
        if self.grammars is not None:
            self.grammars.close()
        self.decoder = self.runner = None

    def stop_after(self, grace: float) -> None:
        """Items still running `grace` seconds from now fail with `worker_stopping` (on SIGTERM)."""
        with self._wake:
            self._stop_by = time.monotonic() + grace
            self._wake.notify()
