"""The plan of each engine step, in plain Python: which queued items a prefill admits into which rows, under the
prefill token budget, the free rows and the free KV blocks; which rows grow, and which is preempted when blocks run
short; how many rows may run after a step ran out of memory; what an out-of-memory placement does next. It owns the
waiting queue, the running rows, the prompt entering in chunks and the KV pool's bookkeeping (the decoder writes its
block tables from that pool). It never touches a tensor and never calls the engine: the engine carries its plan out
on the decoder and tells it what happened (tests/test_scheduler.py drives it with no model at all)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from runpod_vlm.engine.blocks import BlockPool, PoolExhausted, SharedPrefix, prefix_digests
from runpod_vlm.engine.gpu_errors import is_out_of_memory
from runpod_vlm.engine.ticket import Ticket
from runpod_vlm.vocabulary import GENERATION_FAILED, GenerationRequest, RequestError, join_param

log = logging.getLogger("runpod-vlm")

ROW_CAP_S = 30.0  # how long fewer rows are given after a decode step ran out of memory, unless idle before


def admissible(waiting: list[Ticket]) -> list[Ticket]:
    """The queued items that may be admitted now, in arrival order: those whose call's items are all prepared (a
    call's items go in together). One still being prepared (a video decoding) holds up no other call's."""
    unready = {id(t.call) for t in waiting if not t.ready()}
    return [t for t in waiting if id(t.call) not in unready]


def out_of_memory(item: GenerationRequest, prompt_tokens: int, where="the GPU's free memory") -> RequestError:
    return RequestError(
        "out_of_memory",
        f"this request ({prompt_tokens} prompt tokens with its {len(item.images)} images, and max_new_tokens "
        f"{item.params.max_new_tokens}) does not fit in {where}",
        item.param,
    )


class Scheduler:
    """The engine's queue, rows and KV blocks, and the rules that move items between them (the module's doc)."""

    def __init__(
        self,
        token_budget: int,
        media_token_ids: set,
        context_length: Optional[int] = None,
        prefills_alone: bool = False,
        recompute_at: Optional[int] = None,
    ):
        """`token_budget`: prompt tokens one prefill takes at most (VLM_MAX_BATCH_TOKENS); `media_token_ids`: the
        model's image and video placeholders; `context_length`: the most tokens a row holds (None: no bound);
        `prefills_alone`: one prompt a prefill (a family whose batched forward is not each prompt's alone);
        `recompute_at`: a row holding this many tokens is prefilled again, whole, before its next step (LongRoPE's
        original context, where generate() recomputes its cache with the long factors; long_rope.py)."""
        self.token_budget, self.media_token_ids, self.context_length = token_budget, media_token_ids, context_length
        self.prefills_alone, self.recompute_at = prefills_alone, recompute_at
        self.pool: Optional[BlockPool] = None  # given with the decoder (its size follows GPU memory)
        self.waiting: list[Ticket] = []  # submitted, not yet given a row, in arrival order
        self.running: dict[int, Ticket] = {}  # decoder row -> the item decoding there
        self.chunking: Optional[tuple[Ticket, Any]] = None  # a long prompt entering chunk by chunk, and its state
        self.row_cap: Optional[tuple[int, float]] = None  # rows given at most, and since when, after a decode OOM
        self.admitted = 0  # admissions so far: a row's number orders preemption (the newest goes first)

    # ---- the queue --------------------------------------------------------------------------------

    def add(self, tickets: list[Ticket]) -> None:
        self.waiting.extend(tickets)

    def drop_cancelled(self) -> list[Ticket]:
        """Forget queued items given up on; the queue as it stands, for this step."""
        self.waiting = [t for t in self.waiting if not t.cancelled]
        return list(self.waiting)

    def take(self, tickets: list[Ticket]) -> None:
        self.waiting = [t for t in self.waiting if t not in tickets]

    def requeue(self, tickets: list[Ticket], limit: Optional[int] = None) -> None:
        """Back to the front of the queue; `limit`: admitted in groups of at most that many."""
        for ticket in reversed(tickets):
            if limit:
                ticket.group_limit = min(limit, ticket.group_limit or limit)
            self.waiting.insert(0, ticket)

    def busy(self) -> bool:
        return bool(self.running or self.chunking)

    def has_admissible(self) -> bool:
        return bool(admissible(self.waiting))

    # ---- admission --------------------------------------------------------------------------------

    def free_rows(self, free: list[int]) -> list[int]:
        """Of the decoder's `free` rows (lowest first), those a new item may take: not the chunking prompt's, and
        under the row cap while one holds (lifted when the engine is idle or after ROW_CAP_S)."""
        if self.chunking is not None:
            free = [row for row in free if row != self.chunking[1].row]
        if self.row_cap is not None:
            cap, since = self.row_cap
            if not self.running and not self.chunking or time.monotonic() - since > ROW_CAP_S:
                self.row_cap = None
            else:
                free = [row for row in free if row < cap]
        return free

    def next_group(self, waiting: list[Ticket], free: list[int], packs: Optional[bool]) -> tuple[list, list]:
        """The prepared items at the head of `waiting` that one prefill takes: within the token budget (`packs`:
        prompts go in packed, else padded to the longest), the `free` rows and each item's group limit, in arrival
        order (a long request is never passed over); a preempted item resumes alone. Returns them with their
        prepared (inputs, input size, held cache entries); an item whose preparation failed is answered here.
        `packs` is false until the first prefill tells (a padded count is the safe one). Packed, a prompt counts
        without the blocks it shares (`shared_prefixes`, where its digests are known): a burst sharing a system
        prompt fits more prompts in one prefill."""
        group, prepared, computed = [], [], []
        holders: dict[bytes, int] = {}
        for ticket in admissible(waiting)[: len(free)]:
            if len(group) == (ticket.group_limit or len(free)):
                break
            try:
                inputs, size, held = ticket.prepared.result()
            except Exception as error:
                self.take([ticket])
                if isinstance(error, RequestError):  # the family's adapter refused it
                    ticket.finish(error)
                elif is_out_of_memory(error):  # its images processed on the GPU
                    ticket.finish(out_of_memory(ticket.item, 0))
                else:
                    log.error("could not prepare an item", exc_info=error)
                    ticket.fail(GENERATION_FAILED)
                continue
            length = inputs["input_ids"].shape[1]
            if self.chunking is not None and (
                length + len(ticket.ids) > self.token_budget or self.resumes_in_chunks(ticket)
            ):
                break  # one prompt enters in chunks at a time: this one waits its turn, ahead of those behind it
            lengths = [length, *(p[0]["input_ids"].shape[1] for p in prepared)]
            new = length
            if packs and ticket.prefix and self.pool is not None:
                new -= self._shared_prefix(ticket, length, holders).count * self.pool.block_size
            tokens = sum(computed) + new if packs else len(lengths) * max(lengths)
            if group and (tokens > self.token_budget or ticket.ids or group[0].ids or self.prefills_alone):
                break  # a prefill within the token budget; a preempted item resumes alone
            for digest in ticket.prefix:
                holders.setdefault(digest, len(group))
            group.append(ticket)
            prepared.append((inputs, size, held))
            computed.append(new)
        self.take(group)
        return group, prepared

    def context_error(self, item: GenerationRequest, prompt_tokens: int) -> Optional[RequestError]:
        if self.context_length and prompt_tokens + item.params.max_new_tokens > self.context_length:
            return RequestError(
                "context_too_long",
                f"the prompt ({prompt_tokens} tokens, images included) plus "
                f"max_new_tokens ({item.params.max_new_tokens}) exceed the model's context of "
                f"{self.context_length} tokens",
                join_param(item.param, "max_new_tokens"),
            )
        return None

    def refusal(self, item: GenerationRequest, prompt_tokens: int) -> Optional[RequestError]:
        """Why a request cannot be served at all: past the model's context, or larger than the whole KV pool."""
        context = self.context_error(item, prompt_tokens)
        if context is not None:
            return context
        capacity = self.pool.capacity_tokens
        if prompt_tokens + item.params.max_new_tokens > capacity:
            return out_of_memory(item, prompt_tokens, f"the KV cache, which holds {capacity} tokens")
        return None

    def rows_that_fit(self, lengths: list[int], max_new: list[int], interval: int) -> int:
        """How many of a group's leading items the free blocks hold, each with its prompt and first interval."""
        needed = 0
        for n, (length, new) in enumerate(zip(lengths, max_new)):
            needed += self.pool.blocks_for(length + min(new, interval))
            if needed > self.pool.free:
                return n
        return len(lengths)

    def resumes_in_chunks(self, ticket: Ticket) -> bool:
        """Whether a preempted row had generated an image placeholder token (a random model does): in its prompt
        that token would be taken for an image's, so its prompt enters in chunks and its tokens follow as text."""
        return any(token in self.media_token_ids for token in ticket.ids)

    def prefix_of(self, item: GenerationRequest, ids: list[int]) -> list[bytes]:
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
        return prefix_digests(ids, self.pool.block_size, list(zip(starts, keys)))

    def cached_prefix(self, ticket: Ticket, length: int) -> list[int]:
        """The cached blocks a prompt of `length` tokens may start from: every full block but the one holding its
        last token, which a prefill must compute for the first answer token's logits."""
        return self.pool.cached_prefix(ticket.prefix[: (length - 1) // self.pool.block_size])

    def shared_prefixes(self, group: list[Ticket], lengths: list[int]) -> list[SharedPrefix]:
        """For each prompt of one prefill, the leading full blocks it reads instead of computing: the cached blocks
        of its prefix, or, where longer, those of an earlier prompt of the group that starts the same way (a system
        prompt, a chat's earlier turns, an image of a burst), computed once in this prefill. Never the block
        holding a prompt's last token, whose logits the prefill needs."""
        holders: dict[bytes, int] = {}  # a digest -> the first prompt of the group holding its block
        shared = []
        for n, (ticket, length) in enumerate(zip(group, lengths)):
            shared.append(self._shared_prefix(ticket, length, holders))
            for digest in ticket.prefix:
                holders.setdefault(digest, n)
        return shared

    def _shared_prefix(self, ticket: Ticket, length: int, holders: dict) -> SharedPrefix:
        """`shared_prefixes`' choice for one prompt of `length` tokens after those whose digests `holders` has."""
        usable = ticket.prefix[: (length - 1) // self.pool.block_size]
        cached = self.pool.cached_prefix(usable)
        common = 0
        while common < len(usable) and usable[common] in holders:  # a hash chain: all before it match too
            common += 1
        if common > len(cached):
            return SharedPrefix(common, earlier=holders[usable[common - 1]])
        return SharedPrefix(len(cached), cached)

    def give_row(self, ticket: Ticket, row: int) -> None:
        ticket.row, ticket.group_limit = row, None
        self.admitted += 1
        ticket.admitted = self.admitted
        self.running[row] = ticket

    def out_of_memory(self, group: list[Ticket], prompt_tokens: int = 0) -> None:
        """A group's placement ran out of memory: it comes back in halves, down to each item alone, and an item
        that does not fit alone is answered `out_of_memory`. The one rule for every placement that runs out."""
        if len(group) > 1:
            log.warning("placing %d items ran out of GPU memory; retrying in halves", len(group))
            return self.requeue(group, limit=len(group) // 2)
        group[0].finish(out_of_memory(group[0].item, prompt_tokens or group[0].prompt_tokens))

    # ---- decoding ---------------------------------------------------------------------------------

    def make_room(self, steps: int, ahead: dict, lengths: dict, grow: Callable, release: Callable) -> None:
        """Blocks for every row's next `steps` tokens (after the `ahead` ones per row in flight; `lengths`: tokens in
        each row's blocks), through `grow(row, tokens)`; while too few are free, the newest row is preempted."""
        for row in sorted(self.running, key=lambda r: self.running[r].admitted):
            while row in self.running:
                ticket = self.running[row]
                left = ticket.item.params.max_new_tokens - len(ticket.ids) - ahead.get(row, 0)
                try:
                    grow(row, lengths[row] + min(steps, left))  # past its last token it writes on, into block 0
                    break
                except PoolExhausted:
                    self.preempt(max(self.running, key=lambda r: self.running[r].admitted), release)

    def preempt(self, row: int, release: Callable, why: str = "KV cache full") -> None:
        """Free a row and its blocks; its item goes back to the queue's front and is prefilled again later with
        the tokens it had (recompute: a prefill costs less than copying blocks to the host and back)."""
        ticket = self.running.pop(row)
        release(row)
        ticket.row = None
        log.info("%s: request preempted after %d tokens (it resumes later)", why, len(ticket.ids))
        self.requeue([ticket])

    def at_recompute(self, lengths: dict) -> list[int]:
        """The running rows that hold `recompute_at` tokens (`lengths`: tokens in each row's blocks, steps in flight
        included): each is prefilled again before its next step, once its tokens so far are handed out."""
        return [row for row in self.running if lengths[row] == self.recompute_at] if self.recompute_at else []

    def recompute(self, rows: list[int], release: Callable) -> None:
        """`rows` (`at_recompute`'s) back to the queue's front, to be prefilled again with the tokens they have."""
        for row in rows:
            ticket = self.running.get(row)
            if ticket is None:  # ended meanwhile
                continue
            if self.media_token_ids & set(ticket.ids):
                # A prefill would take it for an image's (generate() fails at the step after such a token).
                log.warning(
                    "a row passes LongRoPE's original context with its keys as they are: it generated a placeholder"
                )
                continue
            self.preempt(row, release, why="LongRoPE's original context reached")

    def steps_before_recompute(self, steps: int, lengths: dict) -> int:
        """At most `steps`, so that no row passes `recompute_at` tokens within them."""
        if self.recompute_at is None:
            return steps
        short = [self.recompute_at - lengths[row] for row in self.running if lengths[row] < self.recompute_at]
        return min([steps, *short])

    def step_out_of_memory(self, buckets: list[int], bucket: int, release: Callable) -> None:
        """A decode step of `bucket` rows ran out of memory: a step's memory follows its bucket of rows, so the rows
        past the next smaller bucket are preempted, and no more than that are admitted until the engine is idle
        again, or for ROW_CAP_S under unbroken load. At the smallest bucket the rows in flight get `out_of_memory`."""
        smaller = max((b for b in buckets if b < bucket), default=None)
        if smaller is None:
            log.warning("a decode step of the fewest rows (%d) ran out of GPU memory: its items fail", bucket)
            for row, ticket in list(self.running.items()):
                del self.running[row]
                release(row)
                ticket.finish(out_of_memory(ticket.item, ticket.prompt_tokens))
            return
        log.warning("a %d-row decode step ran out of GPU memory: at most %d rows until idle", bucket, smaller)
        for row in sorted(self.running, reverse=True):
            if row >= smaller:
                self.preempt(row, release)
        self.row_cap = smaller, time.monotonic()

    def finished(self, row: int) -> Ticket:
        return self.running.pop(row)

    def fail_all(self, error: RequestError, queued: bool, release: Callable) -> None:
        """Fail the items in flight (and the queued ones too when `queued`), their rows released."""
        waiting, self.waiting = (self.waiting, []) if queued else ([], self.waiting)
        if self.chunking is not None:
            waiting.append(self.chunking[0])
            release(self.chunking[1].row)
            self.chunking = None
        for row, ticket in list(self.running.items()):
            release(row)
            ticket.fail(error)
        self.running.clear()
        for ticket in waiting:
            ticket.fail(error)
