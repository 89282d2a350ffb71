"""The runner: the scheduler's plan carried out on the paged decoder, on the engine thread. The prepared items at the
queue's head placed into rows (one prefill within the token budget, or a long prompt in chunks), decode intervals
launched with blocks grown first (the newest row preempted when they run out), their tokens handed out while the GPU
runs the next launch, and every way a placement runs out of memory."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple, Optional

from runpod_vlm.engine.decoder import PagedDecoder
from runpod_vlm.engine.gpu_errors import is_fatal_gpu_error, is_out_of_memory
from runpod_vlm.engine.grammar import Grammars
from runpod_vlm.engine.host_copies import Launched
from runpod_vlm.engine.intake import on_device, with_generated
from runpod_vlm.engine.prefill import ChunkedPrefill
from runpod_vlm.engine.scheduler import admissible
from runpod_vlm.engine.ticket import Ticket
from runpod_vlm.vocabulary import GENERATION_FAILED, GPU_FAILURE, RequestError

log = logging.getLogger("runpod-vlm")

PREFIX_LOG_EVERY_S = 60.0


class InFlight(NamedTuple):
    """A prefill or a decode interval launched, not yet handed out, and the item in each of its rows at launch with
    the number of its admission there: an item preempted and admitted again, to the same row too, has a new one."""

    launched: Launched
    items: dict[int, tuple[Ticket, int]]

    @staticmethod
    def of(launched: Launched, rows: dict[int, Ticket]) -> InFlight:
        return InFlight(launched, {row: (ticket, ticket.admitted) for row, ticket in rows.items()})

    def owners(self, rows: dict[int, Ticket]):
        """(row, item) for each of its rows whose item at launch is still there, in the same admission."""
        for row, (ticket, admitted) in self.items.items():
            if rows.get(row) is ticket and ticket.admitted == admitted:
                yield row, ticket


class Runner:
    """The engine thread carrying out the scheduler's plan on one decoder: placing the admitted items' prompts,
    chunks and decode intervals, handing their tokens to `accept`, and telling the scheduler what happened. Made with
    the decoder; it holds no ticket between steps but those of its launches in flight."""

    def __init__(
        self,
        decoder: PagedDecoder,
        scheduler,
        loaded,
        wake,
        timings: collections.Counter,
        *,
        image_cache,
        prefix_caching: bool,
        grammars: Callable[[], Grammars],
        accept: Callable,
        gpu_failed: Callable[[], None],
    ):
        """`loaded` is the model, its processor, adapter and dtype (loading.LoadedModel); `wake` the engine's
        condition, held around each change to the scheduler's queue; `accept(ticket, tokens, logprobs)` takes a row's
        new tokens; `gpu_failed()` is called on a fatal GPU error."""
        self.decoder, self.scheduler, self.wake, self.timings = decoder, scheduler, wake, timings
        self.model, self.processor = loaded.model, loaded.processor
        self.adapter, self.dtype = loaded.adapter, loaded.dtype
        self.image_cache, self.prefix_caching = image_cache, prefix_caching
        self.grammars, self.accept, self.gpu_failed = grammars, accept, gpu_failed
        # Prefills and decode intervals launched, their tokens not yet handed out, in launch order.
        self.launched: collections.deque[InFlight] = collections.deque()
        self._prefix_logged = time.monotonic()  # when the prefix cache's counts were last logged

    def step(self, waiting: list[Ticket]) -> None:
        """One turn of the engine loop: admit what the scheduler lets in, the next chunk of a long prompt, the rows'
        next decode interval; then hand out what was launched before this turn while the GPU runs this turn's."""
        earlier = list(self.launched)
        self._admit(waiting)
        if self.scheduler.chunking is not None:
            self._prefill_next_chunk()
        if self.scheduler.running:
            self._decode_interval()
        self._hand_out_launched(earlier)

    def _admit(self, waiting: list[Ticket]) -> None:
        """Prefill the items the scheduler admits now (`Scheduler.next_group`) and give them rows."""
        decoder = self.decoder
        free = self.scheduler.free_rows(decoder.free_rows())
        if self.prefix_caching and decoder.prompts.packs:
            self._digest_prepared(admissible(waiting)[: len(free)])
        with self.wake:
            group, prepared = self.scheduler.next_group(waiting, free, bool(decoder.prompts.packs))
        if not group:
            return
        try:
            self._place(group, free, prepared)
        except Exception as error:
            fatal = is_fatal_gpu_error(error)
            if fatal:
                self.gpu_failed()
            else:
                log.exception("could not admit %d items", len(group))
            with self.wake:
                lost = [t for t in group if t.row is None and t not in self.scheduler.waiting and not t.done]
            for ticket in lost:
                ticket.fail(GPU_FAILURE if fatal else GENERATION_FAILED)

    def _digest_prepared(self, tickets: list[Ticket]) -> None:
        """The prefix digests of prepared prompts not digested yet, for the scheduler to count a prefill's tokens
        without the blocks its prompts share (`_place` digests each placed prompt again, as it goes in)."""
        for ticket in tickets:
            if ticket.prefix or not ticket.prepared.done() or ticket.prepared.exception() is not None:
                continue
            inputs = ticket.prepared.result()[0]
            ticket.prefix = self.scheduler.prefix_of(ticket.item, inputs["input_ids"][0].tolist())

    def _place(self, group: list[Ticket], free: list[int], prepared: list) -> None:
        import torch

        decoder, scheduler = self.decoder, self.scheduler
        kept = self._with_grammars(group)
        if not kept:
            return
        prepared = [p for t, p in zip(group, prepared) if t in kept]
        group = kept
        input_sizes = [size for _, size, _ in prepared]
        held = {key: entry for _, _, entries in prepared for key, entry in entries.items()}
        try:
            # The pixels go to the GPU item by item and are joined there; the integer tensors stay on the host for
            # the counts below, and the decoder moves them (after positions computed on the host).
            parts = [on_device(part, self.model.device, floating_only=True) for part, _, _ in prepared]
            inputs = parts[0] if len(group) == 1 else self.adapter.collate(self.processor, parts)
            if inputs is None and any(t.item.videos for t in group):
                # Prepared together, SmolVLM2's videos of other lengths changed each other's prompts: one at a time.
                return self._requeue(group, limit=1)
            if inputs is None:  # parts that do not stack: the group prepared together
                inputs, input_sizes = self.adapter.batch_inputs(
                    self.processor, [t.item for t in group], "cpu", self.dtype
                )
                inputs = on_device(inputs, self.model.device, floating_only=True)
        except Exception as error:
            if is_out_of_memory(error):  # the pixels moving to the GPU
                torch.cuda.empty_cache()
                return self._out_of_memory(group)
            if len(group) > 1:
                return self._requeue(group, limit=1)
            return self._admit_failed(group[0])
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        errors = [scheduler.refusal(t.item, n) for t, n in zip(group, prompt_tokens)]
        if any(errors):
            for ticket, error in zip(group, errors):
                if error:
                    ticket.finish(error)
            return self._requeue([t for t, e in zip(group, errors) if not e])
        generated = group[0].ids  # resumed (alone): the tokens it had generated follow its prompt
        placeholder = scheduler.resumes_in_chunks(group[0])
        if generated and not placeholder:
            with_generated(inputs, generated, self.adapter.generated_token_types)
        lengths = [n + len(generated) * placeholder for n in inputs["attention_mask"].sum(dim=1).tolist()]
        room = scheduler.rows_that_fit(lengths, [t.item.params.max_new_tokens for t in group], decoder.interval)
        if room < len(group):  # wait for blocks: what fits first comes again as a smaller group
            return self._requeue(group, limit=room or None)
        long = len(group) == 1 and lengths[0] > scheduler.token_budget  # never while one chunks (next_group)
        if self.prefix_caching:
            for ticket, ids in zip(group, self._prompt_ids(inputs)):
                ticket.prefix = scheduler.prefix_of(ticket.item, ids)
        # A prompt admitted alone starts from the cached blocks of its prefix in chunks (a batched prefill reads them
        # where its family packs prompts: `shared` below).
        alone = len(group) == 1 and scheduler.chunking is None
        hit = scheduler.cached_prefix(group[0], lengths[0]) if alone else []
        if long or hit or placeholder:
            try:
                chunked = self._begin_chunks(decoder, inputs, free[0], group[0], held)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                torch.cuda.empty_cache()
                return self._out_of_memory(group, prompt_tokens[0])
            if placeholder and chunked is not None:
                decoder.prompts.follow_with(chunked, generated)
            elif placeholder:  # a prompt prefilled whole: the placeholder may fail it, alone
                with_generated(inputs, generated, self.adapter.generated_token_types)
            if chunked is not None:
                group[0].prompt_tokens, group[0].input_size = prompt_tokens[0], input_sizes[0]
                if hit:
                    decoder.share(chunked.row, hit)
                    chunked.done = len(hit) * decoder.block_size
                self._count_prefix(chunked.done, lengths[0])
                scheduler.chunking = (group[0], chunked)
                return
        rows = free[: len(group)]
        # Blocks the group's prompts share (cached, or computed once in this prefill) are read, not computed.
        shared = scheduler.shared_prefixes(group, lengths) if self.prefix_caching else None
        started = time.perf_counter()
        try:
            with self._images_cached(group, held):
                launched = decoder.prompts.prefill_launch(
                    inputs,
                    rows,
                    [t.item.params for t in group],
                    self._grammar_masks(group),
                    [len(t.ids) for t in group],
                    shared,
                )
        except Exception as error:
            for row in rows:
                decoder.release(row)
            if is_fatal_gpu_error(error):
                raise
            if is_out_of_memory(error):
                torch.cuda.empty_cache()
                return self._out_of_memory(group, prompt_tokens[0])
            if len(group) > 1:
                log.warning("a prefill of %d items failed; admitting them one by one", len(group), exc_info=True)
                return self._requeue(group, limit=1)
            return self._admit_failed(group[0])
        self.timings["prefill_s"] += time.perf_counter() - started
        self.timings["prefills"] += 1
        for ticket, row, prompt, size, length, computed in zip(
            group, rows, prompt_tokens, input_sizes, lengths, decoder.prompts.prefilled
        ):
            ticket.prompt_tokens, ticket.input_size = prompt, size
            decoder.pool.remember(row, ticket.prefix)
            self._count_prefix(length - computed, length)
            scheduler.give_row(ticket, row)
        # The first tokens are handed out after the next launch (`_hand_out_launched`): the GPU runs this prefill
        # while the host prepares the next one. A grammar's next mask needs its row's first token now.
        self.launched.append(InFlight.of(launched, dict(zip(rows, group))))
        if decoder.any_constrained:
            self.hand_out_all()

    def _images_cached(self, group: list[Ticket], held: dict):
        """Where the family can, the group's images already encoded come from the embedding cache, or from the
        entries `held` since their items were prepared without their pixels (Intake._recalled)."""
        keys = [key for ticket in group for key in ticket.item.image_keys]
        cached = (
            self.adapter.cached_images(self.model, self.image_cache.holding(held), keys)
            if self.image_cache is not None and keys
            else None
        )
        return cached or contextlib.nullcontext()

    def _begin_chunks(
        self, decoder: PagedDecoder, inputs, row: int, ticket: Ticket, held: dict
    ) -> Optional[ChunkedPrefill]:
        """A long prompt's embeddings: the vision pass of all its images at once, else, out of memory, of
        one image at a time where the family can (the KV pool leaves less room than many large images need)."""
        import torch

        begin = functools.partial(decoder.prompts.begin_chunks, inputs, row, ticket.item.params, len(ticket.ids))
        try:
            with self._images_cached([ticket], held):
                return begin()
        except Exception as error:
            one_at_a_time = self.adapter.images_one_at_a_time(self.model)
            if not is_out_of_memory(error) or one_at_a_time is None:
                raise
        torch.cuda.empty_cache()
        log.info("a long prompt's images ran out of memory at once: encoding them one at a time")
        with one_at_a_time, self._images_cached([ticket], held):  # the cache first: images prepared without pixels
            return begin()

    def _prompt_ids(self, inputs) -> list[list[int]]:
        """Each row's prompt ids, without its left padding."""
        masks = inputs["attention_mask"].tolist()
        return [[i for i, kept in zip(ids, mask) if kept] for ids, mask in zip(inputs["input_ids"].tolist(), masks)]

    def _count_prefix(self, cached: int, prompt: int) -> None:
        """Prompt tokens, and those read from cached blocks; logged now and then."""
        self.timings["prompt_tokens"] += prompt
        self.timings["prefix_cached_tokens"] += cached
        now = time.monotonic()
        if self.prefix_caching and now - self._prefix_logged >= PREFIX_LOG_EVERY_S:
            self._prefix_logged = now
            log.info(
                "prefix cache: %d of %d prompt tokens read from cached blocks; %d blocks cached",
                self.timings["prefix_cached_tokens"],
                self.timings["prompt_tokens"],
                self.decoder.pool.cached,
            )

    def _prefill_next_chunk(self) -> None:
        """The next chunk of the prompt entering in pieces (at most the step's token budget)."""
        import torch

        scheduler = self.scheduler
        ticket, chunked = scheduler.chunking
        decoder = self.decoder
        if ticket.cancelled:
            scheduler.chunking = None
            return decoder.release(chunked.row)
        size = scheduler.token_budget
        end = min(chunked.done + size, chunked.length)
        if decoder.pool.shortfall(chunked.row, end + min(ticket.item.params.max_new_tokens, decoder.interval)):
            if scheduler.running:
                return  # blocks come back as rows finish (or are preempted before the next interval)
        started = time.perf_counter()
        try:
            launched = decoder.prompts.prefill_chunk(chunked, size, self._grammar_masks([ticket]))
        except Exception as error:
            scheduler.chunking = None
            decoder.release(chunked.row)
            if is_fatal_gpu_error(error):
                raise
            if is_out_of_memory(error):
                torch.cuda.empty_cache()
                return self._out_of_memory([ticket], ticket.prompt_tokens)
            log.exception("a chunked prefill failed")
            return ticket.fail(GENERATION_FAILED)
        self.timings["chunk_s"] += time.perf_counter() - started
        if launched is not None:  # its first token handed out as a prefill's (`_place`), without waiting here
            scheduler.chunking = None
            decoder.pool.remember(chunked.row, ticket.prefix)
            scheduler.give_row(ticket, chunked.row)
            self.launched.append(InFlight.of(launched, {chunked.row: ticket}))
            if decoder.any_constrained:
                self.hand_out_all()

    def _admit_failed(self, ticket: Ticket) -> None:
        log.exception("could not prepare an item")
        ticket.fail(GENERATION_FAILED)

    def _decode_interval(self) -> None:
        """Launch the rows' next decode interval. Its tokens are handed out after the engine loop's next launch
        (`_hand_out_launched`), while the GPU runs it: the GPU does not wait while the host streams tokens, ends rows
        and admits new ones (as vLLM's async scheduling). So a row that ended in the interval before runs one more,
        its tokens dropped."""
        decoder = self.decoder
        if decoder.any_constrained:  # a grammar's next mask needs the token just chosen
            self.hand_out_all()
        launched = self._launch()
        if launched is not None:
            self.launched.append(launched)
        if decoder.any_constrained:
            self.hand_out_all()

    def _hand_out_launched(self, earlier: list[InFlight]) -> None:
        """At the end of an engine loop turn: hand out what was launched before the turn (`earlier`), while the GPU
        runs what this turn launched; everything when this turn launched nothing."""

        def before(entry: InFlight) -> bool:
            return any(entry is e for e in earlier)  # `in` would compare their tensors

        if self.launched and before(self.launched[-1]):
            return self.hand_out_all()
        while self.launched and before(self.launched[0]):
            self.hand_out(self.launched.popleft())

    def hand_out_all(self) -> None:
        """Hand out the tokens of every prefill and interval in flight."""
        while self.launched:
            self.hand_out(self.launched.popleft())

    def _launch(self) -> Optional[InFlight]:
        """The next interval of the rows that may still take tokens beyond those in flight, with each row's item
        at launch; None when none may."""
        import torch

        decoder, running = self.decoder, self.scheduler.running
        recompute = self.scheduler.at_recompute(decoder.lengths)
        if recompute:  # each goes back with every token it has generated
            self.hand_out_all()
            with self.wake:
                self.scheduler.recompute(recompute, decoder.release)
        ahead: dict[int, int] = {}
        for entry in self.launched:
            for row, _ in entry.owners(running):
                ahead[row] = ahead.get(row, 0) + entry.launched.steps
        remaining = max(
            (t.item.params.max_new_tokens - len(t.ids) - ahead.get(row, 0) for row, t in running.items()), default=0
        )
        if remaining <= 0:
            return None
        # A grammar's next mask depends on the token just chosen: constrained rows step one token at a time.
        steps = 1 if decoder.any_constrained else min(decoder.interval, remaining)
        steps = self.scheduler.steps_before_recompute(steps, decoder.lengths)
        with self.wake:  # a row preempted goes back to the queue
            self.scheduler.make_room(steps, ahead, decoder.lengths, decoder.grow, decoder.release)
        if not running:
            return None
        started, eager, capturing = time.perf_counter(), decoder.eager_steps, decoder.step_graphs.capture_s
        try:
            launched = decoder.launch(steps)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            torch.cuda.empty_cache()
            with self.wake:
                self.scheduler.step_out_of_memory(decoder.buckets, decoder.bucket(), decoder.release)
            return None
        self.timings["decode_s"] += time.perf_counter() - started
        self.timings["decode_steps"] += steps
        self.timings["decode_eager_steps"] += decoder.eager_steps - eager
        self.timings["graph_capture_s"] += decoder.step_graphs.capture_s - capturing
        return InFlight.of(launched, running)

    def hand_out(self, in_flight: InFlight) -> None:
        """A prefill's or an interval's tokens to the items that were in its rows at launch and still are (a row
        ended or preempted since may hold a new item)."""
        decoder = self.decoder
        started = time.perf_counter()
        launched = in_flight.launched
        tokens = decoder.read(launched)
        if launched.rows:  # a prefill's first tokens, in the order of its rows
            tokens = dict(zip(launched.rows, tokens))
        read = time.perf_counter()
        self.timings["prefill_s" if launched.rows else "decode_s"] += read - started
        logprobs = decoder.take_logprobs() or {}
        for row, ticket in in_flight.owners(self.scheduler.running):
            self.accept(ticket, tokens[row], logprobs.get(row))
        self._next_grammar_masks()
        self.timings["accept_s"] += time.perf_counter() - read

    def _requeue(self, tickets: list[Ticket], limit: Optional[int] = None) -> None:
        with self.wake:
            self.scheduler.requeue(tickets, limit)

    def _out_of_memory(self, group: list[Ticket], prompt_tokens: int = 0) -> None:
        with self.wake:
            self.scheduler.out_of_memory(group, prompt_tokens)

    # ---- structured output --------------------------------------------------------------------

    def _with_grammars(self, group: list[Ticket]) -> list[Ticket]:
        """The group's tickets; each with a schema gets its matcher (built by now), one whose schema failed gets
        the error."""
        kept = []
        for ticket in group:
            if ticket.grammar is not None and ticket.matcher is None:
                try:
                    ticket.matcher = ticket.grammar.result(timeout=0)
                except RequestError as error:
                    ticket.finish(error)
                    continue
            kept.append(ticket)
        return kept

    def _grammar_masks(self, tickets: list[Ticket]):
        """Each ticket's allowed next tokens, or None when none has a schema."""
        matchers = [t.matcher for t in tickets]
        return self.grammars().masks_for(matchers) if any(matchers) else None

    def _next_grammar_masks(self) -> None:
        constrained = [(row, t) for row, t in self.scheduler.running.items() if t.matcher is not None]
        if constrained:
            rows, tickets = zip(*constrained)
            self.decoder.set_allowed(list(rows), self._grammar_masks(list(tickets)))
