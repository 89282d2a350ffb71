"""Structured output: a JSON schema -> the tokens each step allows, with llguidance (which vLLM uses too).

Chosen over xgrammar and outlines-core because it installs as one wheel with no dependencies beyond
numpy (xgrammar brings a TVM runtime), computes a row's mask in tens of microseconds, fills many rows'
masks in parallel threads, and reports an unsupported schema feature as a message we can pass on.
Its masks are bit-packed int32 words, 32 tokens a word, which the decoder unpacks with plain tensor ops.

A schema's grammar is built on a thread of its own, never on the engine thread: building one can take seconds
(the lexer over the whole vocabulary), and every row would stop decoding meanwhile. A request whose grammar is
not ready within its deadline is refused; the build goes on, and its outcome, success or failure, is kept for
the next request with the same schema.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from runpod_vlm.lru import BytesLRU
from runpod_vlm.vocabulary import RequestError, one_line

log = logging.getLogger("runpod-vlm")

# Compact JSON (no free whitespace between tokens): a random or wayward model cannot pad an answer forever.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHED_SCHEMA_BYTES = 32 << 20  # schema text whose outcomes are kept (a built grammar takes about ten times that)
ERROR_CHARS = 400  # of llguidance's message, on one line


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A schema's outcome: a matcher at its start (copied for each answer), or why there is none."""

    template: Any
    error: Optional[str]
    size: int
    forced: int = 0  # tokens every answer starts with (its opening brace, a required first key): a lower bound


class Grammars:
    """One per engine: the model's tokenizer as llguidance sees it, and the schemas' outcomes (cached), both made
    on the grammar thread."""

    def __init__(self, tokenizer, vocab_size: int, end_token: int, deadline_s: float):
        self.words = (vocab_size + 31) // 32
        self.deadline_s = deadline_s
        self.outcomes = BytesLRU(CACHED_SCHEMA_BYTES, lambda compiled: compiled.size, "compiled schemas")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-grammar")
        self._executor = None
        self._tokenizer: Future = self._thread.submit(self._llguidance_tokenizer, tokenizer, vocab_size, end_token)

    @staticmethod
    def _llguidance_tokenizer(tokenizer, vocab_size: int, end_token: int):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=end_token)

    def start(self, schema: str, param: Optional[str], limit: Optional[tuple[int, str]] = None) -> Future:
        """A Future of a fresh matcher for one answer, or of the RequestError naming `param`: at once for a schema
        seen before, else when the grammar thread has built it or its deadline has passed, whichever comes first.
        `limit`: the answer's most tokens and the field that sets them; a schema whose answer cannot fit is refused
        naming that field."""
        answer: Future = Future()
        compiled = self.outcomes.get(schema)
        if compiled is not None:
            self._settle(answer, compiled, param, limit)
            return answer
        timer = threading.Timer(self.deadline_s, self._expire, (answer, param))
        timer.daemon = True

        def built(done: Future) -> None:
            timer.cancel()
            try:
                self._settle(answer, done.result(), param, limit)
            except Exception as error:  # the tokenizer could not be read
                log.warning("structured output is unavailable: %s", one_line(str(error), ERROR_CHARS))
                _set(
                    answer, exception=RequestError("unsupported_parameter", "this worker cannot build grammars", param)
                )

        timer.start()
        self._thread.submit(self.compiled, schema).add_done_callback(built)
        return answer

    def compiled(self, schema: str) -> Compiled:
        """A schema's outcome, built now unless cached (call on the grammar thread)."""
        import llguidance

        known = self.outcomes.peek(schema)
        if known is not None:
            return known
        matcher, template, error, forced = llguidance.LLMatcher, None, None, 0
        tokenizer = self._tokenizer.result()
        try:
            grammar = matcher.grammar_from_json_schema(closed(json.loads(schema)), overrides=JSON_OPTIONS)
            problem = matcher.validate_grammar(grammar, tokenizer)
            if problem and not problem.startswith("WARNING"):
                error = problem
            else:
                template = matcher(tokenizer, grammar, log_level=0)
                error = forced_start_error(template)
                forced = len(template.deep_copy().compute_ff_tokens())
        except Exception as refused:  # llguidance's word on a schema it cannot take
            error = str(refused) or type(refused).__name__
        compiled = Compiled(None if error else template, error and one_line(error, ERROR_CHARS), len(schema), forced)
        self.outcomes.put(schema, compiled)
        return compiled

    def _settle(self, answer: Future, compiled: Compiled, param: Optional[str], limit=None) -> None:
        if compiled.error is None and limit is not None and compiled.forced >= limit[0]:
            message = f"this schema's answer takes more than {limit[0]} tokens (its first {compiled.forced} are fixed)"
            _set(answer, exception=RequestError("invalid_request", message, limit[1]))
        elif compiled.error is None:
            _set(answer, result=compiled.template.deep_copy())
        else:
            message = f"this JSON schema is not supported: {compiled.error}"
            _set(answer, exception=RequestError("invalid_request", message, param))

    def _expire(self, answer: Future, param: Optional[str]) -> None:
        message = f"this JSON schema's grammar took over {self.deadline_s:g}s to build (VLM_SCHEMA_TIMEOUT_S)"
        _set(answer, exception=RequestError("schema_too_complex", message, param))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def masks_for(self, matchers: list) -> Any:
        """Each row's allowed next tokens, every token for a row without a matcher (None)."""
        live = [m for m in matchers if m is not None]
        masks = self.masks(live)
        full = masks.new_full((len(matchers), masks.shape[1]), -1)  # every bit set: all tokens allowed
        full[[n for n, m in enumerate(matchers) if m is not None]] = masks
        return full

    def masks(self, matchers: list) -> Any:
        """The allowed tokens of each matcher's next step, as a CPU int32 tensor [len(matchers), words]."""
        import llguidance
        import llguidance.torch

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), self.words * 32)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m, n) for n, m in enumerate(matchers)], bitmask)
        return bitmask


def closed(schema: Any) -> Any:
    """The schema with every object that does not say otherwise taking only the properties it names (as vLLM's
    default grammar backend, xgrammar, reads schemas in its strict mode): an answer never invents keys, and a model
    that would (random weights) cannot write on forever."""
    if isinstance(schema, list):
        return [closed(value) for value in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: closed(value) for key, value in schema.items()}
    if "properties" in schema and not {"additionalProperties", "unevaluatedProperties"} & set(schema):
        schema["additionalProperties"] = False
    return schema


def forced_start_error(template) -> Optional[str]:
    """Why a new matcher fails on the tokens every answer starts with (its opening brace, say), or None: a parser past
    its limits (an object of hundreds of optional properties) fails there, and such a schema is refused up front."""
    probe = template.deep_copy()
    probe.consume_tokens(probe.compute_ff_tokens())
    return probe.get_error() if probe.is_error() else None


def answer_error(matcher, ended: bool) -> Optional[str]:
    """Why an answer does not follow its grammar: the parser failed (past its limits, say), or the answer `ended`
    at its end token before the grammar accepts it. None while it follows."""
    if matcher.is_error():
        return one_line(matcher.get_error(), ERROR_CHARS)
    if ended and not matcher.is_accepting():
        return "the answer ended before its JSON was complete"
    return None


def _set(future: Future, result: Any = None, exception: Optional[BaseException] = None) -> None:
    """The first outcome stays (a build that ends after its deadline, or a deadline after its build)."""
    try:
        future.set_exception(exception) if exception is not None else future.set_result(result)
    except Exception:  # InvalidStateError: already settled
        pass
