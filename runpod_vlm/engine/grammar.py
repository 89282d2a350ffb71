"""Structured output: a JSON schema -> the tokens each step allows, with llguidance (which vLLM uses too).

Chosen over xgrammar and outlines-core because it installs as one wheel with no dependencies beyond
numpy (xgrammar brings a TVM runtime), computes a row's mask in tens of microseconds, fills many rows'
masks in parallel threads, and reports an unsupported schema feature as a message we can pass on.
Its masks are bit-packed int32 words, 32 tokens a word, which the decoder unpacks with plain tensor ops.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from runpod_vlm.vocabulary import RequestError, join_param

# Compact JSON (no free whitespace between tokens): a random or wayward model cannot pad an answer forever.
JSON_OPTIONS = {"whitespace_flexible": False}


class Grammars:
    """One per engine: the model's tokenizer as llguidance sees it, and compiled schemas (cached)."""

    def __init__(self, tokenizer, vocab_size: int, end_token: int):
        import llguidance
        import llguidance.hf

        self.llguidance = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=end_token)
        self.words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor()

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one Grammars per engine, for the process's life)
    def grammar(self, schema: str) -> str:
        """The grammar of a schema (canonical JSON text), checked against this tokenizer."""
        matcher = self.llguidance.LLMatcher
        grammar = matcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        error = matcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(error)
        return grammar

    def matcher(self, schema: str, param: Optional[str]):
        """A fresh matcher for one answer; an unsupported schema is refused naming its field."""
        try:
            grammar = self.grammar(schema)
        except ValueError as error:
            message = f"this JSON schema is not supported: {str(error).splitlines()[0]}"
            raise RequestError("invalid_request", message, param) from None
        return self.llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)

    def attach(self, tickets: list) -> list:
        """The tickets whose schema compiled, each given a fresh matcher; the others are answered with the error."""
        kept = []
        for ticket in tickets:
            schema = ticket.item.params.json_schema
            if schema is not None and ticket.matcher is None:
                try:
                    ticket.matcher = self.matcher(schema, join_param(ticket.item.param, "response_format"))
                except RequestError as error:
                    ticket.finish(error)
                    continue
            kept.append(ticket)
        return kept

    def masks_for(self, matchers: list) -> Any:
        """Each row's allowed next tokens, every token for a row without a matcher (None)."""
        live = [m for m in matchers if m is not None]
        masks = self.masks(live)
        full = masks.new_full((len(matchers), masks.shape[1]), -1)  # every bit set: all tokens allowed
        full[[n for n, m in enumerate(matchers) if m is not None]] = masks
        return full

    def masks(self, matchers: list) -> Any:
        """The allowed tokens of each matcher's next step, as a CPU int32 tensor [len(matchers), words]."""
        import llguidance.torch

        bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), self.words * 32)
        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, n) for n, m in enumerate(matchers)], bitmask)
        return bitmask
