"""The words every layer shares: errors, turns, requests, generations."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Optional

from runpod_vlm.settings import SettingsError

log = logging.getLogger("runpod-vlm")

# Caller text quoted back in an error is cut short, so an error answer stays a few KB whatever the
# request held, and made encodable as UTF-8: the SDK never posts an answer holding a lone surrogate.
MAX_ECHO_CHARS = 64  # one quoted name or value
MAX_PARAM_CHARS = 256  # a whole field path
MAX_MESSAGE_CHARS = 1024


def cut_text(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """At most `limit` characters then '…'; a lone surrogate becomes its escape (\\udc80)."""
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(text: str, limit: int) -> str:
    """A library's multi-line message as one line of at most `limit` characters (then '…')."""
    return cut_text(" ".join(text.split()), limit)


class RequestError(Exception):
    """A request the worker refuses. `param` names the field at fault, `code` is stable for clients."""

    def __init__(self, code: str, message: str, param: Optional[str] = None):
        message = cut_text(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = cut_text(param, MAX_PARAM_CHARS) if param else param

    def to_dict(self) -> dict:
        """The error as a job's output. On RunPod's queue a job's `error` is a string (the SDK keeps only that of
        a yielded error), so it is JSON in the shape the SDK writes for a handler's exception, with the field."""
        text = f"{self.param}: {self.message}" if self.param else self.message
        error = json.dumps({"error_type": self.code, "error_message": text, "param": self.param}, ensure_ascii=False)
        return {"error": error, "code": self.code, "param": self.param}


def as_request_error(failure: Exception) -> RequestError:
    """Any failure as the error a caller sees (call in an `except`): the worker's own faults are logged."""
    if isinstance(failure, RequestError):
        return failure
    if isinstance(failure, SettingsError):
        log.error("settings: %s", failure)
        return RequestError("worker_misconfigured", f"worker misconfigured: {failure}")
    log.exception("unexpected failure")
    return RequestError("internal_error", "internal error while answering this request")


def join_param(param: Optional[str], child: str) -> str:
    if not param:
        return child
    return f"{param}{child}" if child.startswith("[") else f"{param}.{child}"


@dataclasses.dataclass
class Turn:
    role: str  # system, user, assistant or tool
    parts: list  # str or PIL.Image.Image, in order
    tool_calls: Optional[list] = None  # an assistant's calls: [{"id", "name", "arguments" (an object)}]
    tool_call_id: Optional[str] = None  # a tool turn's answer to this call


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """A request's function tools (OpenAI's shape, as chat templates take them) and how they may be called."""

    tools: list
    choice: str  # auto, none, required, or the name of the function the answer must call
    parallel: bool = True


@dataclasses.dataclass
class GenerationParams:
    max_new_tokens: int
    temperature: float
    top_p: float
    do_sample: bool
    min_new_tokens: int = 0
    seed: Optional[int] = None  # sampled tokens are a function of it (and the prompt) alone
    logprobs: bool = False  # each answer token's log-probability, and its `top_logprobs` alternatives
    top_logprobs: int = 0
    json_schema: Optional[str] = None  # the answer is JSON of this schema (JSON text), token by token
    schema_param: str = "response_format"  # the field that asked for it (or `tools`), named when it fails


@dataclasses.dataclass
class GenerationRequest:
    task: str
    turns: list[Turn]
    params: GenerationParams
    grounding_target: Optional[str] = None
    annotate: bool = False  # grounding: return the image with its boxes drawn
    param: Optional[str] = None  # where the request sits in the job, e.g. "requests[3]"
    image_max_pixels: list = dataclasses.field(default_factory=list)  # per image, in order: a bound, or None
    image_keys: list = dataclasses.field(default_factory=list)  # per image, in order: its embedding cache key
    choices: int = 1  # answers asked for (OpenAI's n), each its own item once submitted (answers.choice_items)
    tool_use: Optional[ToolUse] = None  # function tools the prompt offers (tools.py)

    @property
    def images(self) -> list:
        return [p for t in self.turns for p in t.parts if not isinstance(p, (str, Video, VideoSpec))]

    @property
    def videos(self) -> list:
        return [p for t in self.turns for p in t.parts if isinstance(p, (Video, VideoSpec))]


@dataclasses.dataclass
class Generation:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    raw_text: Optional[str] = None  # with special tokens, for box parsing
    image_input_size: Optional[tuple[int, int]] = None  # first image as the model saw it (boxes)
    logprobs: Optional[list] = None  # OpenAI's entries {token, logprob, bytes, top_logprobs}, when asked

    @classmethod
    def from_ids(cls, text: str, ids: list[int], eos: set, max_new_tokens: int, **fields) -> Generation:
        """The answer `text` of the generated `ids`; finish_reason and completion_tokens come from them."""
        return cls(text, finish_reason(ids, eos, max_new_tokens), completion_tokens=answered_length(ids, eos), **fields)


@dataclasses.dataclass
class StreamDelta:
    text: str  # new text since the previous delta
    completion_tokens: int  # tokens generated so far
    prompt_tokens: int = 0  # the prompt's, images included
    ids: Optional[list[int]] = None  # the engine's: the answer's ids so far, which answers.stream_generation reads


Outcome = Generation | RequestError  # what the engine gives back for one item


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """An image named by a request and not yet fetched or decoded; `param` is where it was given."""

    spec: Any
    param: str
    max_pixels: Optional[int] = None  # the request's bound on its resized size (OpenAI's detail: low), if any


@dataclasses.dataclass
class VideoSpec:
    """A video named by a request and not yet fetched or decoded; `param` is where it was given."""

    spec: Any
    param: str


@dataclasses.dataclass
class Video:
    """A fetched video whose header was checked: `total` frames at `fps`, `width` x `height`; `param` is where
    the request gave it, `where` the field holding its bytes, `limits` what decoding may meet (video.VideoLimits).
    `frames` (RGB images) at `indices` once the family has decoded the ones its card samples."""

    data: bytes = dataclasses.field(repr=False)
    fps: float
    total: int
    width: int
    height: int
    param: str
    where: str
    limits: Any = dataclasses.field(repr=False)
    frames: Optional[list] = dataclasses.field(default=None, repr=False)
    indices: Optional[list] = None

    @property
    def seconds(self) -> float:
        """Its length as transformers' video readers count it (frames over rate)."""
        return self.total / self.fps


def finish_reason(ids: list[int], eos: set, max_new_tokens: int) -> str:
    return "stop" if any(i in eos for i in ids) else ("length" if len(ids) >= max_new_tokens else "stop")


def answered_length(ids: list[int], eos: set) -> int:
    return next((n for n, token in enumerate(ids) if token in eos), len(ids))


GENERATION_FAILED = RequestError("generation_failed", "the model could not answer this request")
WORKER_STOPPING = RequestError("worker_stopping", "the worker was stopped before this request finished: retry it")
GPU_FAILURE = RequestError("gpu_failure", "the GPU of this worker failed; it is being replaced: retry the request")
