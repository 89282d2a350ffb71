"""Admission: the prepared items at the queue's head placed into the paged decoder (one prefill
within the token budget, or a long prompt in chunks), blocks grown before each decode interval, the
newest row preempted when they run out, and every way a placement runs out of memory."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import NamedTuple, Optional

from runpod_vlm.engine.blocks import PoolExhausted, prefix_digests
from runpod_vlm.engine.decoder import Launched, PagedDecoder
from runpod_vlm.engine.gpu_errors import is_fatal_gpu_error, is_out_of_memory
from runpod_vlm.engine.intake import on_device, with_generated
from runpod_vlm.engine.prefill import ChunkedPrefill
from runpod_vlm.engine.ticket import Ticket
from runpod_vlm.vocabulary import GENERATION_FAILED, GPU_FAILURE, GenerationRequest, RequestError

log = logging.getLogger("runpod-vlm")

PREFIX_LOG_EVERY_S = 60.0
ROW_CAP_S = 30.0  # how long fewer rows are given after a decode step ran out of memory, unless idle before


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


def admissible(waiting: list[Ticket]) -> list[Ticket]:
    """The queued items that may be admitted now, in arrival order: those whose call's items are all prepared (a
    call's items go in together). One still being prepared (a video decoding) holds up no other call's."""
    unready = {id(t.call) for t in waiting if not t.ready()}
    return [t for t in waiting if id(t.call) not in unready]


class Admission:
    """Part of Engine (its base): what the engine thread does to start items and to keep their rows in blocks."""

    def _admit(self, waiting: list[Ticket]) -> None:
        """Prefill the prepared items at the queue's head that fit the step's token budget, the free rows and
        the free KV blocks (in arrival order: a long request is never passed over), and give them rows."""
        decoder = self._current_decoder()
        free = decoder.free_rows()
        if self._chunking is not None:  # the row of the prompt entering in chunks is not free
            free = [row for row in free if row != self._chunking[1].row]
        if self._row_cap is not None:  # after a decode step ran out of memory; rows are given lowest first
            cap, since = self._row_cap
            idle = not (self._rows or self._launched or self._chunking)
            if idle or time.monotonic() - since > ROW_CAP_S:  # a step that runs out again caps them again
                self._row_cap = None
            else:
                free = [row for row in free if row < cap]
        group, prepared = [], []
        for ticket in admissible(waiting)[: len(free)]:
            if len(group) == (ticket.group_limit or len(free)):
                break
            try:
                inputs, size, held = ticket.prepared.result()
            except Exception as error:
                self._take([ticket])
                if isinstance(error, RequestError):  # the family's adapter refused it
                    ticket.finish(error)
                elif is_out_of_memory(error):  # its images processed on the GPU
                    ticket.finish(self._out_of_memory(ticket.item, 0))
                else:
                    log.error("could not prepare an item", exc_info=error)
                    ticket.fail(GENERATION_FAILED)
                continue
            if self._chunking is not None and (
                inputs["input_ids"].shape[1] + len(ticket.ids) > self.settings.max_batch_tokens
                or self._resumes_in_chunks(ticket)
            ):
                break  # one prompt enters in chunks at a time: this one waits its turn, ahead of those behind it
            lengths = [inputs["input_ids"].shape[1], *(p[0]["input_ids"].shape[1] for p in prepared)]
            tokens = sum(lengths) if decoder.packs else len(lengths) * max(lengths)  # packed, else padded
            if group and (tokens > self.settings.max_batch_tokens or ticket.ids or group[0].ids):
                break  # a prefill within the token budget; a preempted item resumes alone
            group.append(ticket)
            prepared.append((inputs, size, held))
        if not group:
            return
        self._take(group)
        try:
            self._place(group, free, prepared)
        except Exception as error:
            fatal = is_fatal_gpu_error(error)
            if fatal:
                self._gpu_failed()
            else:
                log.exception("could not admit %d items", len(group))
            with self._wake:
                lost = [t for t in group if t.row is None and t not in self._queue and not t.done]
            for ticket in lost:
                ticket.fail(GPU_FAILURE if fatal else GENERATION_FAILED)

    def _place(self, group: list[Ticket], free: list[int], prepared: list) -> None:
        import torch

        decoder = self._current_decoder()
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
            if is_out_of_memory(error):  # the pixels moving to the GPU: halves, then the item alone fails
                torch.cuda.empty_cache()
                if len(group) > 1:
                    return self._requeue(group, limit=len(group) // 2)
                return group[0].finish(self._out_of_memory(group[0].item, group[0].prompt_tokens))
            if len(group) > 1:
                return self._requeue(group, limit=1)
            return self._admit_failed(group[0])
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        errors = [self._context_error(t.item, n) or self._pool_error(t.item, n) for t, n in zip(group, prompt_tokens)]
        if any(errors):
            for ticket, error in zip(group, errors):
                if error:
                    ticket.finish(error)
            self._requeue([t for t, e in zip(group, errors) if not e])
            return
        window = self.max_slots
        if window is not None and any(n + t.item.params.max_new_tokens > window for t, n in zip(group, prompt_tokens)):
            # past a sliding window: generate() handles it alone
            return self._requeue(group, limit=1) if len(group) > 1 else self._run_alone(group[0])
        generated = group[0].ids  # resumed (alone): the tokens it had generated follow its prompt
        placeholder = self._resumes_in_chunks(group[0])
        if generated and not placeholder:
            with_generated(inputs, generated, self.adapter.generated_token_types)
        lengths = [n + len(generated) * placeholder for n in inputs["attention_mask"].sum(dim=1).tolist()]
        room = self._rows_that_fit(decoder, lengths, [t.item.params.max_new_tokens for t in group])
        if room < len(group):  # wait for blocks: what fits first comes again as a smaller group
            return self._requeue(group, limit=room or None)
        long = len(group) == 1 and lengths[0] > self.settings.max_batch_tokens  # never while one chunks (_admit)
        if self.prefix_caching:
            for ticket, ids in zip(group, self._prompt_ids(inputs)):
                ticket.prefix = self._prefix_digests(ticket.item, ids)
        # A prompt admitted alone starts from the cached blocks of its prefix (a batched prefill computes all).
        alone = len(group) == 1 and self._chunking is None
        hit = decoder.pool.cached_prefix(group[0].prefix[: (lengths[0] - 1) // decoder.block_size]) if alone else []
        if long or hit or placeholder:
            try:
                chunked = self._begin_chunks(decoder, inputs, free[0], group[0], held)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                torch.cuda.empty_cache()
                return group[0].finish(self._out_of_memory(group[0].item, prompt_tokens[0]))
            if placeholder and chunked is not None:
                decoder.follow_with(chunked, generated)
            elif placeholder:  # a prompt prefilled whole: the placeholder may fail it, alone
                with_generated(inputs, generated, self.adapter.generated_token_types)
            if chunked is not None:
                group[0].prompt_tokens, group[0].input_size = prompt_tokens[0], input_sizes[0]
                if hit:
                    decoder.share(chunked.row, hit)
                    chunked.done = len(hit) * decoder.block_size
                self._count_prefix(chunked.done, lengths[0])
                self._chunking = (group[0], chunked)
                return
        rows = free[: len(group)]
        started = time.perf_counter()
        try:
            with self._images_cached(group, held):
                launched = decoder.prefill_launch(
                    inputs,
                    rows,
                    [t.item.params for t in group],
                    self._grammar_masks(group),
                    [len(t.ids) for t in group],
                )
        except Exception as error:
            for row in rows:
                decoder.release(row)
            if is_fatal_gpu_error(error):
                raise
            if is_out_of_memory(error):
                torch.cuda.empty_cache()
                if len(group) > 1:  # halves, down to single items
                    log.warning("a prefill of %d items ran out of GPU memory; retrying in halves", len(group))
                    return self._requeue(group, limit=len(group) // 2)
                return group[0].finish(self._out_of_memory(group[0].item, prompt_tokens[0]))
            if len(group) > 1:
                log.warning("a prefill of %d items failed; admitting them one by one", len(group), exc_info=True)
                return self._requeue(group, limit=1)
            return self._admit_failed(group[0])
        self.timings["prefill_s"] += time.perf_counter() - started
        self.timings["prefills"] += 1
        for ticket, row, prompt, size, length in zip(group, rows, prompt_tokens, input_sizes, lengths):
            ticket.prompt_tokens, ticket.input_size = prompt, size
            decoder.pool.remember(row, ticket.prefix)
            self._count_prefix(0, length)
            self._give_row(ticket, row)
        # The first tokens are handed out after the next launch (`_hand_out_launched`): the GPU runs this prefill
        # while the host prepares the next one. A grammar's next mask needs its row's first token now.
        self._launched.append(InFlight.of(launched, dict(zip(rows, group))))
        if decoder.any_constrained:
            self._hand_out_all()

    def _resumes_in_chunks(self, ticket: Ticket) -> bool:
        """Whether a preempted row had generated an image placeholder token (a random model does): in its prompt
        that token would be taken for an image's, so its prompt enters in chunks and its tokens follow as text."""
        return any(token in self.media_token_ids for token in ticket.ids)

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

        begin = functools.partial(decoder.begin_chunks, inputs, row, ticket.item.params, len(ticket.ids))
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

    def _prefix_digests(self, item: GenerationRequest, ids: list[int]) -> list[bytes]:
        """The digests of a prompt's full blocks, each image's key in the block of its first token; none where a
        part has no key (a video). The k-th run of image tokens is the k-th image; where the runs do not tell
        the images apart (two with no token between), every key goes where the first run starts."""
        keys = item.image_keys
        if item.videos or len(keys) != len(item.images):
            return []
        media = self.media_token_ids
        starts = [n for n, i in enumerate(ids) if i in media and (n == 0 or ids[n - 1] not in media)]
        if len(starts) != len(keys):
            starts = [starts[0] if starts else 0] * len(keys)
        return prefix_digests(ids, self._current_decoder().block_size, list(zip(starts, keys)))

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
                self._current_decoder().pool.cached,
            )

    def _give_row(self, ticket: Ticket, row: int) -> None:
        ticket.row, ticket.group_limit = row, None
        self._admitted += 1
        ticket.admitted = self._admitted
        self._rows[row] = ticket

    def _rows_that_fit(self, decoder: PagedDecoder, lengths: list[int], max_new: list[int]) -> int:
        """How many of a group's leading items the free blocks hold, each with its prompt and first interval."""
        needed = 0
        for n, (length, new) in enumerate(zip(lengths, max_new)):
            needed += decoder.pool.blocks_for(length + min(new, decoder.interval))
            if needed > decoder.pool.free:
                return n
        return len(lengths)

    def _pool_error(self, item: GenerationRequest, prompt_tokens: int) -> Optional[RequestError]:
        """A request the whole KV pool could not hold, even alone."""
        capacity = self._current_decoder().pool.capacity_tokens
        if prompt_tokens + item.params.max_new_tokens > capacity:
            return self._out_of_memory(item, prompt_tokens, f"the KV cache, which holds {capacity} tokens")

    def _out_of_memory(
        self, item: GenerationRequest, prompt_tokens: int, where="the GPU's free memory"
    ) -> RequestError:
        return RequestError(
            "out_of_memory",
            f"this request ({prompt_tokens} prompt tokens with its {len(item.images)} images, and max_new_tokens "
            f"{item.params.max_new_tokens}) does not fit in {where}",
            item.param,
        )

    def _prefill_next_chunk(self) -> None:
        """The next chunk of the prompt entering in pieces (at most the step's token budget)."""
        import torch

        ticket, chunked = self._chunking
        decoder = self._current_decoder()
        if ticket.cancelled:
            self._chunking = None
            return decoder.release(chunked.row)
        size = self.settings.max_batch_tokens
        end = min(chunked.done + size, chunked.length)
        if decoder.pool.shortfall(chunked.row, end + min(ticket.item.params.max_new_tokens, decoder.interval)):
            if self._rows:
                return  # blocks come back as rows finish (or are preempted before the next interval)
        started = time.perf_counter()
        try:
            launched = decoder.prefill_chunk(chunked, size, self._grammar_masks([ticket]))
        except Exception as error:
            self._chunking = None
            decoder.release(chunked.row)
            if is_fatal_gpu_error(error):
                raise
            if is_out_of_memory(error):
                torch.cuda.empty_cache()
                return ticket.finish(self._out_of_memory(ticket.item, ticket.prompt_tokens))
            log.exception("a chunked prefill failed")
            return ticket.fail(GENERATION_FAILED)
        self.timings["chunk_s"] += time.perf_counter() - started
        if launched is not None:  # its first token handed out as a prefill's (`_place`), without waiting here
            self._chunking = None
            decoder.pool.remember(chunked.row, ticket.prefix)
            self._give_row(ticket, chunked.row)
            self._launched.append(InFlight.of(launched, {chunked.row: ticket}))
            if decoder.any_constrained:
                self._hand_out_all()

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
        """Launch the rows' next decode interval. Its tokens are handed out after the engine loop's next launch
        (`_hand_out_launched`), while the GPU runs it: the GPU does not wait while the host streams tokens, ends rows
        and admits new ones (as vLLM's async scheduling). So a row that ended in the interval before runs one more,
        its tokens dropped."""
        decoder = self._current_decoder()
        if decoder.any_constrained:  # a grammar's next mask needs the token just chosen
            self._hand_out_all()
        launched = self._launch(decoder)
        if launched is not None:
            self._launched.append(launched)
        if decoder.any_constrained:
            self._hand_out_all()

    def _hand_out_launched(self, earlier: list[InFlight]) -> None:
        """At the end of an engine loop turn: hand out what was launched before the turn (`earlier`), while the GPU
        runs what this turn launched; everything when this turn launched nothing."""

        def before(entry: InFlight) -> bool:
            return any(entry is e for e in earlier)  # `in` would compare their tensors

        if self._launched and before(self._launched[-1]):
            return self._hand_out_all()
        while self._launched and before(self._launched[0]):
            self._hand_out(self._current_decoder(), self._launched.popleft())

    def _hand_out_all(self) -> None:
        """Hand out the tokens of every prefill and interval in flight."""
        while self._launched:
            self._hand_out(self._current_decoder(), self._launched.popleft())

    def _launch(self, decoder: PagedDecoder) -> Optional[InFlight]:
        """The next interval of the rows that may still take tokens beyond those in flight, with each row's item
        at launch; None when none may."""
        ahead: dict[int, int] = {}
        for entry in self._launched:
            for row, _ in entry.owners(self._rows):
                ahead[row] = ahead.get(row, 0) + entry.launched.steps
        remaining = max(
            (t.item.params.max_new_tokens - len(t.ids) - ahead.get(row, 0) for row, t in self._rows.items()), default=0
        )
        if remaining <= 0:
            return None
        # A grammar's next mask depends on the token just chosen: constrained rows step one token at a time.
        steps = 1 if decoder.any_constrained else min(decoder.interval, remaining)
        self._make_room(decoder, steps, ahead)
        if not self._rows:
            return None
        started, eager, capturing = time.perf_counter(), decoder.eager_steps, decoder.capture_s
        try:
            launched = decoder.launch(steps)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            self._step_out_of_memory(decoder)
            return None
        self.timings["decode_s"] += time.perf_counter() - started
        self.timings["decode_steps"] += steps
        self.timings["decode_eager_steps"] += decoder.eager_steps - eager
        self.timings["graph_capture_s"] += decoder.capture_s - capturing
        return InFlight.of(launched, self._rows)

    def _hand_out(self, decoder: PagedDecoder, in_flight: InFlight) -> None:
        """A prefill's or an interval's tokens to the items that were in its rows at launch and still are (a row
        ended or preempted since may hold a new item)."""
        started = time.perf_counter()
        launched = in_flight.launched
        tokens = decoder.read(launched)
        if launched.rows:  # a prefill's first tokens, in the order of its rows
            tokens = dict(zip(launched.rows, tokens))
        read = time.perf_counter()
        self.timings["prefill_s" if launched.rows else "decode_s"] += read - started
        logprobs = decoder.take_logprobs() or {}
        for row, ticket in in_flight.owners(self._rows):
            self._accept(ticket, tokens[row], logprobs.get(row))
        self._next_grammar_masks()
        self.timings["accept_s"] += time.perf_counter() - read

    def _make_room(self, decoder: PagedDecoder, steps: int, ahead: dict) -> None:
        """Blocks for every row's next `steps` tokens (after the `ahead` ones per row in flight); while too few are
        free, the newest row is preempted: its blocks freed, it goes back to the queue's front and is later
        prefilled again with the tokens it had (recompute: a prefill costs less than copying blocks to the host and
        back)."""
        for row in sorted(self._rows, key=lambda r: self._rows[r].admitted):
            while row in self._rows:
                ticket, length = self._rows[row], decoder.lengths[row]
                left = ticket.item.params.max_new_tokens - len(ticket.ids) - ahead.get(row, 0)
                try:
                    decoder.grow(row, length + min(steps, left))  # past its last token it writes on, into block 0
                    break
                except PoolExhausted:
                    self._preempt(max(self._rows, key=lambda r: self._rows[r].admitted))

    def _step_out_of_memory(self, decoder: PagedDecoder) -> None:
        """A decode step ran out of memory (the rows' state put back): a step's memory follows its bucket of rows, so
        the rows past the next smaller bucket are preempted, and no more than that are admitted until the engine is
        idle again, or for ROW_CAP_S under unbroken load. At the smallest bucket the rows in flight get
        `out_of_memory`."""
        import torch

        torch.cuda.empty_cache()
        bucket = decoder.bucket()
        smaller = max((b for b in decoder.buckets if b < bucket), default=None)
        if smaller is None:
            log.warning("a decode step of the fewest rows (%d) ran out of GPU memory: its items fail", bucket)
            for row, ticket in list(self._rows.items()):
                del self._rows[row]
                decoder.release(row)
                ticket.finish(self._out_of_memory(ticket.item, ticket.prompt_tokens))
            return
        log.warning("a %d-row decode step ran out of GPU memory: at most %d rows until idle", bucket, smaller)
        for row in sorted(self._rows, reverse=True):
            if row >= smaller:
                self._preempt(row)
        self._row_cap = smaller, time.monotonic()

    def _preempt(self, row: int) -> None:
        ticket = self._rows.pop(row)
        self._current_decoder().release(row)
        ticket.row = None
        log.info("KV cache full: request preempted after %d tokens (it resumes later)", len(ticket.ids))
        self._requeue([ticket])
