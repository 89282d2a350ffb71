"""A growing answer's token ids -> its text as deltas, decoding only a window of the latest tokens."""

from __future__ import annotations


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
