"""One item's way through the engine, and the events it sends its job's listener."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from runpod_vlm.vocabulary import GenerationRequest, RequestError, StreamDelta, answered_length

log = logging.getLogger("runpod-vlm")


class Ticket:
    """One item's way through the engine: queued, then a row of the decoder, then finished."""

    def __init__(self, item: GenerationRequest, listener: Callable[[Any], None], stream: bool):
        self.item, self.listener, self.stream = item, listener, stream
        self.cancelled = self.done = False
        self.group_limit: Optional[int] = None  # set after a failed group: admitted in smaller ones
        self.row: Optional[int] = None
        self.ids: list[int] = []
        self.logprobs: list = []  # (logprob, top ids, top logprobs) per id, when the item asked for them
        self.prompt_tokens, self.input_size = 0, None
        self.text: Optional[TextDeltas] = None  # made at the first streamed tokens

    def cancel(self) -> None:
        """Give up on the item: the engine drops it from the queue or frees its row at the next step."""
        self.cancelled = True

    def emit_delta(self, tokenizer, eos_ids: set) -> None:
        kept = self.ids[: answered_length(self.ids, eos_ids)]
        self.text = self.text or TextDeltas(tokenizer)
        self._tell(StreamDelta(self.text.delta(kept), len(kept), self.prompt_tokens))

    def fail(self, error: RequestError) -> Ticket:
        """Finish with `error`, naming this item's place in its job."""
        self.finish(RequestError(error.code, error.message, self.item.param))
        return self

    def finish(self, result) -> None:
        if not self.done:
            self.done = True
            self._tell(result)

    def _tell(self, event) -> None:
        try:
            self.listener(event)
        except Exception:  # its caller is gone (a closed event loop): the item is dropped, not its neighbours
            log.warning("an item's listener failed; the item is dropped", exc_info=True)
            self.cancelled = True


class TextDeltas:
    """The text of a growing list of token ids, as deltas, decoding only a window of the latest tokens.

    Written by hand for the engine's own token lists (transformers' streamers print or queue text and
    need generate()); the two offsets are those of vLLM's incremental detokenizer: the window starts
    one delta back, so a tokenizer's handling of a sequence's first token (a leading space) cancels
    out. Text may end only where a character ends: when the latest token stops inside one, the delta
    ends at the latest of the last MAX_CHARACTER_TOKENS token boundaries that ends a character (a
    character spans at most 4 UTF-8 bytes, a token holds at least one) and the rest waits."""

    MAX_CHARACTER_TOKENS = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = self.read_offset = 0  # the window starts at the first, and was read up to the second
        self.started = False  # the answer is stripped: its leading spaces are never sent

    def delta(self, ids: list[int]) -> str:
        prefix = self._decode(ids[self.prefix_offset : self.read_offset])
        for cut in range(len(ids), max(self.read_offset, len(ids) - self.MAX_CHARACTER_TOKENS), -1):
            text = self._decode(ids[self.prefix_offset : cut])
            if not text.endswith("\ufffd"):
                break
        else:
            return ""  # no character ends in the new tokens yet (or bytes that are not UTF-8: they go out later)
        if len(text) <= len(prefix):
            return ""
        new = text[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, cut
        if not self.started:
            new = new.lstrip()
            self.started = bool(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
