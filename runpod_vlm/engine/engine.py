"""The engine thread: items queued, admitted into the decoder, decoded, answered."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from runpod_vlm.engine.compile import (
    compile_cache_key,
    load_compile_artifacts,
    model_view,
    save_compile_artifacts,
    set_torch_cache_dirs,
    with_compiled_layers,
)
from runpod_vlm.engine.decoder import SlotDecoder, use_grouped_query_decode_attention
from runpod_vlm.engine.grammar import Grammars
from runpod_vlm.engine.loading import load_model
from runpod_vlm.engine.ticket import Ticket, logprob_entries
from runpod_vlm.families.base import end_tokens
from runpod_vlm.settings import Settings
from runpod_vlm.vocabulary import (
    GENERATION_FAILED,
    GPU_FAILURE,
    WORKER_STOPPING,
    Generation,
    GenerationParams,
    GenerationRequest,
    RequestError,
    Turn,
    answered_length,
    join_param,
)

log = logging.getLogger("runpod-vlm")

COMPILE_AFTER_FIRST_ANSWER_S = 10.0  # a new worker's first job is answered before the background compile slows it


def is_out_of_memory(error: Exception) -> bool:
    return type(error).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(error)


def is_fatal_gpu_error(error: Exception) -> bool:
    """CUDA errors after which the context is unusable (unlike out-of-memory, which is recovered)."""
    text = str(error)
    return not is_out_of_memory(error) and (
        type(error).__name__ == "AcceleratorError"
        or any(s in text for s in ("illegal memory access", "device-side assert", "ECC error", "unspecified launch"))
    )


class Engine:
    """The loaded model, its processor and family adapter. One per process."""

    def __init__(self, settings: Settings, quantize: Optional[str] = None, on_fatal: Callable[[], None] = lambda: None):
        """`on_fatal()` is called once the GPU has failed for good (the worker should be replaced)."""
        self.settings = settings
        self.on_fatal = on_fatal
        self.model_id = settings.model
        self.quantize = quantize or settings.quantize
        self._compiled_forward = None
        self.broken = False  # a fatal GPU error happened: nothing more runs here
        self._stop_by: Optional[float] = None  # after SIGTERM: when the items still running fail
        self._compiled_shapes: set = set()  # (bucket, cache length) compiled in the background
        self._newly_compiled: list = []  # ... ready, not yet switched to by the engine thread
        self._answered = threading.Event()  # set at the first answer; the background compile waits for it
        self._load()
        self._wake = threading.Condition()  # guards the queue; the engine thread waits on it
        self._queue: list[Ticket] = []  # submitted, not yet given a row, in arrival order
        self._rows: dict[int, Ticket] = {}  # decoder row -> the item decoding there (engine thread only)
        self._thread: Optional[threading.Thread] = None
        self._decoder: Optional[SlotDecoder] = None
        self.grammars: Optional[Grammars] = None  # made at the first request for structured output

    # ---- loading ----------------------------------------------------------------------------

    def _load(self) -> None:
        started = time.perf_counter()
        loaded = load_model(self.settings, self.quantize)
        self.model, self.processor, self.adapter = loaded.model, loaded.processor, loaded.adapter
        self.model_type, self.dtype = loaded.model_type, loaded.dtype
        self.eos_ids = end_tokens(self.model, self.tokenizer)
        text_config = self.model.config.get_text_config(decoder=True)
        self.context_length = getattr(text_config, "max_position_embeddings", None)
        self.use_graphs = self._cuda_graphs_possible()
        self.compile = self.use_graphs and self.settings.compile
        # Rows join and leave a running batch through one static cache; sliding-window layers and remote-code
        # chat() APIs cannot, and answer one item at a time; nor can LongRoPE (Phi-4), whose factors switch on the
        # highest position in a batch, a free row's too. A window no shorter than the cache attends like full attention.
        window = getattr(text_config, "sliding_window", None)
        kinds = set(getattr(text_config, "layer_types", None) or (["sliding_attention"] if window else []))
        self.max_slots = window if "sliding_attention" in kinds else None
        longrope = (getattr(text_config, "rope_parameters", None) or {}).get("rope_type") == "longrope"
        self.continuous = (
            self.adapter.native
            and kinds <= {"full_attention", "sliding_attention"}
            and not longrope
            and (self.max_slots is None or self.max_slots >= self.settings.cache_len)
        )
        if self.continuous and self.use_graphs:  # a GPU speed-up; CPU runs keep transformers' SDPA
            use_grouped_query_decode_attention(self.model)
        log.info("loaded %s (%s) in %.1fs", self.model_id, self.adapter.name, time.perf_counter() - started)

    def _current_decoder(self) -> SlotDecoder:
        """The decoder, made at first use (which queues the background compile of its shapes)."""
        if self._decoder is None:
            self._decoder = self._new_decoder(self.settings.cache_len)
        return self._decoder

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
            "kv_cache_slots": self.settings.cache_len,
            "compiled_decode": self.compile,
            "cuda_graphs": self.use_graphs,
        }

    def _cuda_graphs_possible(self) -> bool:
        import torch

        on_cuda = torch.cuda.is_available() and str(self.model.device).startswith("cuda")
        return bool(self.quantize == "none" and self.adapter.native and on_cuda)

    # ---- generation: the engine thread ------------------------------------------------------

    def sampling_kwargs(self, params: GenerationParams) -> dict:
        kwargs: dict = {"max_new_tokens": params.max_new_tokens, "do_sample": params.do_sample}
        if params.do_sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if params.min_new_tokens:
            kwargs["min_new_tokens"] = params.min_new_tokens
        return kwargs

    def submit(self, item: GenerationRequest, listener: Callable[[Any], None], stream: bool = False) -> Ticket:
        """Queue an item. `listener` is called from the engine thread with StreamDelta events (when
        `stream`) and then exactly once with the final Generation or RequestError."""
        return self.submit_all([item], [listener], stream)[0]

    def submit_all(self, items: list[GenerationRequest], listeners: list, stream: bool = False) -> list[Ticket]:
        """Queue items together (a batch call's): they are admitted together when rows allow."""
        tickets = [Ticket(item, listener, stream) for item, listener in zip(items, listeners)]
        if self.broken:
            return [ticket.fail(GPU_FAILURE) for ticket in tickets]
        with self._wake:
            self._queue.extend(tickets)
            self._wake.notify()
            self._start_thread()
        return tickets

    def _start_thread(self) -> None:
        """Start the engine thread once (call with `_wake` held)."""
        if self._thread is None:
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
                while not self._queue and not self._rows and not self._newly_compiled:
                    self._wake.wait()
                self._queue = [t for t in self._queue if not t.cancelled]
                waiting = list(self._queue)
            try:
                if self._stop_by is not None and time.monotonic() >= self._stop_by:
                    self._fail_all(WORKER_STOPPING, queued=True)  # on every path: one at a time too
                    continue
                if not self.continuous:
                    if waiting:
                        self._take(waiting[:1])
                        self._run_alone(waiting[0])
                    continue
                if self._newly_compiled:
                    self._switch_to_compiled()
                self._admit(waiting)
                if self._rows:
                    self._decode_interval()
            except Exception as error:
                if is_fatal_gpu_error(error):
                    self._gpu_failed()
                    continue
                log.exception("the engine failed a step; failing the items in flight (the queued ones if none)")
                self._fail_all(GENERATION_FAILED, queued=not self._rows)  # else the same failure would come again

    def _take(self, tickets: list[Ticket]) -> None:
        with self._wake:
            self._queue = [t for t in self._queue if t not in tickets]

    def _run_alone(self, ticket: Ticket) -> None:
        """Families outside continuous batching (remote code, sliding-window caches): one at a time."""
        item = ticket.item
        try:
            if item.params.do_sample and item.params.seed is not None:  # one item at a time: the global generator
                import torch

                torch.manual_seed(item.params.seed)
            if item.params.json_schema is not None:
                message = f"the {self.adapter.name} family answers one request at a time, without structured output"
                raise RequestError("unsupported_parameter", message, join_param(item.param, "response_format"))
            if item.params.logprobs and not self.adapter.native:
                message = f"the {self.adapter.name} family answers through its repository's chat(), which gives none"
                raise RequestError("unsupported_parameter", message, join_param(item.param, "logprobs"))
            if self.adapter.native:
                ticket.finish(self._generate_with_generate(item))
            else:
                ticket.finish(self.adapter.run(self.model, self.processor, item, self.sampling_kwargs(item.params)))
        except RequestError as error:
            ticket.finish(error)
        except Exception:
            log.exception("generation failed")
            ticket.fail(GENERATION_FAILED)

    def _generate_with_generate(self, item: GenerationRequest):
        import torch

        inputs, input_sizes = self.adapter.batch_inputs(self.processor, [item], self.model.device, self.dtype)
        prompt_tokens = int(inputs["attention_mask"].sum())
        error = self._context_error(item, prompt_tokens)
        if error:
            return error
        kwargs = dict(eos_token_id=sorted(self.eos_ids), **self.sampling_kwargs(item.params))
        with torch.inference_mode():
            if not item.params.logprobs:
                out = self.model.generate(**inputs, **kwargs)
                return self._generation(
                    item, out[0, inputs["input_ids"].shape[1] :].tolist(), prompt_tokens, input_sizes[0]
                )
            out = self.model.generate(**inputs, **kwargs, output_logits=True, return_dict_in_generate=True)
            ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            logprobs = []  # of generate's raw logits, before its processors, as on the batched path
            for step, token in zip(out.logits, ids):
                step_logprobs = torch.log_softmax(step[0].float(), dim=-1)
                top_logprobs, top_ids = step_logprobs.topk(min(20, step_logprobs.shape[-1]))
                logprobs.append((step_logprobs[token].item(), top_ids.tolist(), top_logprobs.tolist()))
        return self._generation(item, ids, prompt_tokens, input_sizes[0], logprobs)

    def _admit(self, waiting: list[Ticket]) -> None:
        """Prefill as many waiting items as fit (in arrival order) and give them rows."""

        decoder = self._current_decoder()
        free = decoder.free_rows()
        if not waiting or not free:
            return
        size = min(len(free), *(t.group_limit or len(free) for t in waiting[: len(free)]))
        group = waiting[:size]
        self._take(group)
        try:
            self._place(group, free)
        except Exception as error:
            fatal = is_fatal_gpu_error(error)
            if fatal:
                self._gpu_failed()
            else:
                log.exception("could not admit %d items", len(group))
            with self._wake:
                lost = [t for t in group if t.row is None and t not in self._queue]
            for ticket in lost:
                ticket.fail(GPU_FAILURE if fatal else GENERATION_FAILED)

    def _place(self, group: list[Ticket], free: list[int]) -> None:
        import torch

        decoder = self._current_decoder()
        group = self._with_grammars(group)
        if not group:
            return
        try:
            items = [t.item for t in group]
            inputs, input_sizes = self.adapter.batch_inputs(self.processor, items, self.model.device, self.dtype)
        except Exception as error:
            if len(group) > 1:  # find the bad item: each is prepared alone
                return self._requeue(group, limit=1)
            if isinstance(error, RequestError):  # the family's adapter refused it
                return group[0].finish(error)
            return self._admit_failed(group[0])
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        errors = [self._context_error(t.item, n) for t, n in zip(group, prompt_tokens)]
        if any(errors):
            for ticket, error in zip(group, errors):
                if error:
                    ticket.finish(error)
            self._requeue([t for t, e in zip(group, errors) if not e])
            return
        prompt_length = inputs["input_ids"].shape[1]
        longest = max(t.item.params.max_new_tokens for t in group)
        shift = decoder.plan(prompt_length, longest)
        if shift is None:
            if len(group) > 1:  # a smaller group (shorter padding, fewer tokens) may fit
                return self._requeue(group, limit=len(group) // 2)
            if not self._rows:  # alone and still too long: a decoder with a longer cache
                length = decoder.length_to_hold(prompt_length, longest)
                if self.max_slots is not None and length > self.max_slots:
                    return self._run_alone(group[0])  # past the sliding window: generate() handles it
                self._decoder = self._new_decoder(length)
                return self._requeue(group)
            return self._requeue(group)  # waits for rows to finish
        decoder.shift(shift)
        rows = free[: len(group)]
        try:
            first = decoder.prefill(inputs, rows, [t.item.params for t in group], self._grammar_masks(group))
        except Exception as error:
            for row in rows:
                decoder.release(row)
            if is_fatal_gpu_error(error):
                raise
            if is_out_of_memory(error):
                if not decoder.allocated and decoder.length > self.settings.cache_len:
                    self._decoder = None  # a cache grown for a long request does not fit: back to the usual one
                torch.cuda.empty_cache()
                if len(group) > 1:  # halves, down to single items
                    log.warning("a prefill of %d items ran out of GPU memory; retrying in halves", len(group))
                    return self._requeue(group, limit=len(group) // 2)
                return group[0].finish(
                    RequestError(
                        "out_of_memory",
                        f"this request ({prompt_tokens[0]} prompt tokens with its "
                        f"{len(group[0].item.images)} images) does not fit in the GPU's free memory",
                        group[0].item.param,
                    )
                )
            if len(group) > 1:
                log.warning("a prefill of %d items failed; admitting them one by one", len(group), exc_info=True)
                return self._requeue(group, limit=1)
            return self._admit_failed(group[0])
        logprobs = decoder.take_logprobs() or {}
        for ticket, row, token, prompt, size in zip(group, rows, first, prompt_tokens, input_sizes):
            ticket.row, ticket.prompt_tokens, ticket.input_size = row, prompt, size
            self._rows[row] = ticket
            self._accept(ticket, [token], logprobs.get(row))
        self._next_grammar_masks()

    def _requeue(self, tickets: list[Ticket], limit: Optional[int] = None) -> None:
        """Back to the front of the queue; `limit`: admitted in groups of at most that many."""
        with self._wake:
            for ticket in reversed(tickets):
                if limit:
                    ticket.group_limit = min(limit, ticket.group_limit or limit)
                self._queue.insert(0, ticket)

    def _admit_failed(self, ticket: Ticket) -> None:
        log.exception("could not prepare an item")
        ticket.fail(GENERATION_FAILED)

    def _decode_interval(self) -> None:
        decoder = self._current_decoder()
        remaining = max(t.item.params.max_new_tokens - len(t.ids) for t in self._rows.values())
        # A grammar's next mask depends on the token just chosen: constrained rows step one token at a time.
        steps = 1 if decoder.any_constrained else max(1, min(decoder.interval, remaining))
        tokens = decoder.step(steps)
        logprobs = decoder.take_logprobs() or {}
        for row, ticket in list(self._rows.items()):
            self._accept(ticket, tokens[row], logprobs.get(row))
        self._next_grammar_masks()

    # ---- structured output --------------------------------------------------------------------

    def _with_grammars(self, group: list[Ticket]) -> list[Ticket]:
        """The group's tickets; each with a schema gets its matcher, one whose schema fails gets the error."""
        if not any(t.item.params.json_schema is not None for t in group):
            return group
        return self._grammars().attach(group)

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self.grammars = Grammars(self.tokenizer, vocab, min(i for i in self.eos_ids if i < vocab))
        return self.grammars

    def _grammar_masks(self, tickets: list[Ticket]):
        """Each ticket's allowed next tokens, or None when none has a schema."""
        matchers = [t.matcher for t in tickets]
        return self._grammars().masks_for(matchers) if any(matchers) else None

    def _next_grammar_masks(self) -> None:
        constrained = [(row, t) for row, t in self._rows.items() if t.matcher is not None]
        if constrained:
            rows, tickets = zip(*constrained)
            self._current_decoder().set_allowed(list(rows), self._grammar_masks(list(tickets)))

    def _accept(self, ticket: Ticket, tokens: list[int], logprobs: Optional[list] = None) -> None:
        """New tokens for a row (and their log-probabilities when it asked): stream them, and finish the row
        at its end token or length."""
        item, done = ticket.item, ticket.cancelled
        for n, token in enumerate(tokens):
            if done:
                break
            ticket.ids.append(token)
            if ticket.matcher is not None:
                ticket.matcher.consume_token(token)
            if item.params.logprobs and logprobs is not None:
                ticket.logprobs.append(logprobs[n])
            done = token in self.eos_ids or len(ticket.ids) >= item.params.max_new_tokens
        if ticket.stream and not ticket.cancelled:
            ticket.emit_delta(self.eos_ids)
        if done:
            self._answered.set()
            self._current_decoder().release(ticket.row)
            del self._rows[ticket.row]
            if not ticket.cancelled:
                ticket.finish(
                    self._generation(item, ticket.ids, ticket.prompt_tokens, ticket.input_size, ticket.logprobs)
                )

    def _fail_all(self, error: RequestError, queued: bool = False) -> None:
        """Fail the items in flight (and the queued ones too when `queued`)."""
        with self._wake:
            waiting, self._queue = (self._queue, []) if queued else ([], self._queue)
        for row, ticket in list(self._rows.items()):
            self._current_decoder().release(row)
            ticket.fail(error)
        self._rows.clear()
        for ticket in waiting:
            ticket.fail(error)

    def _gpu_failed(self) -> None:
        """A fatal CUDA error (illegal access, device-side assert, ECC): the context is unusable. Every
        item fails with `gpu_failure`, later ones at once, and `on_fatal` asks for a new worker."""
        log.critical("fatal GPU error: failing every request and asking RunPod for a new worker", exc_info=True)
        self.broken = True
        self.on_fatal()
        self._fail_all(GPU_FAILURE, queued=True)

    def _generation(
        self, item: GenerationRequest, ids: list[int], prompt_tokens: int, input_size, logprobs=None
    ) -> Generation:
        ids = ids[: item.params.max_new_tokens]
        kept = ids[: answered_length(ids, self.eos_ids)]
        top = item.params.top_logprobs
        entries = logprob_entries(self.tokenizer, kept, logprobs, top) if item.params.logprobs else None
        return Generation.from_ids(
            self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
            ids,
            self.eos_ids,
            item.params.max_new_tokens,
            # Grounding reads boxes between special tokens (Qwen's <|box_start|>...).
            raw_text=self.tokenizer.decode(kept, skip_special_tokens=False) if item.task == "grounding" else None,
            prompt_tokens=int(prompt_tokens),
            image_input_size=input_size,
            logprobs=entries,
        )

    def _context_error(self, item: GenerationRequest, prompt_tokens: int) -> Optional[RequestError]:
        if self.context_length and prompt_tokens + item.params.max_new_tokens > self.context_length:
            return RequestError(
                "context_too_long",
                f"the prompt ({prompt_tokens} tokens, images included) plus "
                f"max_new_tokens ({item.params.max_new_tokens}) exceed the model's context of "
                f"{self.context_length} tokens",
                join_param(item.param, "max_new_tokens"),
            )

    # ---- the decoder and its compiled step ----------------------------------------------------

    def _new_decoder(self, length: int) -> SlotDecoder:
        decoder = SlotDecoder(
            self.model,
            self.eos_ids,
            rows=self.settings.max_batch_size,
            length=length,
            use_graph=self.use_graphs,
            interval=self.settings.sync_interval,
        )
        for bucket in decoder.buckets:
            if (bucket, length) in self._compiled_shapes:
                decoder.use_forward(bucket, self._compiled_forward)
        missing = [b for b in decoder.buckets if (b, length) not in self._compiled_shapes]
        if self.compile and missing:
            self._compile_in_background(missing, length)
        return decoder

    def _switch_to_compiled(self) -> None:
        """At a step boundary: buckets whose compiled forward is ready decode with it from now on."""
        with self._wake:
            ready, self._newly_compiled = self._newly_compiled, []
        for bucket, length in ready:
            if self._decoder is not None and self._decoder.length == length:
                self._decoder.use_forward(bucket, self._compiled_forward)
                log.info("decoding %d-row steps with the compiled forward from now on", bucket)

    def _compile_in_background(self, buckets: list[int], length: int) -> None:
        """Compile a decoder's shapes in a background thread (from saved artifacts when they match);
        decoding goes on with CUDA graphs of the plain forward, and switches at a step boundary."""
        if self._compiled_forward is None:
            set_torch_cache_dirs(self.settings)
            # Inductor's kernel-compiling processes made prefills 12x slower, compiling no faster (bench/contention.py).
            options = {} if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") else {"options": {"compile_threads": 1}}
            self._compiled_forward = with_compiled_layers(model_view(self.model), **options)
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-compile")
        future = self._compiler.submit(self._compile_shapes, buckets, length)
        future.add_done_callback(
            lambda f: (
                f.exception()
                and log.error("background compilation failed; decoding stays uncompiled", exc_info=f.exception())
            )
        )

    def _compile_shapes(self, buckets: list[int], length: int) -> None:
        self._answered.wait(COMPILE_AFTER_FIRST_ANSWER_S)
        rows, interval = self.settings.max_batch_size, self.settings.sync_interval
        key = compile_cache_key(
            self.model_id,
            config=self.model.config,
            dtype=self.dtype,
            shapes={
                "rows": rows,
                "buckets": buckets,
                "cache_len": length,
                "interval": interval,
                "compiled": "decoder layers",
            },
        )  # older artifacts hold a whole model
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)  # tracing holds the GIL: the engine thread takes it back within 0.5 ms, not 5
        try:
            loaded = load_compile_artifacts(self.settings, key)  # never raises: a bad file is skipped
            done = [
                (bucket, length)
                for bucket in buckets  # a second try: a CUDA graph capture may void the first
                if self._compile_shape(bucket, length) or self._compile_shape(bucket, length)
            ]
            if len(done) == len(buckets) and not loaded:
                save_compile_artifacts(self.settings, key)
        finally:
            sys.setswitchinterval(switch_interval)
        # All shapes switch at once: compiled code run while another shape is traced fails (process-wide state).
        with self._wake:
            self._compiled_shapes.update(done)
            self._newly_compiled.extend(done)
            self._wake.notify()

    def _compile_shape(self, bucket: int, length: int) -> bool:
        """Trace and compile one decode shape on a shadow decoder of the same shapes (own buffers),
        so the engine's own state is never touched from this thread."""
        import torch

        started = time.perf_counter()
        try:
            with torch.inference_mode():
                shadow = SlotDecoder(
                    model_view(self.model),
                    self.eos_ids,
                    rows=self.settings.max_batch_size,
                    length=length,
                    use_graph=False,
                    interval=self.settings.sync_interval,
                )
                params = GenerationParams(max_new_tokens=4, temperature=0.0, top_p=1.0, do_sample=False)
                items = [GenerationRequest("chat", [Turn("user", ["warm up"])], params)] * bucket
                inputs, _ = self.adapter.batch_inputs(self.processor, items, self.model.device, self.dtype)
                shadow.shift(shadow.plan(inputs["input_ids"].shape[1], params.max_new_tokens))
                shadow.prefill(inputs, list(range(bucket)), [params] * bucket)
                shadow.use_forward(bucket, self._compiled_forward)
                for _ in range(2):
                    shadow._advance(bucket)
                torch.cuda.synchronize()
        except Exception:
            log.warning("compiling the %d-row decode step failed; it stays uncompiled", bucket, exc_info=True)
            return False
        log.info("compiled the %d-row decode step in the background in %.1fs", bucket, time.perf_counter() - started)
        return True

    def warm_up(self) -> None:
        """Start compiling the decode step in the background; the engine switches shape by shape."""
        if self.continuous and self.compile:
            self._current_decoder()
            with self._wake:
                self._start_thread()

    def stop_after(self, grace: float) -> None:
        """Items still running `grace` seconds from now fail with `worker_stopping` (on SIGTERM)."""
        with self._wake:
            self._stop_by = time.monotonic() + grace
            self._wake.notify()

    def wait_until_compiled(self, timeout: float) -> bool:
        """Whether every shape of the current decoder decodes compiled (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        while not ((decoder := self._decoder) and decoder.steps_only_with(self._compiled_forward)):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True
