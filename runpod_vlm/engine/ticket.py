"""One item's way through the engine, and the events it sends its job's listener."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from runpod_vlm.engine.grammar import answer_error
from runpod_vlm.vocabulary import (
    Generation,
    GenerationRequest,
    RequestError,
    StreamDelta,
    answered_length,
    join_param,
)

log = logging.getLogger("runpod-vlm")


class Ticket:
    """One item's way through the engine: queued, then a row of the decoder, then finished."""

    def __init__(
        self,
        item: GenerationRequest,
        listener: Callable[[Any], None],
        stream: bool,
        on_finished: Optional[Callable[[Ticket, Any], None]] = None,
    ):
        """`on_finished(ticket, result)`: told of every item's end, before its listener (the worker's metrics)."""
        self.item, self.listener, self.stream, self.on_finished = item, listener, stream, on_finished
        self.submitted_at = time.monotonic()
        self.first_token_at: Optional[float] = None  # when its first token was handed out
        self.cancelled = self.done = False
        self.group_limit: Optional[int] = None  # set after a failed group: admitted in smaller ones
        self.row: Optional[int] = None
        self.ids: list[int] = []
        self.logprobs: list = []  # (logprob, top ids, top logprobs) per id, when the item asked for them
        self.grammar = None  # a Future of its matcher, when the item asked for structured output (built off-thread)
        self.matcher = None  # its grammar's state, once placed
        self.prepared = None  # a Future of its inputs on the CPU and input size (continuous batching)
        self.result: Optional[RequestError] = None  # an error to finish with instead of its answer, once it ends
        # What the tickets of its submit call share; not one of them: a ticket naming itself would wait for the
        # cycle collector, its inputs' page-locked pixels too (new ones allocated for every burst meanwhile).
        self.call: Optional[object] = None
        self.prompt_tokens, self.input_size = 0, None
        self.admitted = 0  # its admission's number (the newest row is preempted first)
        self.prefix: list[bytes] = []  # the digests of its prompt's full blocks (prefix caching), once placed

    def ready(self) -> bool:
        """Prepared for admission: its inputs, and its grammar when it has one."""
        return all(future is None or future.done() for future in (self.prepared, self.grammar))

    def cancel(self) -> None:
        """Give up on the item: the engine drops it from the queue or frees its row at the next step."""
        self.cancelled = True

    def take(self, tokens: list[int], logprobs: Optional[list], eos_ids: set) -> bool:
        """New tokens for its row (and their log-probabilities when it asked): kept up to its end token or its
        length, its grammar stepped, streamed; whether it ended (or was cancelled)."""
        item, done = self.item, self.cancelled
        if self.first_token_at is None and tokens:
            self.first_token_at = time.monotonic()
        for n, token in enumerate(tokens):
            if done:
                break
            self.ids.append(token)
            if self.matcher is not None:
                self.matcher.consume_token(token)
            if item.params.logprobs and logprobs is not None:
                self.logprobs.append(logprobs[n])
            done = token in eos_ids or len(self.ids) >= item.params.max_new_tokens
            broken = self.matcher is not None and answer_error(self.matcher, token in eos_ids)
            if broken:  # `stop` on a constrained answer means its JSON is whole: this one's never will be
                done = True
                self.result = RequestError(
                    "structured_output_failed",
                    f"the answer could not follow this JSON schema: {broken}",
                    join_param(item.param, item.params.schema_param),
                )
        if self.stream and not self.cancelled:
            self.emit_delta(eos_ids)
        return done

    def answer(self, tokenizer, eos_ids: set) -> Generation:
        """Its answer from the tokens it took (`generation`)."""
        return generation(tokenizer, eos_ids, self.item, self.ids, self.prompt_tokens, self.input_size, self.logprobs)

    def emit_delta(self, eos_ids: set) -> None:
        """The answer's ids so far; the job's side turns them into text (off the engine thread)."""
        kept = self.ids[: answered_length(self.ids, eos_ids)]
        self._tell(StreamDelta("", len(kept), self.prompt_tokens, ids=kept))

    def fail(self, error: RequestError) -> Ticket:
        """Finish with `error`, naming this item's place in its job."""
        self.finish(RequestError(error.code, error.message, self.item.param))
        return self

    def finish(self, result) -> None:
        if not self.done:
            self.done = True
            if self.on_finished is not None:  # first: a client reading /metrics after its answer finds it counted
                try:
                    self.on_finished(self, result)
                except Exception:
                    log.warning("an item's end could not be recorded", exc_info=True)
            self._tell(result)

    def _tell(self, event) -> None:
        try:
            self.listener(event)
        except Exception:  # its caller is gone (a closed event loop): the item is dropped, not its neighbours
            log.warning("an item's listener failed; the item is dropped", exc_info=True)
            self.cancelled = True


def logprob_entries(tokenizer, ids: list[int], logprobs: list, top: int) -> list[dict]:
    """OpenAI's logprobs entries of the answer's tokens: each token's text, log-probability and bytes, and
    its `top` most likely alternatives' (-9999 stands for an impossible one, as OpenAI writes it)."""
    known = set(ids).union(*(top_ids[:top] for _, top_ids, _ in logprobs))
    order = sorted(known)
    text = dict(zip(order, tokenizer.batch_decode([[i] for i in order])))

    def entry(token: int, logprob: float) -> dict:
        return {"token": text[token], "logprob": max(logprob, -9999.0), "bytes": list(text[token].encode())}

    return [
        {**entry(token, logprob), "top_logprobs": [entry(i, lp) for i, lp in zip(top_ids[:top], top_lps[:top])]}
        for token, (logprob, top_ids, top_lps) in zip(ids, logprobs)
    ]


def generation(
    tokenizer, eos_ids: set, item: GenerationRequest, ids: list[int], prompt_tokens: int, input_size, logprobs=None
) -> Generation:
    """An item's answer from its generated `ids`: its text (and raw text where boxes or calls sit between special
    tokens), why it ended, its counts and, when it asked, its tokens' log-probabilities."""
    ids = ids[: item.params.max_new_tokens]
    kept = ids[: answered_length(ids, eos_ids)]
    entries = logprob_entries(tokenizer, kept, logprobs, item.params.top_logprobs) if item.params.logprobs else None
    raw = item.task == "grounding" or item.tool_use is not None
    return Generation.from_ids(
        tokenizer.decode(kept, skip_special_tokens=True).strip(),
        ids,
        eos_ids,
        item.params.max_new_tokens,
        raw_text=tokenizer.decode(kept, skip_special_tokens=False) if raw else None,
        prompt_tokens=int(prompt_tokens),
        image_input_size=input_size,
        logprobs=entries,
    )
