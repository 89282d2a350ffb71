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
        self.prompt_tokens, self.input_size, self.sent = 0, None, ""

    def cancel(self) -> None:
        """Give up on the item: the engine drops it from the queue or frees its row at the next step."""
        self.cancelled = True

    def emit_delta(self, tokenizer, eos_ids: set) -> None:
        kept = self.ids[: answered_length(self.ids, eos_ids)]
        text = tokenizer.decode(kept, skip_special_tokens=True).strip()
        delta = ""
        # Half of a multi-byte character waits for the rest; a text that changed behind what was
        # sent (tokenizers may merge) sends nothing until the final answer settles it.
        if not text.endswith("\ufffd") and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent) :], text
        self._tell(StreamDelta(delta, len(kept), self.prompt_tokens))

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
