"""runpod-vlm: a RunPod serverless worker that serves one vision-language model.

The path of a request, in the order of this file's sections:

  handler(job)                       Entry point: an async generator, one asyncio task per job
    read_request -> parse_request    Requests: fields checked, turns built (a worker thread)
      _resolve_images                Images: fetched and decoded under the media policy
    Engine.submit                    Model: queued for the engine thread
      Engine._admit -> _place        ... at a step boundary: FamilyAdapter.batch_inputs (prompt and
                                         pixels as the model card builds them), SlotDecoder.prefill
      Engine._decode_interval        ... SlotDecoder.step for every row at once; _accept hands each
                                         row its tokens and frees it at its end
    stream_generation / generate_all Answers: the engine's events back to the job
    format_output, grounding_fields  ... the output fields, boxes in original pixels
  openai_answers                     OpenAI route: RunPod's /openai/v1 jobs, same path

Importing this module is cheap: torch, transformers and runpod are imported where they are used,
and the model loads at boot under `python handler.py` (or on the first job).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, Optional

import pydantic.dataclasses
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger("runpod-vlm")

# =================================================================================================
# Settings: the deployment, read from VLM_* environment variables
# =================================================================================================

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"


@dataclasses.dataclass(frozen=True)
class CuratedModel:
    family: str
    vram_gb: int  # approximate, bf16 weights plus a working margin
    license: str
    grounding: Optional[str] = None  # the box_format of its grounding answers; None: no boxes


CURATED_MODELS: dict[str, CuratedModel] = {
    "Qwen/Qwen2-VL-2B-Instruct": CuratedModel("qwen2-vl", 8, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen2-VL-7B-Instruct": CuratedModel("qwen2-vl", 20, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen2.5-VL-3B-Instruct": CuratedModel("qwen2.5-vl", 10, "Qwen Research License", "qwen-abs-pixels"),
    "Qwen/Qwen2.5-VL-7B-Instruct": CuratedModel("qwen2.5-vl", 20, "Apache-2.0", "qwen-abs-pixels"),
    "Qwen/Qwen3-VL-2B-Instruct": CuratedModel("qwen3-vl", 8, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen3-VL-4B-Instruct": CuratedModel("qwen3-vl", 12, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen3-VL-8B-Instruct": CuratedModel("qwen3-vl", 22, "Apache-2.0", "qwen-1000"),
    "google/gemma-3-4b-it": CuratedModel("gemma3", 12, "Gemma Terms of Use"),
    "google/gemma-3-12b-it": CuratedModel("gemma3", 30, "Gemma Terms of Use"),
    "google/paligemma2-3b-mix-448": CuratedModel("paligemma", 10, "Gemma Terms of Use", "paligemma-1024"),
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": CuratedModel("smolvlm", 3, "Apache-2.0"),
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": CuratedModel("smolvlm", 8, "Apache-2.0"),
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": CuratedModel("llava-onevision", 4, "Apache-2.0"),
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": CuratedModel("llava-onevision", 20, "Apache-2.0"),
    "OpenGVLab/InternVL3-2B-hf": CuratedModel("internvl-hf", 8, "MIT"),
    "OpenGVLab/InternVL3-8B-hf": CuratedModel("internvl-hf", 22, "MIT"),
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": CuratedModel("mistral3", 60, "Apache-2.0"),
    "zai-org/GLM-4.1V-9B-Thinking": CuratedModel("glm-4.1v", 24, "MIT", "glm-1000"),
    "microsoft/Phi-4-multimodal-instruct": CuratedModel("phi4-multimodal", 14, "MIT"),  # revision refs/pr/70
    "llava-hf/llava-1.5-7b-hf": CuratedModel("llava", 16, "Llama 2 Community License"),
    "llava-hf/llava-1.5-13b-hf": CuratedModel("llava", 30, "Llama 2 Community License"),
    "llava-hf/llava-v1.6-mistral-7b-hf": CuratedModel("llava-next", 18, "Apache-2.0"),
    "openbmb/MiniCPM-V-2_6": CuratedModel("minicpm-v", 20, "MiniCPM Model License"),
    "microsoft/Phi-3-vision-128k-instruct": CuratedModel("phi3-vision", 12, "MIT"),
    "OpenGVLab/InternVL2-8B": CuratedModel("internvl", 20, "MIT"),
}

QUANTIZE_CHOICES = ("none", "4bit", "8bit")
DTYPE_CHOICES = ("auto", "fp16", "bf16", "fp32")

# Settings are pydantic dataclasses: the environment's text is parsed and bounded by their types.


class SettingsError(RuntimeError):
    """A deployment setting is wrong: the operator's mistake, reported at load time."""


def _from_env(cls, env: dict, names: dict[str, str]):
    """`cls` from the variables `names` maps its fields to (blank: the default); errors name the variable."""
    values = {field: env[name].strip() for field, name in names.items() if (env.get(name) or "").strip()}
    try:
        return cls(**values)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        name = names[first["loc"][0]]
        raise SettingsError(f"{name}={env[name]!r}: {first['msg']}") from None


_Lower = pydantic.BeforeValidator(lambda value: value.lower() if isinstance(value, str) else value)
_Seconds = Annotated[float, Field(gt=0, le=600)]


@pydantic.dataclasses.dataclass(frozen=True)
class Settings:
    model: str = DEFAULT_MODEL
    quantize: Annotated[Literal[QUANTIZE_CHOICES], _Lower] = "none"
    dtype: Annotated[Literal[DTYPE_CHOICES], _Lower] = "auto"
    device_map: str = "auto"
    trust_remote_code: bool = True
    allow_any: bool = False
    max_new_tokens_cap: pydantic.PositiveInt = 2048  # VLM_MAX_NEW_TOKENS; every other field is VLM_<NAME>
    default_max_new_tokens: pydantic.PositiveInt = 256
    max_batch_size: pydantic.PositiveInt = 16  # rows decoding together (continuous batching)
    max_concurrency: pydantic.PositiveInt = 32  # jobs this worker takes at once (RunPod concurrency_modifier)
    sync_interval: pydantic.PositiveInt = 8  # decode steps between looks at the tokens (admission, stops, streaming)
    stream_interval_ms: pydantic.NonNegativeInt = 50  # streamed jobs post at most this often
    load_at_boot: bool = True  # load and warm up before taking jobs; off: the first request loads
    shutdown_grace: pydantic.NonNegativeInt = 10  # seconds jobs in flight may still run after SIGTERM
    max_batch_requests: pydantic.PositiveInt = 64  # items in one {"requests": [...]} call
    max_images: pydantic.PositiveInt = 16  # per request
    max_total_pixels: pydantic.PositiveInt = 64_000_000  # decoded pixels per request, all images together
    max_text_chars: pydantic.PositiveInt = 32_000  # all text of a request together
    max_messages: pydantic.PositiveInt = 64
    min_pixels: pydantic.NonNegativeInt = 0  # Qwen processors' visual-token bounds; 0 keeps the model's own
    max_pixels: pydantic.NonNegativeInt = 0
    compile: bool = True  # torch.compile + CUDA graphs for decoding (CUDA only, never bitsandbytes)
    cache_len: Annotated[int, Field(ge=256)] = 2048  # KV-cache length compiled at warm-up; a longer request doubles it
    compile_cache_dir: str = ""  # compiled kernels kept here are reused by a restarted worker

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> Settings:
        env = dict(os.environ if env is None else env)
        if not env.get("VLM_COMPILE_CACHE_DIR") and env.get("HF_HOME"):
            env["VLM_COMPILE_CACHE_DIR"] = os.path.join(env["HF_HOME"], "compile-cache")
        names = {f.name: f"VLM_{f.name.upper()}" for f in dataclasses.fields(cls)}
        return _from_env(cls, env, {**names, "max_new_tokens_cap": "VLM_MAX_NEW_TOKENS"})


# =================================================================================================
# Vocabulary: errors, turns, requests, generations
# =================================================================================================

# Caller text quoted back in an error is cut short, so an error answer stays a few KB whatever the
# request held, and made encodable as UTF-8: the SDK never posts an answer holding a lone surrogate.
MAX_ECHO_CHARS = 64  # one quoted name or value
MAX_PARAM_CHARS = 256  # a whole field path
MAX_MESSAGE_CHARS = 1024


def _cut(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """At most `limit` characters then '…'; a lone surrogate becomes its escape (\\udc80)."""
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestError(Exception):
    """A request the worker refuses. `param` names the field at fault, `code` is stable for clients."""

    def __init__(self, code: str, message: str, param: Optional[str] = None):
        message = _cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = _cut(param, MAX_PARAM_CHARS) if param else param

    def to_dict(self) -> dict:
        text = f"{self.param}: {self.message}" if self.param else self.message
        return {"error": text, "code": self.code, "param": self.param}


def as_request_error(failure: Exception) -> RequestError:
    """Any failure as the error a caller sees (call in an `except`): the worker's own faults are logged."""
    if isinstance(failure, RequestError):
        return failure
    if isinstance(failure, SettingsError):
        log.error("settings: %s", failure)
        return RequestError("worker_misconfigured", f"worker misconfigured: {failure}")
    log.exception("unexpected failure")
    return RequestError("internal_error", "internal error while answering this request")


def _join(param: Optional[str], child: str) -> str:
    if not param:
        return child
    return f"{param}{child}" if child.startswith("[") else f"{param}.{child}"


@dataclasses.dataclass
class Turn:
    role: str
    parts: list  # str or PIL.Image.Image, in order


@dataclasses.dataclass
class GenerationParams:
    max_new_tokens: int
    temperature: float
    top_p: float
    do_sample: bool
    min_new_tokens: int = 0


@dataclasses.dataclass
class GenerationRequest:
    task: str
    turns: list[Turn]
    params: GenerationParams
    grounding_target: Optional[str] = None
    annotate: bool = False  # grounding: return the image with its boxes drawn
    param: Optional[str] = None  # where the request sits in the job, e.g. "requests[3]"

    @property
    def images(self) -> list:
        return [p for t in self.turns for p in t.parts if not isinstance(p, str)]


@dataclasses.dataclass
class Generation:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    raw_text: Optional[str] = None  # with special tokens, for box parsing
    image_input_size: Optional[tuple[int, int]] = None  # first image as the model saw it (boxes)


@dataclasses.dataclass
class StreamDelta:
    text: str  # new text since the previous delta
    completion_tokens: int  # tokens generated so far
    prompt_tokens: int = 0  # the prompt's, images included


Outcome = Generation | RequestError  # what the engine gives back for one item


# =================================================================================================
# Requests: a job's input validated into GenerationRequests
# =================================================================================================

TASK_PROMPTS = {
    "caption": "Describe this image in one sentence.",
    "caption_long": "Describe this image in detail: the scene, the objects, their colours and any text.",
}
TASKS = ("chat", "caption", "caption_long", "vqa", "grounding")


class RequestModel(BaseModel):
    """The fields of one request; messages and images are checked by hand for precise paths."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 1.0 is no token count, "yes" no bool

    task: Optional[str] = None
    messages: Optional[Any] = None
    image_url: Optional[Any] = None
    image_b64: Optional[Any] = None
    images: Optional[list] = None
    question: Optional[str] = None
    target: Optional[str] = None
    model: Optional[str] = None
    quantize: Optional[Literal[QUANTIZE_CHOICES]] = None
    max_new_tokens: Optional[int] = Field(default=None, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    do_sample: bool = False
    stream: bool = False
    batch_images: Optional[bool] = None
    annotate: bool = False  # grounding: also return the image with the boxes drawn

    @field_validator("task")
    @classmethod
    def _known_task(cls, value):
        if value is not None and value not in TASKS:
            raise ValueError(f"unknown task {_cut(value)!r}; use one of {', '.join(TASKS)}")
        return value


def _pydantic_error(error: ValidationError, param: Optional[str]) -> RequestError:
    first = error.errors(include_input=False, include_url=False)[0]
    location = ".".join(_cut(str(p)) for p in first["loc"])  # an unknown field's name is the caller's
    message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
    return RequestError("invalid_request", message, _join(param, location) if location else param)


def parse_request(raw: Any, settings: Settings, param: Optional[str] = None) -> tuple[RequestModel, GenerationRequest]:
    """Validate one request dict into its fields and a GenerationRequest (images decoded)."""
    if not isinstance(raw, dict):
        raise RequestError("invalid_request", "must be a JSON object", param or "input")
    check_strings(raw, param)
    try:
        request = RequestModel.model_validate(raw)
    except ValidationError as error:
        raise _pydantic_error(error, param) from None

    def refuse(field: str, message: str, code: str = "invalid_request"):
        raise RequestError(code, message, _join(param, field))

    task = request.task or ("chat" if request.messages is not None else None)
    if task is None:
        refuse("task", f"missing; use one of {', '.join(TASKS)} (or send messages)")
    # The default never exceeds the cap: a request that sets nothing must not be refused.
    max_new_tokens = request.max_new_tokens or min(settings.default_max_new_tokens, settings.max_new_tokens_cap)
    if max_new_tokens > settings.max_new_tokens_cap:
        refuse("max_new_tokens", f"must be at most {settings.max_new_tokens_cap} on this worker")
    if request.do_sample and request.temperature == 0:
        refuse("temperature", "must be above 0 when do_sample is true")
    if request.annotate and task != "grounding":
        refuse("annotate", "only used by the grounding task")
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=request.temperature, top_p=request.top_p,
                              do_sample=request.do_sample, min_new_tokens=min(request.min_new_tokens, max_new_tokens))
    loose_images, target = _loose_images(request, param), None
    if task == "chat":
        if request.messages is None:
            refuse("messages", "required for the chat task")
        turns = parse_messages(request.messages, settings, _join(param, "messages"))
        next(t for t in turns if t.role == "user").parts[:0] = loose_images  # the last turn is a user's
    else:
        if request.messages is not None:
            refuse("messages", f"not used by the {task} task; send task 'chat' instead")
        if not loose_images:
            refuse("image_url", f"the {task} task needs an image (image_url, image_b64 or images)", "missing_image")
        if task == "grounding":  # its prompt is the family's own: the adapter adds it (FamilyAdapter.request_turns)
            target, parts = _required_text(request.target, _join(param, "target"), "the grounding task"), loose_images
        elif task == "vqa":
            parts = [*loose_images, _required_text(request.question, _join(param, "question"), "the vqa task")]
        else:
            parts = [*loose_images, TASK_PROMPTS[task]]
        turns = [Turn("user", parts)]
    prepared = GenerationRequest(task, turns, params, grounding_target=target, annotate=request.annotate, param=param)
    _check_text_length(prepared, settings, param)
    _resolve_images(prepared.turns, settings, param)
    return request, prepared


MAX_NESTING = 32  # a real request nests 7 levels deep (requests[i].messages[j].content[k].image_url.url)
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # in a str always lone (JSON's \ud800): UTF-8 cannot encode it


def check_strings(raw: Any, param: Optional[str]) -> None:
    """Refuse, naming the field, a NUL or lone surrogate in any string or key, or nesting past MAX_NESTING."""
    stack: list[tuple[Any, Optional[str], int]] = [(raw, param, 0)]  # value, its field, depth
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where, "value")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_NESTING:
                raise RequestError("invalid_request", f"nested deeper than {MAX_NESTING} levels", where or "input")
            keys = range(len(value)) if isinstance(value, list) else list(value)
            for name in keys:
                if isinstance(name, str):  # a dict's key
                    _check_text(name, _field_path(where, name), "field name")
            stack.extend((value[key], _field_path(where, key), depth + 1) for key in reversed(keys))


def _field_path(parent: Optional[str], key: Any) -> str:
    return _join(parent, f"[{key}]" if isinstance(key, int) else _cut(key if isinstance(key, str) else repr(key)))


def _check_text(text: str, where: Optional[str], what: str) -> None:
    if "\x00" in text:
        raise RequestError("invalid_request", f"the {what} holds a NUL character", where or "input")
    if _SURROGATE.search(text):
        raise RequestError("invalid_request", f"the {what} holds invalid Unicode (a lone surrogate)", where or "input")


def _required_text(value: Optional[str], param: str, what: str) -> str:
    if value is None or not value.strip():
        raise RequestError("invalid_request", f"required for {what}", param)
    return value.strip()


def _loose_images(request: RequestModel, param: Optional[str]) -> list[ImageSpec]:
    """Images given beside the prompt: image_url, image_b64 and images[...], in that order."""
    fields = ("image_url", "image_b64")
    specs = [ImageSpec(getattr(request, f), _join(param, f)) for f in fields if getattr(request, f) is not None]
    specs.extend(ImageSpec(spec, _join(param, f"images[{i}]")) for i, spec in enumerate(request.images or ()))
    return specs


def parse_messages(messages: Any, settings: Settings, param: str) -> list[Turn]:
    """OpenAI-style messages -> turns; images stay ImageSpec for `_resolve_images` to fetch."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("invalid_request", "must be a non-empty list of messages", param)
    if len(messages) > settings.max_messages:
        raise RequestError("invalid_request", f"at most {settings.max_messages} messages per request", param)
    turns = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise RequestError("invalid_request", "must be an object with role and content", where)
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant"):
            raise RequestError("invalid_request", "must be system, user or assistant", f"{where}.role")
        if isinstance(content, str):
            parts = [content]
        elif isinstance(content, list) and content:
            parts = [_parse_block(block, f"{where}.content[{j}]") for j, block in enumerate(content)]
        else:
            raise RequestError("invalid_request", "must be a string or a non-empty list of blocks", f"{where}.content")
        if role != "user" and any(not isinstance(p, str) for p in parts):
            raise RequestError("invalid_request", "images are allowed in user messages only", f"{where}.content")
        turns.append(Turn(role, parts))
    if turns[-1].role != "user":
        raise RequestError("invalid_request", "the last message must come from the user", f"{where}.role")
    return turns


def _parse_block(block: Any, where: str):
    if not isinstance(block, dict):
        raise RequestError("invalid_request", "a content block must be an object with a type", where)
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise RequestError("invalid_request", "a text block needs a string 'text'", f"{where}.text")
        return block["text"]
    if kind in ("image_url", "image"):
        if kind not in block:
            raise RequestError("invalid_request", f"an {kind} block needs '{kind}'", f"{where}.{kind}")
        return ImageSpec(block[kind], f"{where}.{kind}")
    raise RequestError("invalid_request", "type must be text, image_url or image", f"{where}.type")


def _check_text_length(item: GenerationRequest, settings: Settings, param: Optional[str]) -> None:
    text = sum(len(p) for t in item.turns for p in t.parts if isinstance(p, str))
    text += len(item.grounding_target or "")  # becomes part of the prompt when the batch runs
    if text > settings.max_text_chars:
        message = f"the request's text is over {settings.max_text_chars} characters"
        raise RequestError("text_too_long", message, param or "input")


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """An image named by a request and not yet fetched or decoded; `param` is where it was given."""

    spec: Any
    param: str


MAX_PARALLEL_FETCHES = 8  # threads fetching the images of one request


def _resolve_images(turns: list[Turn], settings: Settings, param: Optional[str]) -> None:
    """Fetch (side by side, under one deadline) and decode a request's images in place, in order: the count
    is checked before any fetch, the pixel budget before each decode; the first failure in order is raised."""
    import concurrent.futures
    pending = [(turn, k) for turn in turns for k, part in enumerate(turn.parts) if isinstance(part, ImageSpec)]
    if len(pending) > settings.max_images:
        turn, k = pending[settings.max_images]
        raise RequestError("too_many_images", f"at most {settings.max_images} images per request", turn.parts[k].param)
    policy, used = MediaPolicy.from_env(), 0
    sources = [image_source(turn.parts[k].spec, turn.parts[k].param) for turn, k in pending]
    deadline = time.monotonic() + policy.fetch_deadline
    pool = ThreadPoolExecutor(MAX_PARALLEL_FETCHES, thread_name_prefix="vlm-fetch")  # threads start as needed
    try:
        futures = [pool.submit(_image_bytes, text, policy, where, deadline) for text, where in sources]
        for (turn, k), future, (_, where) in zip(pending, futures, sources):
            try:  # each fetch stops itself at the deadline; the margin only guards against a stuck thread
                data = future.result(timeout=max(deadline - time.monotonic(), 0) + 2)
            except concurrent.futures.TimeoutError:
                message = f"the request's images took over {policy.fetch_deadline:g}s to download"
                raise RequestError("fetch_timeout", message, where) from None
            remaining = settings.max_total_pixels - used  # decoded as soon as it and those before it arrived
            narrowed = remaining < policy.max_image_pixels
            budget = dataclasses.replace(policy, max_image_pixels=max(remaining, 1)) if narrowed else policy
            try:
                image = _decode_image(data, budget, where)
            except RequestError as error:
                if narrowed and error.code == "image_too_large":
                    message = f"the request's images hold over {settings.max_total_pixels} pixels together"
                    raise RequestError("image_too_large", message, turn.parts[k].param) from None
                raise
            used += image.width * image.height
            turn.parts[k] = image
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# =================================================================================================
# Images: fetched and decoded under the media policy
# =================================================================================================

# Images come from strangers (SSRF, bombs, broken files). Policy, after NVIDIA Dynamo's (README
# "Security"): https and base64/data URIs only; no internal addresses; pinned DNS; redirects re-checked
# by hand; one deadline; byte and pixel caps; fixed error messages that echo nothing.

MAX_URL_CHARS = 16 * 1024
MAX_REDIRECTS = 3
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_BLOCKED_NAMES = ("localhost", "localhost.localdomain", "metadata.google.internal")
_BLOCKED_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".home.arpa")
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_HOST_LABELS = re.compile(r"[a-z0-9_]([a-z0-9_\-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_\-]{0,61}[a-z0-9_])?)*")
_NUMERIC_LAST_LABEL = re.compile(r"(.*\.)?([0-9]+|0x[0-9a-f]*)")  # WHATWG: such a host is an IPv4 address
_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:@]+)(?::(\d{1,5}))?")
_Domains = pydantic.BeforeValidator(
    lambda value: tuple(d.strip().strip(".").lower() for d in value.split(",") if d.strip().strip("."))
    if isinstance(value, str) else value
)


@pydantic.dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """How images may reach the worker. Read from the environment at each resolve (cheap)."""

    allow_internal: bool = False  # VLM_ALLOW_INTERNAL_URLS: http:// and internal addresses too
    allow_http: bool = False  # plain http:// alone (code only)
    allowed_domains: Annotated[tuple[str, ...], _Domains] = ()  # VLM_URL_ALLOWED_DOMAINS: suffix match
    trust_env_proxy: bool = False  # use HTTP(S)_PROXY / NO_PROXY
    fetch_timeout: _Seconds = 20.0  # a whole fetch, all hops
    fetch_deadline: _Seconds = 30.0  # all the fetches of one request
    max_image_bytes: pydantic.PositiveInt = 64 * 1024 * 1024  # downloaded or local file bytes
    max_base64_bytes: pydantic.PositiveInt = 16 * 1024 * 1024  # encoded length of base64 text
    max_image_pixels: pydantic.PositiveInt = 40_000_000  # width*height, from the header
    min_image_side: pydantic.PositiveInt = 8  # pixels, both sides
    media_dir: Optional[str] = None  # local files only from inside this folder

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> MediaPolicy:
        names = {f.name: f"VLM_{f.name.upper()}" for f in dataclasses.fields(cls) if f.name != "allow_http"}
        names.update(allow_internal="VLM_ALLOW_INTERNAL_URLS", allowed_domains="VLM_URL_ALLOWED_DOMAINS")
        return _from_env(cls, dict(os.environ if env is None else env), names)


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def resolve_image(spec: Any, param: str, policy: Optional[MediaPolicy] = None):
    """An image spec (URL, data URI, base64, local path or {"url": ...}) -> RGB PIL image, or RequestError."""
    text, param = image_source(spec, param)
    policy = policy or MediaPolicy.from_env()
    return _decode_image(_image_bytes(text, policy, param), policy, param)


def image_source(spec: Any, param: str) -> tuple[str, str]:
    """An image spec's text and the field that holds it ({"url": text} -> param.url)."""
    if isinstance(spec, dict):
        if "url" not in spec:
            raise RequestError("invalid_image", "an image object needs a 'url' field", param)
        spec, param = spec["url"], _join(param, "url")
    if not isinstance(spec, str) or not spec.strip():
        raise RequestError("invalid_image", "an image must be a URL, a data URI or base64 text", param)
    return spec.strip(), param


def _image_bytes(spec: str, policy: MediaPolicy, param: str, deadline: Optional[float] = None) -> bytes:
    """The bytes an image spec names; `deadline` (time.monotonic()) bounds a URL fetch further."""
    scheme = _URL_SCHEME.match(spec)
    scheme = scheme.group(1).lower() if scheme else None
    if scheme == "data":
        return _data_uri_bytes(spec, policy, param)
    if scheme in ("http", "https"):
        return fetch_image_url(spec, policy, param, deadline)
    if scheme == "file":
        return _local_file_bytes(spec, True, policy, param)
    if scheme:
        message = "unsupported URL scheme; send an https URL, a data URI or base64"
        raise RequestError("invalid_image_url", message, param)
    # Base64 never holds '.' or '~'; it may start with '/' (JPEG: "/9j/"), but no JPEG encodes to
    # under 128 characters, so a short "/..." is a path. Other paths need file:// or a '.'.
    if "." in spec or spec.startswith("~") or (spec.startswith("/") and len(spec) < 128):
        return _local_file_bytes(spec, False, policy, param)
    return _base64_bytes(spec, policy, param)


def _data_uri_bytes(spec: str, policy: MediaPolicy, param: str) -> bytes:
    header, comma, _ = spec[5:1029].partition(",")
    if not comma:
        raise RequestError("invalid_image_url", "a data URI needs a ',' after its header", param)
    fields = [f.strip().lower() for f in header.split(";")]
    if fields[0] == "image/svg+xml":
        raise RequestError("unsupported_image_format", _SVG_MESSAGE, param)
    if "base64" not in fields[1:]:
        message = "only base64 data URIs are supported (data:image/png;base64,...)"
        raise RequestError("invalid_image_url", message, param)
    return _base64_bytes(spec[5 + len(header) + 1:], policy, param)


def _base64_bytes(text: str, policy: MediaPolicy, param: str) -> bytes:
    """Strict base64; line breaks and the URL-safe alphabet (padded or not) pass, mixed alphabets do not."""
    if len(text) > policy.max_base64_bytes:
        message = f"the base64 image is over {_size_text(policy.max_base64_bytes)} encoded"
        raise RequestError("image_too_large", message, param)
    compact = "".join(text.split())
    if "-" in compact or "_" in compact:
        if "+" in compact or "/" in compact:
            raise RequestError("invalid_base64", "the image mixes standard and URL-safe base64 alphabets", param)
        compact = compact.translate(str.maketrans("-_", "+/"))
    if "=" not in compact:
        if len(compact) % 4 == 1:
            raise RequestError("invalid_base64", "the image is not valid base64 (wrong length)", param)
        compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("invalid_base64", "the image is not valid base64", param) from None
    if not data:
        raise RequestError("invalid_base64", "the base64 image is empty", param)
    return data


def _local_file_bytes(spec: str, is_url: bool, policy: MediaPolicy, param: str) -> bytes:
    import stat
    import urllib.parse
    if not policy.media_dir:
        message = "local files are disabled on this worker; send an https URL or base64"
        raise RequestError("blocked_url", message, param)
    path = spec
    if is_url:
        parts = urllib.parse.urlsplit(spec)
        if parts.netloc.lower() not in ("", "localhost") or parts.query or parts.fragment:
            raise RequestError("invalid_image_url", "a file URL must look like file:///path/in/media/dir", param)
        path = urllib.parse.unquote(parts.path)
    if "\x00" in path or "\\" in path or ".." in path.split("/"):
        raise RequestError("blocked_url", "the path may not contain '..', backslashes or NUL", param)
    base = os.path.realpath(policy.media_dir)
    real = os.path.realpath(path if path.startswith("/") else os.path.join(base, path))
    if os.path.commonpath([base, real]) != base or real == base:
        raise RequestError("blocked_url", "the path is outside the media directory", param)
    try:  # O_NOFOLLOW|O_NONBLOCK: a symlink swapped in after realpath, or a FIFO, cannot hang or escape
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        missing = isinstance(error, FileNotFoundError)
        message = "no such file in the media directory" if missing else "the local image could not be read"
        raise RequestError("fetch_failed", message, param) from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RequestError("fetch_failed", "the local path is not a regular file", param)
        data = file.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise RequestError("image_too_large", f"the image is over {_size_text(policy.max_image_bytes)}", param)
    return data


@dataclasses.dataclass(frozen=True)
class ImageURL:
    """A checked, normalised URL: what was validated is exactly what gets fetched."""

    scheme: str
    host: str  # ASCII, lower case, no trailing dot; an IP literal without brackets
    port: int
    target: str  # path and query, percent-encoded, sent as the request target
    ip: Any = None  # ipaddress object when the host is an IP literal

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return f"{self.scheme}://{host}{'' if self.port == default else f':{self.port}'}{self.target}"


def ip_is_blocked(ip) -> bool:
    """True for every address a stranger must not make the worker reach (policy's ranges)."""
    if ip.version == 6:  # is_global misses these; 6to4/Teredo carry an IPv4 inside
        embedded = [ip.sixtofour, *(ip.teredo or ())]
        if ip.ipv4_mapped is not None or ip.is_site_local or any(e is not None and ip_is_blocked(e) for e in embedded):
            return True
    return not ip.is_global or ip.is_multicast or ip.is_reserved  # is_global: private, CGNAT, loopback...


def check_image_url(url: str, policy: MediaPolicy, param: str, redirected: bool = False) -> ImageURL:
    """Validate and normalise one URL without touching the network (DNS comes later)."""
    import ipaddress
    import socket
    import unicodedata
    import urllib.parse

    def refuse(code: str, message: str):
        raise RequestError(code, message + (" (after a redirect)" if redirected else ""), param)

    if len(url) > MAX_URL_CHARS:
        refuse("invalid_image_url", f"the image URL is over {MAX_URL_CHARS} characters")
    if "\\" in url or any(unicodedata.category(c)[0] in "CZ" for c in url):
        refuse("invalid_image_url", "the image URL holds a backslash, whitespace or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        refuse("invalid_image_url", "the image URL could not be parsed")
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        refuse("invalid_image_url", "the image URL must use https")
    if scheme == "http" and not (policy.allow_http or policy.allow_internal):
        refuse("blocked_url", "plain http image URLs are not allowed; use https")
    if "@" in parts.netloc:
        refuse("blocked_url", "the image URL may not carry credentials (user@host)")
    authority = _AUTHORITY.fullmatch(parts.netloc)
    if not authority:
        refuse("invalid_image_url", "the image URL has no valid host")
    raw_host, raw_port = authority.groups()
    port = int(raw_port) if raw_port else (443 if scheme == "https" else 80)
    if not 0 < port < 65536:
        refuse("invalid_image_url", "the image URL has an invalid port")
    ip = None
    if raw_host.startswith("["):
        try:
            ip = ipaddress.IPv6Address(raw_host[1:-1])
        except ValueError:
            refuse("invalid_image_url", "the image URL has an invalid IPv6 address")
        host = str(ip)
    else:
        try:
            host = raw_host.lower() if raw_host.isascii() else raw_host.encode("idna").decode("ascii").lower()
        except UnicodeError:
            refuse("invalid_image_url", "the image URL has an invalid host name")
        host = host[:-1] if host.endswith(".") and not host.endswith("..") else host
        if _NUMERIC_LAST_LABEL.fullmatch(host):
            try:  # inet_aton parses what browsers do (127.1, 0x7f.1, 0177.0.0.1, 2130706433)
                ip = ipaddress.IPv4Address(socket.inet_aton(host))
            except OSError:
                refuse("invalid_image_url", "the image URL has an invalid numeric host")
        elif not _HOST_LABELS.fullmatch(host) or len(host) > 253:
            refuse("invalid_image_url", "the image URL has an invalid host name")
    if ip is not None and not policy.allow_internal and ip_is_blocked(ip):
        refuse("blocked_url", "the image URL points at an internal or reserved address")
    if ip is not None and host != str(ip):  # a blocked address is refused as such first, above
        refuse("invalid_image_url", "write a numeric host as four decimal parts (a.b.c.d)")
    if ip is None and not policy.allow_internal:
        if host in _BLOCKED_NAMES or host.endswith(_BLOCKED_SUFFIXES) or "." not in host:
            refuse("blocked_url", "the image URL names an internal host")
    if policy.allowed_domains and not any(
        host == d or (ip is None and host.endswith("." + d)) for d in policy.allowed_domains
    ):
        refuse("blocked_url", "the image URL's host is not on this worker's allow-list")
    path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    query = urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return ImageURL(scheme, host, port, path + (f"?{query}" if parts.query else ""), ip)


def _resolve(target: ImageURL, policy: MediaPolicy, deadline: float, param: str, after: str) -> list:
    """Every DNS answer, each checked: one blocked answer refuses the URL (no racing A/AAAA)."""
    import concurrent.futures
    import ipaddress
    import socket
    if target.ip is not None:
        return [target.ip]
    future = _DNS_POOL.submit(socket.getaddrinfo, target.host, target.port, 0, socket.SOCK_STREAM)
    try:  # getaddrinfo has no timeout of its own: wait on it from here, under the fetch's deadline
        answers = future.result(timeout=max(deadline - time.monotonic(), 0.001))
    except concurrent.futures.TimeoutError:
        raise RequestError("fetch_timeout", "the image URL's host did not resolve in time" + after, param) from None
    except (OSError, UnicodeError):
        answers = []
    inet = (socket.AF_INET, socket.AF_INET6)
    addresses = list(dict.fromkeys(ipaddress.ip_address(a[4][0].split("%")[0]) for a in answers if a[0] in inet))
    if not policy.allow_internal and any(ip_is_blocked(ip) for ip in addresses):
        log.warning("image fetch refused: the host of %s resolves to a blocked address", param)
        raise RequestError("blocked_url", "the image URL's host resolves to an internal address" + after, param)
    if not addresses:
        raise RequestError("fetch_failed", "the image URL's host could not be resolved" + after, param)
    return addresses


# Shared by all jobs (threads start as needed): wide enough that names whose DNS stalls hold up no other.
_DNS_POOL = ThreadPoolExecutor(32, thread_name_prefix="vlm-dns")


def _tls_context():
    """The CAs of SSL_CERT_FILE / SSL_CERT_DIR when either is set, else certifi's bundle (as requests does)."""
    return _tls_context_for(os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None)


@functools.lru_cache(maxsize=4)  # loading a CA bundle takes tens of milliseconds
def _tls_context_for(cafile: Optional[str], cadir: Optional[str]):
    import ssl
    if cafile is None and not cadir:
        with contextlib.suppress(ImportError):
            import certifi
            cafile = certifi.where()
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _pinned_connection(target: ImageURL, addresses: list, deadline: float):
    """An http.client connection to the checked addresses, never to a fresh DNS answer (DNS
    rebinding); the Host header, SNI and certificate check keep the name."""
    import http.client
    import socket

    def pin():
        last: Optional[OSError] = None
        for ip in addresses:  # each already checked by _resolve or check_image_url
            if (remaining := deadline - time.monotonic()) <= 0:
                raise TimeoutError
            try:
                return socket.create_connection((str(ip), target.port), timeout=remaining)
            except OSError as error:
                last = error
        raise last or OSError("no address")

    if target.scheme == "http":  # connect is pin(), under the deadline: no timeout of http.client's own
        conn = http.client.HTTPConnection(target.host, target.port)
        conn.connect = lambda: setattr(conn, "sock", pin())
        return conn
    tls = _tls_context()
    conn = http.client.HTTPSConnection(target.host, target.port, context=tls)
    conn.connect = lambda: setattr(conn, "sock", tls.wrap_socket(pin(), server_hostname=target.host))
    return conn


def _proxy_connection(target: ImageURL, policy: MediaPolicy, deadline: float):
    """(connection, request target, headers) through the environment's proxy when trusted, else None."""
    import http.client
    import urllib.parse
    import urllib.request
    if not policy.trust_env_proxy:
        return None
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(target.scheme)
    if not proxy or urllib.request.proxy_bypass_environment(target.host, proxies):
        return None
    parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if parts.scheme != "http" or not parts.hostname:
        raise SettingsError("the environment's proxy must be an http:// URL")
    headers = {}
    if parts.username is not None:
        credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
    timeout = max(deadline - time.monotonic(), 0.001)
    if target.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port or 8080, timeout=timeout, context=_tls_context())
        conn.set_tunnel(target.host, target.port, headers=headers)
        return conn, target.target, {}
    return http.client.HTTPConnection(parts.hostname, parts.port or 8080, timeout=timeout), target.url, headers


def fetch_image_url(url: str, policy: MediaPolicy, param: str, request_deadline: Optional[float] = None) -> bytes:
    """GET an image: each hop checked, pinned and capped, under one deadline (the fetch's or the request's)."""
    import urllib.parse
    deadline = time.monotonic() + policy.fetch_timeout
    late = f"the image URL took over {policy.fetch_timeout:g}s"
    if request_deadline is not None and request_deadline < deadline:
        deadline, late = request_deadline, f"the request's images took over {policy.fetch_deadline:g}s to download"
    target = check_image_url(url, policy, param)
    for hop in range(MAX_REDIRECTS + 1):
        body_or_location = _fetch_once(target, policy, deadline, param, " (after a redirect)" if hop else "", late)
        if isinstance(body_or_location, bytes):
            return body_or_location
        if hop < MAX_REDIRECTS:
            target = check_image_url(urllib.parse.urljoin(target.url, body_or_location), policy, param, redirected=True)
    raise RequestError("fetch_failed", f"the image URL redirected more than {MAX_REDIRECTS} times", param)


def _fetch_once(target: ImageURL, policy: MediaPolicy, deadline: float, param: str, after: str, late: str):
    """One request: the body (bytes) or a redirect's Location (str). `late` says which deadline passed."""
    import http.client
    import socket
    via_proxy = _proxy_connection(target, policy, deadline)
    addresses = _resolve(target, policy, deadline, param, after)
    conn, request_target, headers = via_proxy or (_pinned_connection(target, addresses, deadline), target.target, {})
    headers.update({"User-Agent": "runpod-vlm image fetch", "Accept": "image/*", "Accept-Encoding": "identity"})
    expired = threading.Event()

    def abort():  # the deadline covers slow headers too (a per-read timeout never fires on a drip)
        expired.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("GET", request_target, headers=headers)
        response = conn.getresponse()
        if response.status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            if not location:
                raise RequestError("fetch_failed", "the image URL redirected without a Location" + after, param)
            return location.strip()
        if response.status != 200:
            raise RequestError("fetch_failed", f"the image URL answered HTTP {response.status}" + after, param)
        if response.headers.get_content_type() == "image/svg+xml":
            raise RequestError("unsupported_image_format", _SVG_MESSAGE, param)
        declared = response.length  # the Content-Length, parsed by http.client
        too_large = RequestError("image_too_large", f"the image is over {_size_text(policy.max_image_bytes)}", param)
        if declared is not None and declared > policy.max_image_bytes:
            raise too_large  # refused early; a smaller Content-Length is never trusted
        chunks, size = [], 0
        while chunk := response.read1(64 * 1024):
            size += len(chunk)
            if size > policy.max_image_bytes:
                raise too_large
            if time.monotonic() > deadline:
                raise TimeoutError
            chunks.append(chunk)
        if expired.is_set():
            raise TimeoutError
        if declared is not None and size < declared:  # read1 returns short bodies quietly
            raise RequestError("fetch_failed", "the image download ended early" + after, param)
        return b"".join(chunks)
    except (OSError, http.client.HTTPException, ValueError) as error:
        if expired.is_set() or isinstance(error, TimeoutError):  # socket.timeout is TimeoutError
            raise RequestError("fetch_timeout", late + after, param) from None
        log.info("image fetch for %s failed", param, exc_info=log.isEnabledFor(logging.DEBUG))
        raise RequestError("fetch_failed", "the image URL could not be fetched" + after, param) from None
    finally:
        watchdog.cancel()
        conn.close()


_SVG_MESSAGE = "SVG images are not supported; send PNG, JPEG, WEBP, GIF, BMP or TIFF"
_OTHER_FORMATS = (
    (b"8BPS", "PSD"), (b"%PDF", "PDF"), (b"\x00\x00\x01\x00", "ICO"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"qoif", "QOI"), (b"SIMPLE  =", "FITS"))


def _sniff_other(data: bytes) -> Optional[str]:
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<svg", b"<?xml", b"<!doctype svg", b"<!--")) and b"<svg" in data[:4096].lower():
        return "SVG"
    if data[4:8] == b"ftyp" and data[8:12] in (b"heic", b"heix", b"mif1", b"msf1", b"avif", b"avis"):
        return "HEIC/AVIF"
    return next((name for magic, name in _OTHER_FORMATS if data.startswith(magic)), None)


def _decode_image(data: bytes, policy: MediaPolicy, param: str):
    """Bytes -> RGB image: allowed formats only, pixel cap from the header, frame 0, EXIF
    orientation, every mode to RGB (alpha over white). Messages are fixed: PIL's text leaks."""
    from PIL import Image, ImageOps
    allowed = ", ".join(IMAGE_FORMATS[:-1]) + " or " + IMAGE_FORMATS[-1]
    if other := _sniff_other(data):
        message = _SVG_MESSAGE if other == "SVG" else f"{other} images are not supported; send {allowed}"
        raise RequestError("unsupported_image_format", message, param)
    if not data:
        raise RequestError("invalid_image_format", "the image is empty", param)
    too_large = RequestError("image_too_large", f"the image is over {policy.max_image_pixels} pixels", param)
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise too_large from None
    except Exception:  # UnidentifiedImageError and the plugins' own errors alike
        raise RequestError("invalid_image_format", f"the data is not a {allowed} image", param) from None
    with image:
        width, height = image.size
        if width * height > policy.max_image_pixels:
            message = f"the image is {width}x{height}, over {policy.max_image_pixels} pixels"
            raise RequestError("image_too_large", message, param)
        if min(width, height) < policy.min_image_side:
            message = f"the image is {width}x{height}; each side must be at least {policy.min_image_side} pixels"
            raise RequestError("image_too_small", message, param)
        try:
            image.load()  # frame 0 of an animation
            oriented = image
            with contextlib.suppress(Exception):  # a broken EXIF block costs the orientation, not the request
                oriented = ImageOps.exif_transpose(image)
            return _to_rgb(oriented)
        except Image.DecompressionBombError:
            raise too_large from None
        except MemoryError:
            raise RequestError("image_too_large", "the image is too large to decode", param) from None
        except Exception:
            raise RequestError("invalid_image_format", "the image is truncated or corrupt", param) from None


def _to_rgb(image):
    """Any Pillow mode -> RGB. 16/32-bit and float greys are scaled, not clipped to white."""
    from PIL import Image
    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        low, high = image.getextrema()
        if mode.startswith("I;16") or (mode == "I" and 255 < high <= 65535 and low >= 0):
            scale, offset = 1 / 256, 0.0
        elif mode == "F" and low >= 0 and high <= 1.0:
            scale, offset = 255.0, 0.0
        elif low >= 0 and high <= 255:
            scale, offset = 1.0, 0.0
        else:
            scale = 255.0 / (high - low) if high > low else 1.0
            offset = -low * scale
        image = image.convert("F" if mode == "F" else "I").point(lambda v: v * scale + offset).convert("L")
        mode = "L"
    if mode == "LAB":  # Pillow's plain LAB->RGB convert copies channels; colour management is right
        from PIL import ImageCms
        transform = ImageCms.buildTransform(ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"), "LAB", "RGB")
        return ImageCms.applyTransform(image, transform)
    if mode in ("RGBA", "LA", "PA", "RGBa") or "transparency" in image.info:
        return Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


# =================================================================================================
# Family adapters: prompts and processor inputs as each model card writes them
# =================================================================================================

class FamilyAdapter:
    """The model cards' generic recipe for prompting a family; a FAMILIES row or a subclass adjusts it."""

    native = True  # loads with AutoProcessor and `model_class`, no remote code
    name, model_class = "generic", "AutoModelForImageTextToText"  # names in transformers
    grounding: Optional[str] = None  # coordinate system of its boxes (see "parsing boxes"), or None
    grounding_template = "Locate {} in the image and give its bounding box as [x1, y1, x2, y2]."
    skip_modules: Optional[tuple[str, ...]] = None  # kept out of quantization; None: found by model type

    def __init__(self, model_type: Optional[str] = None, **family):
        self.model_type = model_type
        vars(self).update(family)  # a FAMILIES row's changes to the class's defaults

    @property
    def quantization_skip_modules(self) -> tuple[str, ...]:
        """Modules bitsandbytes leaves in full precision: the vision tower and projector, and lm_head."""
        if self.skip_modules is None and self.model_type is not None:
            return unquantized_module_names(self.model_type, self.model_class)
        return self.skip_modules or ()

    def processor_kwargs(self, settings: Settings) -> dict:
        return {}

    def after_load(self, model, processor, source: str) -> None:
        """What the card does to the loaded model and processor before they answer (Phi-4-multimodal)."""

    def request_turns(self, item: GenerationRequest) -> list[Turn]:
        """The item's turns; a grounding request's last turn ends with the family's grounding prompt."""
        if item.task != "grounding":
            return item.turns
        *before, last = item.turns
        return [*before, Turn(last.role, [*last.parts, self.grounding_template.format(item.grounding_target)])]

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        """Turns as processors' chat templates take them: images become {"type": "image"}."""
        return [
            {"role": turn.role,
             "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in turn.parts]}
            for turn in turns
        ]

    def batch_inputs(self, processor, items: list[GenerationRequest], device, dtype):
        """Left-padded prompts and pixels on `device`, and per item its first image's input size (or None)."""
        prompts = [processor.apply_chat_template(self.chat_messages(self.request_turns(item)), tokenize=False,
                                                 add_generation_prompt=True) for item in items]
        kwargs: dict = {"text": prompts, "padding": True, "return_tensors": "pt"}
        if any(item.images for item in items):
            kwargs["images"] = [item.images for item in items]
        bos = getattr(processor.tokenizer, "bos_token", None)  # a template that writes BOS gets no second one
        if isinstance(bos, str) and prompts[0].startswith(bos):
            kwargs["add_special_tokens"] = False
        inputs = processor(**kwargs).to(device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        return inputs, self.input_sizes(processor, inputs, items)

    def input_sizes(self, processor, inputs, items: list[GenerationRequest]) -> list:
        return [None] * len(items)


class QwenVLAdapter(FamilyAdapter):
    """Qwen2-VL, and (FAMILIES) Qwen2.5-VL and Qwen3-VL with their own grounding."""

    name, grounding, grounding_template = "qwen2-vl", "qwen-1000", "Find <|object_ref_start|>{}<|object_ref_end|>"
    skip_modules = ("model.visual", "lm_head")

    def processor_kwargs(self, settings: Settings) -> dict:
        return {k: v for k, v in {"min_pixels": settings.min_pixels, "max_pixels": settings.max_pixels}.items() if v}

    def input_sizes(self, processor, inputs, items: list[GenerationRequest]) -> list:
        """Per item, (width, height) of its first image as resized: Qwen2.5-VL's boxes are in its pixels."""
        if "image_grid_thw" not in inputs:
            return [None] * len(items)
        patch = processor.image_processor.patch_size
        grids = iter(inputs["image_grid_thw"].tolist())  # (frames, rows, columns) per image, in order
        firsts = [[next(grids) for _ in item.images][:1] for item in items]
        return [(first[0][2] * patch, first[0][1] * patch) if first else None for first in firsts]


class PaliGemmaAdapter(FamilyAdapter):
    """PaliGemma (2, mix): no chat template; one image and a task prefix per prompt, detection in <loc> tokens."""

    name, grounding, grounding_template = "paligemma", "paligemma-1024", "detect {}"
    skip_modules = ("model.vision_tower", "model.multi_modal_projector", "lm_head")

    def task_prefix(self, item: GenerationRequest) -> str:
        """The card's prompt for the item; a chat is one user turn whose text is the prefix."""
        if len(item.images) > 1:
            raise RequestError("invalid_request", "the paligemma family takes one image per request",
                               _join(item.param, "messages" if item.task == "chat" else "images"))
        text = _text_of(item.turns[-1]).strip()
        prefix = {"caption": "caption en", "caption_long": "describe en", "vqa": f"answer en {text}",
                  "grounding": self.grounding_template.format(item.grounding_target)}.get(item.task)
        if prefix is None and (len(item.turns) != 1 or item.turns[0].role != "user"):
            raise RequestError("invalid_request", "the paligemma family takes one user message (a task prefix such "
                               "as 'caption en', 'answer en <question>' or 'detect <object>'), no system or "
                               "assistant turns", _join(item.param, "messages"))
        return prefix or text

    def batch_inputs(self, processor, items, device, dtype):
        from PIL import Image

        # The model always reads an image: a text-only row (a chat, the engine's padding row) gets a black one.
        images = [item.images or [Image.new("RGB", (1, 1))] for item in items]
        texts = [self.task_prefix(item) for item in items]
        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt").to(device)
        inputs.pop("labels", None)  # the processor's training labels: not a generation input
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        return inputs, [None] * len(items)


class RemoteCodeAdapter(FamilyAdapter):
    """Families served through their repository's own code (trust_remote_code), one item at a time."""

    native = False
    model_class, processor_class = "AutoModel", "AutoTokenizer"  # names in transformers
    inner_language_model: Optional[str] = None  # the attribute whose generate() the card's chat() calls

    def load(self, path: str, load_kwargs: dict):
        import transformers
        model = getattr(transformers, self.model_class).from_pretrained(path, **load_kwargs).eval()
        return model, getattr(transformers, self.processor_class).from_pretrained(path, trust_remote_code=True)

    def card_sampling(self, sampling: dict) -> dict:
        """The request's decoding exactly; top_k=0 turns off generate()'s default top-k 50 when sampling."""
        return {**sampling, "top_k": 0} if sampling.get("do_sample") else dict(sampling)

    def run(self, model, tokenizer, item: GenerationRequest, sampling: dict) -> Generation:
        system, turns = _leading_system_prompt(self.request_turns(item), self.name, item.param)
        with self.recorded_generation(model) as record:
            text = self.chat(model, tokenizer, system, turns, item.images, self.card_sampling(sampling))
        return self.generation(text, record, item.params.max_new_tokens)

    @contextlib.contextmanager
    def recorded_generation(self, model):
        """Records the prompt length, ids and end tokens of the inner model's generate(), which chat() hides."""
        from unittest import mock
        record: dict = {}
        inner = getattr(model, self.inner_language_model)
        real_generate = inner.generate

        def generate(*args, **kwargs):
            output = real_generate(*args, **kwargs)
            prompt = kwargs.get("inputs_embeds", kwargs.get("input_ids"))
            eos = kwargs.get("eos_token_id") or inner.generation_config.eos_token_id  # what stopped it
            record.update(prompt_tokens=int(prompt.shape[1]) if prompt is not None else 0,
                          ids=output[0].tolist(), eos=set(_token_ids(eos)))
            return output

        with mock.patch.object(inner, "generate", generate):
            yield record

    def generation(self, text: str, record: dict, max_new_tokens: int) -> Generation:
        """Usage and finish_reason from the generated ids and the end tokens generate() stopped at."""
        ids, eos = record["ids"], record["eos"]
        return Generation(text.strip(), _finish_reason(ids, eos, max_new_tokens), record["prompt_tokens"],
                          _trimmed_length(ids, eos))


def _text_of(turn: Turn) -> str:
    return " ".join(p for p in turn.parts if isinstance(p, str))


def _token_ids(value) -> list[int]:
    """A config's token id field (an int, a list of ints or None) as a list."""
    return [value] if isinstance(value, int) else [v for v in value or () if isinstance(v, int)]


def end_tokens(model, tokenizer) -> set:
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set(_token_ids(config_eos)) | set(_token_ids(getattr(tokenizer, "eos_token_id", None)))


def _leading_system_prompt(turns: list[Turn], family: str, param: Optional[str]) -> tuple[Optional[str], list[Turn]]:
    """The leading system turns' text and the turns after them, which must open with a user turn."""
    opening = next((k for k, turn in enumerate(turns) if turn.role != "system"), len(turns))
    system, rest = turns[:opening], turns[opening:]
    if any(turn.role == "system" for turn in rest):
        raise RequestError("invalid_request", f"the {family} family takes system messages only at the start",
                           _join(param, "messages"))
    if rest and rest[0].role != "user":
        raise RequestError("invalid_request", f"the {family} family needs the conversation to open with a "
                           "user message (after any system message)", _join(param, "messages"))
    return ("\n".join(_text_of(t) for t in system) or None), rest


class MiniCPMVAdapter(RemoteCodeAdapter):
    """openbmb/MiniCPM-V-2_6: `model.chat(image=None, msgs=[...], tokenizer=...)` per its card."""

    name, skip_modules, inner_language_model = "minicpm-v", ("vpm", "resampler", "lm_head"), "llm"

    def load(self, path: str, load_kwargs: dict):
        # Its resampler.py takes `List` from `from torch.nn.functional import *`, which torch no
        # longer provides (torch >= 2.7); give that module the name back instead of editing the repo.
        import typing

        import torch  # noqa: F401  (loads torch.nn.functional)
        functional = sys.modules.get("torch.nn.functional")
        if functional is not None and not hasattr(functional, "List"):
            functional.List = typing.List  # noqa: UP006  (the name resampler.py looks up)
        return super().load(path, load_kwargs)

    def card_sampling(self, sampling: dict) -> dict:
        """Overrides chat()'s defaults (top_k 100 or num_beams 3, repetition_penalty 1.05 or 1.2)."""
        greedy = not sampling.get("do_sample")
        return {**super().card_sampling(sampling), "sampling": not greedy, "repetition_penalty": 1.0,
                **({"num_beams": 1} if greedy else {})}

    def chat(self, model, tokenizer, system, turns, images, sampling) -> str:
        msgs = [{"role": turn.role, "content": list(turn.parts)} for turn in turns]
        return model.chat(image=None, msgs=msgs, tokenizer=tokenizer, **sampling,
                          **({"system_prompt": system} if system else {}))


class InternVL2Adapter(RemoteCodeAdapter):
    """OpenGVLab/InternVL2-*: the card's dynamic 448px tiling, then `model.chat(...)`."""

    name, skip_modules, inner_language_model = "internvl", ("vision_model", "mlp1", "lm_head"), "language_model"
    image_size, max_tiles = 448, 12
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

    def tiles(self, image) -> list:
        """The card's `dynamic_preprocess`: the closest aspect-ratio grid of 448px tiles + a thumbnail."""
        (width, height), size, sides = image.size, self.image_size, range(1, self.max_tiles + 1)
        grids = sorted({(i, j) for i in sides for j in sides if i * j <= self.max_tiles}, key=lambda g: g[0] * g[1])
        best, best_diff = (1, 1), float("inf")
        for cols, rows in grids:
            diff = abs(width / height - cols / rows)
            if diff < best_diff or (diff == best_diff and width * height > 0.5 * size**2 * cols * rows):
                best, best_diff = (cols, rows), diff
        cols, rows = best
        resized = image.resize((size * cols, size * rows))
        tiles = [resized.crop((x * size, y * size, (x + 1) * size, (y + 1) * size))
                 for y in range(rows) for x in range(cols)]
        return [*tiles, image.resize((size, size))] if len(tiles) > 1 else tiles

    def pixel_values(self, images, dtype, device):
        """The images' normalised tiles, stacked, and each image's tile count."""
        import torch
        from torchvision.transforms import functional as F
        per_image = [torch.stack([F.normalize(F.to_tensor(t), self.mean, self.std) for t in self.tiles(image)])
                     for image in images]
        if not per_image:
            return None, []
        return torch.cat(per_image).to(dtype=dtype, device=device), [len(p) for p in per_image]

    def chat(self, model, tokenizer, system, turns, images, sampling) -> str:
        from unittest import mock

        # Its chat() takes one question plus (question, answer) history pairs; a system prompt
        # replaces `model.system_message` for this request, as its card does.
        history, pending = [], None
        for turn in turns:
            text = "\n".join(p if isinstance(p, str) else "<image>" for p in turn.parts)
            if turn.role == "assistant" and pending is not None:
                history.append((pending, text))
                pending = None
            elif turn.role == "user":
                pending = text if pending is None else f"{pending}\n{text}"
        values, num_patches = self.pixel_values(images, model.dtype, model.device)
        with mock.patch.object(model, "system_message", system, create=True) if system else contextlib.nullcontext():
            return model.chat(tokenizer, values, pending or "", sampling,
                              num_patches_list=num_patches or None, history=history or None)


class Phi3VisionAdapter(RemoteCodeAdapter):
    """microsoft/Phi-3-vision-128k-instruct: `<|image_N|>` placeholders + its processor + generate."""

    name, skip_modules = "phi3-vision", ("model.vision_embed_tokens", "lm_head")
    model_class, processor_class = "AutoModelForCausalLM", "AutoProcessor"

    def load(self, path: str, load_kwargs: dict):
        import importlib.util

        # Its config.json asks for flash_attention_2; the card says to pass eager without flash-attn,
        # spelt `_attn_implementation`: that key overrides config.json's (`attn_implementation` does not).
        if importlib.util.find_spec("flash_attn") is None:
            load_kwargs = {**load_kwargs, "_attn_implementation": "eager"}
        return super().load(path, load_kwargs)

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        import itertools
        numbers = itertools.count(1)
        return [{"role": turn.role,
                 "content": "\n".join(p if isinstance(p, str) else f"<|image_{next(numbers)}|>" for p in turn.parts)}
                for turn in turns]

    def run(self, model, processor, item: GenerationRequest, sampling: dict) -> Generation:
        import torch
        messages = self.chat_messages(self.request_turns(item))
        prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(prompt, item.images or None, return_tensors="pt").to(model.device)
        # The card passes the tokenizer's end token; the generation config's (<|end|>) ends turns too.
        eos = end_tokens(model, processor.tokenizer)
        with torch.inference_mode():
            out = model.generate(**inputs, eos_token_id=sorted(eos), **self.card_sampling(sampling))
        prompt_tokens = int(inputs["input_ids"].shape[1])
        new_tokens = out[0, prompt_tokens:]
        record = {"ids": new_tokens.tolist(), "prompt_tokens": prompt_tokens, "eos": eos}
        text = processor.tokenizer.decode(new_tokens, skip_special_tokens=True)
        return self.generation(text, record, item.params.max_new_tokens)


class Phi4MultimodalAdapter(FamilyAdapter):
    """microsoft/Phi-4-multimodal-instruct (transformers format; images, not audio), prompted as transformers' tests."""

    name, model_class = "phi4-multimodal", "AutoModelForCausalLM"
    skip_modules = ("model.embed_tokens_extend.image_embed", "lm_head")

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        return [{"role": turn.role, "content": "".join(p if isinstance(p, str) else "<|image|>" for p in turn.parts)}
                for turn in turns]

    def after_load(self, model, processor, source: str) -> None:
        """As the card: the processor's chat template (5.17 puts it on the tokenizer only), the vision LoRA set."""
        processor.chat_template = processor.chat_template or processor.tokenizer.chat_template
        folder = os.path.join(source, "vision-lora")  # by path: 5.17's load_adapter skips `subfolder` in a folder
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            log.warning("%s has no vision-lora adapter: Phi-4-multimodal answers with its base weights", source)
            return
        model.load_adapter(folder, adapter_name="vision")
        model.set_adapter("vision")


QWEN_JSON_GROUNDING = "Locate {} in the image, and output its bbox coordinates in JSON format."
LLAVA_SKIPS = ("model.vision_tower", "model.multi_modal_projector", "lm_head")
SMOLVLM = {"name": "smolvlm", "skip_modules": ("model.vision_model", "model.connector", "lm_head")}  # Idefics3 too
FAMILIES: dict[str, dict] = {  # model_type -> its adapter class and what it changes of the class's defaults
    "qwen2_vl": {"adapter": QwenVLAdapter},
    "qwen2_5_vl": {"adapter": QwenVLAdapter, "name": "qwen2.5-vl", "grounding": "qwen-abs-pixels",
                   "grounding_template": QWEN_JSON_GROUNDING},
    "qwen3_vl": {"adapter": QwenVLAdapter, "name": "qwen3-vl", "grounding_template": QWEN_JSON_GROUNDING},
    "paligemma": {"adapter": PaliGemmaAdapter}, "phi4_multimodal": {"adapter": Phi4MultimodalAdapter},
    "minicpmv": {"adapter": MiniCPMVAdapter}, "phi3_v": {"adapter": Phi3VisionAdapter},
    "internvl_chat": {"adapter": InternVL2Adapter}, "llava": {"name": "llava", "skip_modules": LLAVA_SKIPS},
    "llava_next": {"name": "llava-next", "skip_modules": LLAVA_SKIPS}, "idefics3": SMOLVLM, "smolvlm": SMOLVLM,
    # Served as their cards do by the generic recipe (tests/test_families.py); skips read from their module trees.
    "gemma3": {"name": "gemma3"}, "mistral3": {"name": "mistral3"}, "llama4": {"name": "llama4"},
    "llava_onevision": {"name": "llava-onevision"}, "internvl": {"name": "internvl-hf"},
    "glm4v": {"name": "glm-4.1v", "grounding": "glm-1000",  # the GLM-V repository's README
              "grounding_template": "Help me to locate {} in the image and give me its bounding boxes."},
}


def adapter_for(model_type: str) -> FamilyAdapter:
    """The adapter of a config's model_type; other native model types get the generic adapter."""
    family = dict(FAMILIES.get(model_type, {}))
    return family.pop("adapter", FamilyAdapter)(model_type, **family)


ADAPTERS: dict[str, FamilyAdapter] = {adapter.name: adapter for adapter in map(adapter_for, FAMILIES)}


@functools.cache
def unquantized_module_names(model_type: str, model_class: str = "AutoModelForImageTextToText") -> tuple[str, ...]:
    """The outermost vision or projector modules, then the output head, of the type's default model on meta."""
    import torch
    import transformers
    try:
        with torch.device("meta"):
            model = getattr(transformers, model_class).from_config(transformers.AutoConfig.for_model(model_type))
    except Exception as error:
        raise SettingsError(f"cannot find the vision modules of model type {model_type!r} to keep them out of "
                            f"quantization ({error}); set VLM_QUANTIZE=none") from error
    words, names = ("vision", "visual", "projector", "connector", "resampler"), []
    for name, _ in model.named_modules():
        if any(w in name.rsplit(".", 1)[-1] for w in words) and not any(name.startswith(f"{n}.") for n in names):
            names.append(name)
    if not names:
        raise SettingsError(f"no vision module found in model type {model_type!r}; set VLM_QUANTIZE=none")
    head = model.get_output_embeddings()
    return (*names, *(name for name, module in model.named_modules() if module is head))


# =================================================================================================
# Compile cache and weights: what a new worker can reuse
# =================================================================================================

# README "Cold start". The compile artifacts are torch's "mega-cache" bundle, in a file named by the
# cache key. Torch checks its checksum and unpickles it: the folder must be the operator's own.

RUNPOD_VOLUME = "/runpod-volume"
RUNPOD_MODEL_CACHE = "/runpod-volume/huggingface-cache/hub"
COMPILE_ARTIFACTS_SUFFIX = ".torch-artifacts"
_reported_unwritable: set = set()  # folders already reported as unwritable, one log line each


def resolve_model_source(model_id: str, hub_cache: str = RUNPOD_MODEL_CACHE) -> str:
    """Where to load `model_id` from, logged: a local folder, its complete snapshot in RunPod's cache, or the id."""
    from huggingface_hub import errors, snapshot_download
    if os.path.isdir(model_id):
        log.info("weights: %s is a local folder", model_id)
        return model_id
    snapshot = None
    try:
        snapshot = snapshot_download(model_id, cache_dir=hub_cache, local_files_only=True)
    except getattr(errors, "IncompleteSnapshotError", ()):  # huggingface_hub 1.x; the legacy line has 0.x
        pass
    except errors.LocalEntryNotFoundError:  # no refs/main: take the only snapshot, as RunPod's own look-up does
        folder = os.path.join(hub_cache, "models--" + model_id.replace("/", "--"), "snapshots")
        found = [entry.path for entry in os.scandir(folder) if entry.is_dir()] if os.path.isdir(folder) else []
        snapshot = found[0] if len(found) == 1 else None
    except (ValueError, OSError):  # not a valid repo id, or an unreadable tree
        pass
    missing = _missing_model_files(snapshot) if snapshot else []
    if snapshot and not missing:
        log.info("weights: %s from RunPod's cached models (%s)", model_id, snapshot)
        return snapshot
    lacks = f" (RunPod's cached copy lacks {', '.join(missing)})" if missing else ""
    log.log(logging.WARNING if missing else logging.INFO, "weights: %s through HF_HOME or the hub%s", model_id, lacks)
    return model_id


def _missing_model_files(folder: str) -> list[str]:
    """What of config.json, its index's shards and any weights a folder lacks (dangling links too)."""
    present = {entry.name for entry in os.scandir(folder) if entry.is_file()}
    needed = {"config.json"}
    for index in (name for name in present if name.endswith(".index.json")):
        try:
            with open(os.path.join(folder, index), encoding="utf-8") as f:
                needed.update(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            needed.add(f"{index} (unreadable)")
    if not any(name.endswith((".safetensors", ".bin")) for name in present):
        needed.add("weights (*.safetensors)")
    return sorted(needed - present)


def runtime_fingerprint() -> dict:
    """What compiled code depends on besides the model: library versions and the GPU."""
    import importlib.metadata
    import platform

    import torch
    import transformers
    gpu = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": next((d.version for d in importlib.metadata.distributions(name="triton")), None),
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if gpu else "cpu",
            "capability": "{}.{}".format(*torch.cuda.get_device_capability()) if gpu else None}


def compile_cache_key(model_id: str, *, config: Any = None, revision: Optional[str] = None, dtype: Any = None,
                      shapes: Any = (), runtime: Optional[dict] = None) -> str:
    """A readable file name that changes with the model, dtype, compiled shapes and `runtime` (this process's)."""
    runtime = runtime_fingerprint() if runtime is None else runtime
    identity = dict(model=model_id, revision=revision, config=config, dtype=dtype, shapes=shapes, runtime=runtime)

    def plain(value: Any) -> Any:  # what json cannot write: sets (in order), configs, dtypes
        if isinstance(value, (set, frozenset)):
            return sorted(value, key=repr)
        return value.to_dict() if hasattr(value, "to_dict") else str(value)

    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=plain).encode()).hexdigest()[:24]
    parts = [model_id, runtime.get("gpu"), f"torch-{runtime.get('torch')}", digest]
    return "__".join(re.sub(r"[^A-Za-z0-9.+-]+", "_", str(part)).strip("_")[:80] or "none" for part in parts)


def compile_artifact_dirs(settings: Settings, env: Optional[dict] = None) -> list[str]:
    """Artifact folders, preferred first: VLM_COMPILE_CACHE_DIR, else the network volume's; then the container's."""
    env = os.environ if env is None else env
    container = os.path.join(env.get("HF_HOME") or os.path.expanduser("~/.cache/runpod-vlm"), "compile-cache")
    if (env.get("VLM_COMPILE_CACHE_DIR") or "").strip():
        return list(dict.fromkeys([settings.compile_cache_dir, container]))
    volume = [os.path.join(RUNPOD_VOLUME, "vlm-compile-cache")] if os.path.isdir(RUNPOD_VOLUME) else []
    return [*volume, container]


def _first_writable(folders: list[str]) -> Optional[str]:
    """The first of `folders` (made if absent) that takes a file; each that does not is logged once."""
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()  # a read-only volume refuses to make a file
            return folder
        except OSError as error:
            if folder not in _reported_unwritable:
                _reported_unwritable.add(folder)
                log.warning("compile cache: cannot write to %s (%s)", folder, error)
    return None


def set_torch_cache_dirs(settings: Settings, env: Optional[dict] = None) -> None:
    """Unless already set, put inductor's and Triton's caches (where loaded artifacts are unpacked) in
    VLM_COMPILE_CACHE_DIR, else in the container's folder. Call before anything compiles."""
    if settings.compile_cache_dir:
        folder = _first_writable([settings.compile_cache_dir]) or compile_artifact_dirs(settings, env)[-1]
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(folder, "inductor"))
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(folder, "triton"))


def load_compile_artifacts(settings: Settings, key: str, env: Optional[dict] = None) -> bool:
    """Load the artifacts saved under `key` before anything compiles; True when loaded. Never raises."""
    import torch
    set_torch_cache_dirs(settings, env)
    folders = compile_artifact_dirs(settings, env)
    paths = [os.path.join(folder, key + COMPILE_ARTIFACTS_SUFFIX) for folder in folders]
    if not any(map(os.path.exists, paths)):
        log.info("compile cache: no artifacts for %s in %s; compiling from scratch", key, " or ".join(folders))
    for path in filter(os.path.exists, paths):
        try:
            with open(path, "rb") as f:
                payload = f.read()
            info = torch.compiler.load_cache_artifacts(payload)
            if info is None:  # torch logged why: its checksum or unpickling failed
                raise ValueError("torch refused it as corrupt or truncated")
        except Exception as error:
            log.warning("compile cache: ignored %s (%s: %s)", path, type(error).__name__, error)
            continue
        counts = ", ".join(f"{kind} {len(entries)}" for kind, entries in sorted(info.artifacts.items()))
        log.info("compile cache: loaded %s (%.1f MB; %s)", path, len(payload) / 1e6, counts or "empty")
        return True
    return False


def save_compile_artifacts(settings: Settings, key: str, env: Optional[dict] = None) -> Optional[str]:
    """Save what this process compiled under `key` in the first writable folder: the file, or None. Never raises."""
    import torch
    try:
        saved = torch.compiler.save_cache_artifacts()  # None when nothing was compiled
        folder = _first_writable(compile_artifact_dirs(settings, env)) if saved else None
        if folder is None:
            log.info("compile cache: nothing saved (%s)", "no folder writable" if saved else "nothing compiled")
            return None
        path = os.path.join(folder, key + COMPILE_ARTIFACTS_SUFFIX)
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(saved[0])
            os.replace(temporary, path)  # however many workers write, a reader sees one whole file
        except BaseException:
            os.unlink(temporary)
            raise
    except Exception as error:
        log.warning("compile cache: nothing saved (%s: %s)", type(error).__name__, error)
        return None
    log.info("compile cache: saved %s (%.1f MB)", path, len(saved[0]) / 1e6)
    return path


# =================================================================================================
# Model: the engine thread, continuous batching over one static KV cache
# =================================================================================================


def _finish_reason(ids: list[int], eos: set, max_new_tokens: int) -> str:
    return "stop" if any(i in eos for i in ids) else ("length" if len(ids) >= max_new_tokens else "stop")


def _trimmed_length(ids: list[int], eos: set) -> int:
    return next((n for n, token in enumerate(ids) if token in eos), len(ids))


GENERATION_FAILED = RequestError("generation_failed", "the model could not answer this request")
WORKER_STOPPING = RequestError("worker_stopping", "the worker was stopped before this request finished: retry it")
GPU_FAILURE = RequestError("gpu_failure", "the GPU of this worker failed; it is being replaced: retry the request")
_RUNPOD_CONFIG: dict = {}  # the runpod SDK's config (main() fills it): a fatal GPU error sets refresh_worker
COMPILE_AFTER_FIRST_ANSWER_S = 10.0  # a new worker's first job is answered before the background compile slows it


def _is_out_of_memory(error: Exception) -> bool:
    return type(error).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(error)


def _is_fatal_gpu_error(error: Exception) -> bool:
    """CUDA errors after which the context is unusable (unlike out-of-memory, which is recovered)."""
    text = str(error)
    return not _is_out_of_memory(error) and (
        type(error).__name__ == "AcceleratorError"
        or any(s in text for s in ("illegal memory access", "device-side assert", "ECC error", "unspecified launch"))
    )


def _use_grouped_query_decode_attention(model) -> None:
    """Decode steps attend with SDPA's own grouped-query attention. transformers' SDPA path copies
    K/V for every query head (repeat_kv) whenever a mask is passed, which every decode step of a
    batch with rows of different lengths does: at 64 rows that copy was most of the step."""
    text_config = model.config.get_text_config(decoder=True)
    if getattr(text_config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is None or query.shape[2] != 1 or getattr(module, "num_key_value_groups", 1) == 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        import torch
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                                  scale=kwargs.get("scaling"), enable_gqa=True)
        return output.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sdpa_gqa_decode", attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_gqa_decode", sdpa_mask)
    try:  # the text model only: the vision tower keeps its own attention
        model.set_attn_implementation({"text_config": "sdpa_gqa_decode"})
    except Exception:
        log.warning("grouped-query decode attention unavailable; using transformers' SDPA", exc_info=True)


def _beside_fx_traces(forward, rewind=None, **kwargs):
    """`forward(**kwargs)`, run again after a torch.fx trace (inductor's, compiling in the background) patched
    nn.Module.__call__ for the whole process under it; `rewind()` first undoes what the cut-off run moved."""
    import torch
    try:
        return forward(**kwargs)
    except NameError as error:
        if "not installed as a submodule" not in str(error) or (
                torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            raise
    deadline = time.monotonic() + 60
    while torch.nn.Module.__call__ is not torch.nn.Module._wrapped_call_impl and time.monotonic() < deadline:
        time.sleep(0.001)
    if rewind is not None:
        rewind()
    return forward(**kwargs)


def _model_view(model):
    """The model's module tree copied, weights and buffers shared: what a forward sets on a module (Qwen's
    rope_deltas at a prefill) stays apart, so the engine thread cannot change what the compile's guards read."""
    view = copy.copy(model)
    view.__dict__["_modules"] = {name: None if child is None else _model_view(child)
                                 for name, child in model._modules.items()}
    return view


class _OneLayerCache:
    """A compiled decoder layer's cache: its own layer's keys/values whatever index it asks for (dynamo would make the
    index a constant, tracing every layer anew). Layers use nothing else of a cache (transformers 5.17)."""

    def __init__(self, layer):
        self.layer = layer

    def update(self, keys, values, layer_idx, *args, **kwargs):
        return self.layer.update(keys, values, *args, **kwargs)


def _run_layer(compiled_forward, layer, index: int, *args, past_key_values=None, **kwargs):
    if past_key_values is not None:
        past_key_values = _OneLayerCache(past_key_values.layers[index])
    return compiled_forward(layer, *args, past_key_values=past_key_values, **kwargs)


def _with_compiled_layers(view, **options):
    """`view` with its decoder layers compiled (regional compilation): one layer is traced and compiled per shape and
    runs for all, where compiling the whole unrolled model took 35-40 s a shape on the H200."""
    import torch
    layers = getattr(view.get_decoder(), "layers", None) if hasattr(view, "get_decoder") else None
    if not layers:
        return torch.compile(view.__call__, dynamic=False, **options)
    # One compiled function per layer class: dynamo reuses a trace within one function only.
    compiled = {kind: torch.compile(kind.forward, dynamic=False, **options) for kind in set(map(type, layers))}
    for index, layer in enumerate(layers):
        layer.forward = functools.partial(_run_layer, compiled[type(layer)], layer, index)
    return view


class SlotDecoder:
    """Continuous-batching decoding state: `rows` sequences over one static KV cache of `length` slots.

    Every row writes its next token at the same slot (the shared pointer), so a step has fixed shapes
    and replays as one CUDA graph whatever rows join or leave. A new row's prompt is prefilled alone,
    its keys/values copied into the slots just before the pointer; the mask hides the slots a row
    does not own. For room, all rows' slots shift at once (rotary positions live in the keys and per
    row, so a shift changes no result). A step runs the smallest bucket of leading rows holding every
    busy row. Greedy rows give `model.generate(do_sample=False)`'s tokens, alone or beside others."""

    def __init__(self, model, eos_ids: set, rows: int, length: int, use_graph: bool, interval: int):
        import torch
        with torch.inference_mode():  # like every tensor made later, on the engine or compile thread
            self._make_state(model, eos_ids, rows, length, use_graph, interval)

    def _make_state(self, model, eos_ids, rows, length, use_graph, interval) -> None:
        import torch
        device = model.device
        self.model, self.rows, self.length = model, rows, length
        self.use_graph, self.interval = use_graph, interval
        self.buckets = sorted({b for b in (8,) if b < rows} | {rows})
        self.forwards = {bucket: model for bucket in self.buckets}  # `use_forward` swaps in compiled ones
        self.graphs: dict = {}  # (bucket, any sampled row) -> CUDA graph of one step
        self.text_config = copy.copy(model.config.get_text_config(decoder=True))
        self.text_config.sliding_window, self.text_config.layer_types = None, None  # length <= window
        self.caches: dict[int, Any] = {}  # bucket -> StaticCache over the first `bucket` rows
        vocab = model.get_output_embeddings().weight.shape[0]
        self.eos_index = torch.tensor(sorted(i for i in eos_ids if i < vocab), dtype=torch.long, device=device)
        penalty = getattr(model.generation_config, "repetition_penalty", None) or 1.0
        self.penalty = penalty if penalty != 1.0 else None
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.cache_position, self.ring_index = zeros(1), zeros(1)
        self.state = types.SimpleNamespace(
            token=zeros(rows, 1), mask=zeros(rows, length), count=zeros(rows), min_new=zeros(rows),
            sample=zeros(rows, dtype=torch.bool), temperature=zeros(rows, dtype=torch.float),
            top_p=zeros(rows, dtype=torch.float), ring=zeros(rows, interval),
            seen=zeros(rows, vocab, dtype=torch.bool) if self.penalty else None,
        )
        self.position = None  # shaped like the family's position ids at the first prefill
        self.pointer = 0  # the slot the next step writes (host copy of cache_position)
        self.spans: dict[int, tuple[int, int]] = {}  # row -> (first slot, slot past its last token)
        self.any_sample = False
        self.capture_failures = 0  # e.g. voided by the background compile's GPU work

    # ---- admission --------------------------------------------------------------------------

    def free_rows(self) -> list[int]:
        return [row for row in range(self.rows) if row not in self.spans]

    def plan(self, prompt_length: int, max_new_tokens: int) -> Optional[int]:
        """The shift that makes room for a new row (0: none needed), or None if it cannot fit now."""
        if prompt_length + max_new_tokens + self.interval > self.length:
            return None
        if not self.spans:
            return prompt_length - self.pointer
        low, high = min(s for s, _ in self.spans.values()), max(e for _, e in self.spans.values())
        if self.pointer >= prompt_length and self.pointer + max_new_tokens + self.interval <= self.length:
            return 0
        shift = max(prompt_length - self.pointer, -low)
        fits = high + shift <= self.length and self.pointer + shift + max_new_tokens + self.interval <= self.length
        return shift if fits else None

    def shift(self, delta: int) -> None:
        """Move every row's slots by `delta` (negative: left)."""
        import torch
        if delta == 0:
            return
        full = self.caches.get(self.rows)
        for layer in full.layers if full else ():
            layer.keys.copy_(torch.roll(layer.keys, delta, dims=2))
            layer.values.copy_(torch.roll(layer.values, delta, dims=2))
        mask = self.state.mask
        mask.copy_(torch.roll(mask, delta, dims=1))
        if delta > 0:
            mask[:, :delta] = 0  # what wrapped around from the end
        else:
            mask[:, self.length + delta:] = 1  # future slots: hidden by causality until written
        self._set_pointer(self.pointer + delta)
        self.spans = {row: (s + delta, e + delta) for row, (s, e) in self.spans.items()}

    def _set_pointer(self, pointer: int) -> None:
        self.pointer = pointer
        self.cache_position.fill_(pointer)
        for cache in self.caches.values():  # transformers' StaticLayer writes at its own counter
            for layer in cache.layers:
                layer.cumulative_length.fill_(pointer)

    def _allocate(self, keys, values) -> None:
        """The static cache of all rows, shaped from a prefill's keys/values; each smaller bucket's
        cache holds views of its leading rows."""
        import torch
        from transformers import StaticCache
        caches = {}  # kept only whole: an allocation that runs out of memory leaves none
        for bucket in self.buckets:
            caches[bucket] = StaticCache(config=self.text_config, max_cache_len=self.length)
            for layer, k, v in zip(caches[bucket].layers, keys, values):
                layer.lazy_initialization(k[:1].expand(bucket, -1, -1, -1), v[:1].expand(bucket, -1, -1, -1))
        self.caches, full = caches, caches[self.rows]
        for bucket, cache in self.caches.items():
            if bucket != self.rows:
                for layer, whole in zip(cache.layers, full.layers):
                    layer.keys, layer.values = whole.keys[:bucket], whole.values[:bucket]
                    torch._dynamo.mark_static_address(layer.keys)
                    torch._dynamo.mark_static_address(layer.values)
        self._set_pointer(self.pointer)

    def prefill(self, inputs, rows: list[int], params: list[GenerationParams]) -> list[int]:
        """Run new items' prompts (one left-padded batch) and place them in `rows`, whose slots end
        at the pointer (the caller made room with `plan`/`shift`). Returns each row's first token."""
        import torch
        from transformers import DynamicCache
        model, state = self.model, self.state
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        count, prompt_length = input_ids.shape
        # Positions continue from the prompt's exactly as generate() continues them (M-RoPE too).
        position_ids = model._prepare_position_ids_for_generation(input_ids, dict(inputs))

        def forward():  # each try from an empty cache: one cut off midway has some layers' keys already
            scratch = DynamicCache(config=model.config.get_text_config(decoder=True))
            return model(**inputs, position_ids=position_ids, past_key_values=scratch, use_cache=True,
                         logits_to_keep=1), scratch

        output, scratch = _beside_fx_traces(forward)
        if not self.caches:
            self._allocate([layer.keys for layer in scratch.layers], [layer.values for layer in scratch.layers])
        index = torch.tensor(rows, device=input_ids.device)
        start, end = self.pointer - prompt_length, self.pointer
        for layer, new in zip(self.caches[self.rows].layers, scratch.layers):
            layer.keys[index, :, start:end] = new.keys
            layer.values[index, :, start:end] = new.values
        state.mask[index] = 0
        state.mask[index, start:end] = attention_mask
        state.mask[index, end:] = 1
        if self.position is None:
            shape = list(position_ids.shape)
            shape[-2], shape[-1] = self.rows, 1
            self.position = torch.zeros(shape, dtype=position_ids.dtype, device=position_ids.device)
        self.position.index_copy_(-2, index, position_ids[..., -1:] + 1)

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=index.device)

        new = types.SimpleNamespace(
            count=torch.zeros(count, dtype=torch.long, device=index.device), seen=None,
            min_new=column([p.min_new_tokens for p in params], torch.long),
            sample=column([p.do_sample for p in params], torch.bool),
            temperature=column([p.temperature for p in params], torch.float),
            top_p=column([p.top_p for p in params], torch.float))
        if self.penalty:
            new.seen = torch.zeros((count, state.seen.shape[1]), dtype=torch.bool, device=index.device)
            new.seen.scatter_(1, input_ids, True)
        token = self._choose(output.logits[:, -1, :], new, any_sample=any(p.do_sample for p in params))
        for name in ("min_new", "sample", "temperature", "top_p", "seen"):
            if getattr(new, name) is not None:
                getattr(state, name)[index] = getattr(new, name)
        state.token[index] = token[:, None]
        state.count[index] = 1
        for row, p in zip(rows, params):
            self.spans[row] = (start, end + p.max_new_tokens + self.interval)
        self._update_any_sample()
        return token.tolist()

    def release(self, row: int) -> None:
        """Free a row: its slots are hidden from now on and it may be given to a new item."""
        self.spans.pop(row, None)
        self.state.mask[row, : self.pointer] = 0
        self._update_any_sample()

    def _update_any_sample(self) -> None:
        self.any_sample = bool(self.state.sample[sorted(self.spans)].any()) if self.spans else False

    # ---- decoding ---------------------------------------------------------------------------

    def _choose(self, logits, rows: types.SimpleNamespace, any_sample: bool):
        """Each row's next token from its logits."""
        import torch
        logits = logits.float()
        if rows.seen is not None:  # as transformers' RepetitionPenaltyLogitsProcessor
            penalized = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = torch.where(rows.seen, penalized, logits)
        if self.eos_index.numel():  # no end token before min_new_tokens
            early = (rows.count < rows.min_new)[:, None]
            logits[:, self.eos_index] = logits[:, self.eos_index].masked_fill(early, float("-inf"))
        token = logits.argmax(dim=-1)
        if any_sample:
            token = torch.where(rows.sample, self._sampled(logits, rows.temperature, rows.top_p), token)
        if rows.seen is not None:
            rows.seen.scatter_(1, token[:, None], True)
        return token

    @staticmethod
    def _sampled(logits, temperature, top_p):
        """Temperature and top-p sampling, drawn as argmax(p / Exp(1)) so a CUDA graph can hold it."""
        import torch
        probs = torch.softmax(logits / temperature.clamp(min=1e-5)[:, None], dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p[:, None]
        probs = probs.scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
        return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)

    def _rows_of(self, bucket: int) -> types.SimpleNamespace:
        """The per-row tensors of the first `bucket` rows, as views."""
        return types.SimpleNamespace(**{k: v if v is None else v[:bucket] for k, v in vars(self.state).items()})

    def _advance(self, bucket: int) -> None:
        """One step of the first `bucket` rows: their last tokens go through the model, the next
        are chosen."""
        rows = self._rows_of(bucket)
        position = self.position[..., :bucket, :]
        cache = self.caches[bucket]  # each layer counts its writes: a step cut off midway moved some counters
        output = _beside_fx_traces(
            self.forwards[bucket], lambda: [n.cumulative_length.copy_(self.cache_position[0]) for n in cache.layers],
            input_ids=rows.token, attention_mask=rows.mask, position_ids=position, past_key_values=cache,
            cache_position=self.cache_position, use_cache=True, logits_to_keep=1)
        token = self._choose(output.logits[:, -1, :], rows, self.any_sample)
        rows.ring.index_copy_(1, self.ring_index, token[:, None])
        self.ring_index += 1
        rows.count += 1
        rows.token.copy_(token[:, None])
        position += 1
        self.cache_position += 1

    def bucket(self) -> int:
        busy = max(self.spans, default=0) + 1
        return next(b for b in self.buckets if b >= busy)

    def step(self, steps: int) -> list[list[int]]:
        """Run `steps` (at most `interval`) decode steps; each busy bucket row's new tokens."""
        bucket = self.bucket()
        self._set_pointer(self.pointer)  # another bucket's steps moved only its own counters
        self.ring_index.zero_()
        graph = self.graphs.get((bucket, self.any_sample))
        for _ in range(steps):
            graph.replay() if graph is not None else self._advance(bucket)
        self.pointer += steps
        tokens = self.state.ring[:bucket, :steps].tolist()
        if self.use_graph and graph is None and self.spans and self.pointer < self.length:
            try:
                self._capture(bucket)
            except Exception:  # still correct without the graph, only slower; tried again at later steps
                self.capture_failures += 1
                log.warning("CUDA graph capture failed (%d of 3 tries)", self.capture_failures, exc_info=True)
                self.use_graph = self.capture_failures < 3
        return tokens

    def use_forward(self, bucket: int, forward) -> None:
        """Step `bucket` with another forward (the compiled one); its graphs are recorded anew."""
        self.forwards[bucket] = forward
        self.graphs = {key: graph for key, graph in self.graphs.items() if key[0] != bucket}

    def _capture(self, bucket: int) -> None:
        """Record one step as a CUDA graph; the steps run to record it write only the pointer's slot."""
        import torch
        state = self.state  # what the recording steps advance, put back after
        kept = [(t, t.clone()) for t in (state.token, self.position, state.count, state.seen) if t is not None]
        pointer = self.pointer
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._set_pointer(pointer)
                self.ring_index.zero_()
                self._advance(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        self._set_pointer(pointer)
        self.ring_index.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._advance(bucket)
        self._set_pointer(pointer)
        for tensor, value in kept:
            tensor.copy_(value)
        self.graphs[(bucket, self.any_sample)] = graph


class Engine:
    """The loaded model, its processor and family adapter. One per process."""

    def __init__(self, settings: Settings, quantize: Optional[str] = None):
        self.settings = settings
        self.model_id = settings.model
        self.quantize = quantize or settings.quantize
        self._compiled_forward = None
        self.broken = False  # a fatal GPU error happened: nothing more runs here
        self._stop_by: Optional[float] = None  # after SIGTERM: when the items still running fail
        self._compiled_shapes: set = set()  # (bucket, cache length) compiled in the background
        self._newly_compiled: list = []  # ... ready, not yet switched to by the engine thread
        self._answered = threading.Event()  # set at the first answer; the background compile waits for it
        self._load()
        self._wake = threading.Condition()  # guards the queue; the engine thread waits on it
        self._queue: list[Ticket] = []  # submitted, not yet given a row, in arrival order
        self._rows: dict[int, Ticket] = {}  # decoder row -> the item decoding there (engine thread only)
        self._thread: Optional[threading.Thread] = None
        self._decoder: Optional[SlotDecoder] = None

    # ---- loading ----------------------------------------------------------------------------

    def _check_allowed(self) -> None:
        if self.model_id in CURATED_MODELS or self.settings.allow_any:
            return
        raise SettingsError(
            f"VLM_MODEL={self.model_id!r} is not on the curated list "
            f"({', '.join(CURATED_MODELS)}); set VLM_ALLOW_ANY=true to serve it anyway"
        )

    def _torch_dtype(self):
        import torch
        choice = self.settings.dtype
        if choice == "auto":
            if torch.cuda.is_available():
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return torch.float32
        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[choice]

    def quantization_config(self, dtype):
        """bitsandbytes settings that keep the vision tower and projector in full precision."""
        if self.quantize == "none":
            return None
        from transformers import BitsAndBytesConfig
        skip = list(self.adapter.quantization_skip_modules)
        if self.quantize == "4bit":
            return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=skip)
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)

    def _load(self) -> None:
        from transformers import AutoConfig
        self._check_allowed()
        started = time.perf_counter()
        trust = self.settings.trust_remote_code
        source = resolve_model_source(self.model_id)  # RunPod's cached copy when it has one
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
        self.model_type = config.model_type
        self.adapter = adapter_for(self.model_type)
        if not self.adapter.native and not trust:
            raise SettingsError(
                f"{self.model_id} ({self.adapter.name}) needs its repository's code: "
                "set VLM_TRUST_REMOTE_CODE=true"
            )
        dtype = self._torch_dtype()
        self.dtype = dtype
        import transformers

        # transformers 4.x (which the remote-code families need) calls the dtype `torch_dtype`.
        dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        load_kwargs = {dtype_key: dtype, "device_map": self.settings.device_map, "trust_remote_code": trust}
        quantization = self.quantization_config(dtype)
        if quantization is not None:
            load_kwargs["quantization_config"] = quantization
        if self.adapter.native:
            options = dict(trust_remote_code=trust, **self.adapter.processor_kwargs(self.settings))
            self.processor = transformers.AutoProcessor.from_pretrained(source, **options)
            self.processor.tokenizer.padding_side = "left"
            self.model = getattr(transformers, self.adapter.model_class).from_pretrained(source, **load_kwargs).eval()
        else:
            self.model, self.processor = self.adapter.load(source, load_kwargs)
        self.adapter.after_load(self.model, self.processor, source)
        self.eos_ids = end_tokens(self.model, self.tokenizer)
        text_config = self.model.config.get_text_config(decoder=True)
        self.context_length = getattr(text_config, "max_position_embeddings", None)
        self.use_graphs = self._cuda_graphs_possible()
        self.compile = self.use_graphs and self.settings.compile
        # Rows join and leave a running batch through one static cache; sliding-window layers and remote-code
        # chat() APIs cannot, and answer one item at a time; nor can LongRoPE (Phi-4), whose factors switch on the
        # highest position in a batch, a free row's too. A window no shorter than the cache attends like full attention.
        window = getattr(text_config, "sliding_window", None)
        kinds = set(getattr(text_config, "layer_types", None) or (["sliding_attention"] if window else []))
        self.max_slots = window if "sliding_attention" in kinds else None
        longrope = (getattr(text_config, "rope_parameters", None) or {}).get("rope_type") == "longrope"
        self.continuous = (
            self.adapter.native and kinds <= {"full_attention", "sliding_attention"} and not longrope
            and (self.max_slots is None or self.max_slots >= self.settings.cache_len)
        )
        if self.continuous and self.use_graphs:  # a GPU speed-up; CPU runs keep transformers' SDPA
            _use_grouped_query_decode_attention(self.model)
        log.info("loaded %s (%s) in %.1fs", self.model_id, self.adapter.name, time.perf_counter() - started)

    @property
    def decoder(self) -> SlotDecoder:
        if self._decoder is None:
            self._decoder = self._new_decoder(self.settings.cache_len)
        return self._decoder

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    def _cuda_graphs_possible(self) -> bool:
        import torch
        on_cuda = torch.cuda.is_available() and str(self.model.device).startswith("cuda")
        return bool(self.quantize == "none" and self.adapter.native and on_cuda)

    # ---- generation: the engine thread ------------------------------------------------------

    def sampling_kwargs(self, params: GenerationParams) -> dict:
        kwargs: dict = {"max_new_tokens": params.max_new_tokens, "do_sample": params.do_sample}
        if params.do_sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if params.min_new_tokens:
            kwargs["min_new_tokens"] = params.min_new_tokens
        return kwargs

    def submit(self, item: GenerationRequest, listener: Callable[[Any], None], stream: bool = False) -> Ticket:
        """Queue an item. `listener` is called from the engine thread with StreamDelta events (when
        `stream`) and then exactly once with the final Generation or RequestError."""
        return self.submit_all([item], [listener], stream)[0]

    def submit_all(self, items: list[GenerationRequest], listeners: list, stream: bool = False) -> list[Ticket]:
        """Queue items together (a batch call's): they are admitted together when rows allow."""
        tickets = [Ticket(item, listener, stream) for item, listener in zip(items, listeners)]
        if self.broken:
            return [ticket.fail(GPU_FAILURE) for ticket in tickets]
        with self._wake:
            self._queue.extend(tickets)
            self._wake.notify()
            self._start_thread()
        return tickets

    def _start_thread(self) -> None:
        """Start the engine thread once (call with `_wake` held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="vlm-engine", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """The engine thread: admit queued items at step boundaries, decode, hand out tokens."""
        import torch
        with torch.inference_mode():
            self._serve_forever()

    def _serve_forever(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._rows and not self._newly_compiled:
                    self._wake.wait()
                self._queue = [t for t in self._queue if not t.cancelled]
                waiting = list(self._queue)
            try:
                if not self.continuous:
                    if waiting:
                        self._take(waiting[:1])
                        self._run_alone(waiting[0])
                    continue
                if self._stop_by is not None and time.monotonic() >= self._stop_by:
                    self._fail_all(WORKER_STOPPING, queued=True)
                if self._newly_compiled:
                    self._switch_to_compiled()
                self._admit(waiting)
                if self._rows:
                    self._decode_interval()
            except Exception as error:
                if _is_fatal_gpu_error(error):
                    self._gpu_failed()
                    continue
                log.exception("the engine failed a step; failing the items in flight (the queued ones if none)")
                self._fail_all(GENERATION_FAILED, queued=not self._rows)  # else the same failure would come again

    def _take(self, tickets: list[Ticket]) -> None:
        with self._wake:
            self._queue = [t for t in self._queue if t not in tickets]

    def _run_alone(self, ticket: Ticket) -> None:
        """Families outside continuous batching (remote code, sliding-window caches): one at a time."""
        item = ticket.item
        try:
            if self.adapter.native:
                ticket.finish(self._generate_with_generate(item))
            else:
                ticket.finish(self.adapter.run(self.model, self.processor, item, self.sampling_kwargs(item.params)))
        except RequestError as error:
            ticket.finish(error)
        except Exception:
            log.exception("generation failed")
            ticket.fail(GENERATION_FAILED)

    def _generate_with_generate(self, item: GenerationRequest):
        import torch
        inputs, input_sizes = self.adapter.batch_inputs(self.processor, [item], self.model.device, self.dtype)
        prompt_tokens = int(inputs["attention_mask"].sum())
        error = self._context_error(item, prompt_tokens)
        if error:
            return error
        with torch.inference_mode():
            out = self.model.generate(**inputs, eos_token_id=sorted(self.eos_ids), **self.sampling_kwargs(item.params))
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        return self._generation(item, ids, prompt_tokens, input_sizes[0])

    def _admit(self, waiting: list[Ticket]) -> None:
        """Prefill as many waiting items as fit (in arrival order) and give them rows."""

        decoder = self.decoder
        free = decoder.free_rows()
        if not waiting or not free:
            return
        size = min(len(free), *(t.group_limit or len(free) for t in waiting[: len(free)]))
        group = waiting[:size]
        self._take(group)
        try:
            self._place(group, free)
        except Exception as error:
            fatal = _is_fatal_gpu_error(error)
            if fatal:
                self._gpu_failed()
            else:
                log.exception("could not admit %d items", len(group))
            with self._wake:
                lost = [t for t in group if t.row is None and t not in self._queue]
            for ticket in lost:
                ticket.fail(GPU_FAILURE if fatal else GENERATION_FAILED)

    def _place(self, group: list[Ticket], free: list[int]) -> None:
        import torch
        decoder = self.decoder
        try:
            items = [t.item for t in group]
            inputs, input_sizes = self.adapter.batch_inputs(self.processor, items, self.model.device, self.dtype)
        except Exception as error:
            if len(group) > 1:  # find the bad item: each is prepared alone
                return self._requeue(group, limit=1)
            if isinstance(error, RequestError):  # the family's adapter refused it
                return group[0].finish(error)
            return self._admit_failed(group[0])
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        errors = [self._context_error(t.item, n) for t, n in zip(group, prompt_tokens)]
        if any(errors):
            for ticket, error in zip(group, errors):
                if error:
                    ticket.finish(error)
            self._requeue([t for t, e in zip(group, errors) if not e])
            return
        prompt_length = inputs["input_ids"].shape[1]
        longest = max(t.item.params.max_new_tokens for t in group)
        shift = decoder.plan(prompt_length, longest)
        if shift is None:
            if len(group) > 1:  # a smaller group (shorter padding, fewer tokens) may fit
                return self._requeue(group, limit=len(group) // 2)
            if not self._rows:  # alone and still too long: a decoder with a longer cache
                length = decoder.length
                while length < prompt_length + longest + decoder.interval:
                    length *= 2
                if self.max_slots is not None and length > self.max_slots:
                    return self._run_alone(group[0])  # past the sliding window: generate() handles it
                self._decoder = self._new_decoder(length)
                return self._requeue(group)
            return self._requeue(group)  # waits for rows to finish
        decoder.shift(shift)
        rows = free[: len(group)]
        try:
            first = decoder.prefill(inputs, rows, [t.item.params for t in group])
        except Exception as error:
            for row in rows:
                decoder.release(row)
            if _is_fatal_gpu_error(error):
                raise
            if _is_out_of_memory(error):
                if not decoder.caches and decoder.length > self.settings.cache_len:
                    self._decoder = None  # a cache grown for a long request does not fit: back to the usual one
                torch.cuda.empty_cache()
                if len(group) > 1:  # halves, down to single items
                    log.warning("a prefill of %d items ran out of GPU memory; retrying in halves", len(group))
                    return self._requeue(group, limit=len(group) // 2)
                return group[0].finish(RequestError(
                    "out_of_memory", f"this request ({prompt_tokens[0]} prompt tokens with its "
                    f"{len(group[0].item.images)} images) does not fit in the GPU's free memory", group[0].item.param))
            if len(group) > 1:
                log.warning("a prefill of %d items failed; admitting them one by one", len(group), exc_info=True)
                return self._requeue(group, limit=1)
            return self._admit_failed(group[0])
        for ticket, row, token, prompt, size in zip(group, rows, first, prompt_tokens, input_sizes):
            ticket.row, ticket.prompt_tokens, ticket.input_size = row, prompt, size
            self._rows[row] = ticket
            self._accept(ticket, [token])

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
        decoder = self.decoder
        remaining = max(t.item.params.max_new_tokens - len(t.ids) for t in self._rows.values())
        tokens = decoder.step(max(1, min(decoder.interval, remaining)))
        for row, ticket in list(self._rows.items()):
            self._accept(ticket, tokens[row])

    def _accept(self, ticket: Ticket, tokens: list[int]) -> None:
        """New tokens for a row: stream them, and finish the row at its end token or length."""
        item, done = ticket.item, ticket.cancelled
        for token in tokens:
            if done:
                break
            ticket.ids.append(token)
            done = token in self.eos_ids or len(ticket.ids) >= item.params.max_new_tokens
        if ticket.stream and not ticket.cancelled:
            ticket.emit_delta(self.tokenizer, self.eos_ids)
        if done:
            self._answered.set()
            self.decoder.release(ticket.row)
            del self._rows[ticket.row]
            if not ticket.cancelled:
                ticket.finish(self._generation(item, ticket.ids, ticket.prompt_tokens, ticket.input_size))

    def _fail_all(self, error: RequestError, queued: bool = False) -> None:
        """Fail the items in flight (and the queued ones too when `queued`)."""
        with self._wake:
            waiting, self._queue = (self._queue, []) if queued else ([], self._queue)
        for row, ticket in list(self._rows.items()):
            self.decoder.release(row)
            ticket.fail(error)
        self._rows.clear()
        for ticket in waiting:
            ticket.fail(error)

    def _gpu_failed(self) -> None:
        """A fatal CUDA error (illegal access, device-side assert, ECC): the context is unusable. Every
        item fails with `gpu_failure`, later ones at once, and RunPod replaces the worker."""
        log.critical("fatal GPU error: failing every request and asking RunPod for a new worker", exc_info=True)
        self.broken = True
        _RUNPOD_CONFIG["refresh_worker"] = True  # the SDK reads it after each job: stop this worker
        self._fail_all(GPU_FAILURE, queued=True)

    def _generation(self, item: GenerationRequest, ids: list[int], prompt_tokens: int, input_size) -> Generation:
        ids = ids[: item.params.max_new_tokens]
        kept = ids[: _trimmed_length(ids, self.eos_ids)]
        return Generation(
            text=self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
            # Grounding reads boxes between special tokens (Qwen's <|box_start|>...).
            raw_text=self.tokenizer.decode(kept, skip_special_tokens=False) if item.task == "grounding" else None,
            finish_reason=_finish_reason(ids, self.eos_ids, item.params.max_new_tokens),
            prompt_tokens=int(prompt_tokens), completion_tokens=len(kept), image_input_size=input_size)

    def _context_error(self, item: GenerationRequest, prompt_tokens: int) -> Optional[RequestError]:
        if self.context_length and prompt_tokens + item.params.max_new_tokens > self.context_length:
            return RequestError("context_too_long", f"the prompt ({prompt_tokens} tokens, images included) plus "
                                f"max_new_tokens ({item.params.max_new_tokens}) exceed the model's context of "
                                f"{self.context_length} tokens", _join(item.param, "max_new_tokens"))

    # ---- the decoder and its compiled step ----------------------------------------------------

    def _new_decoder(self, length: int) -> SlotDecoder:
        decoder = SlotDecoder(self.model, self.eos_ids, rows=self.settings.max_batch_size, length=length,
                              use_graph=self.use_graphs, interval=self.settings.sync_interval)
        for bucket in decoder.buckets:
            if (bucket, length) in self._compiled_shapes:
                decoder.use_forward(bucket, self._compiled_forward)
        missing = [b for b in decoder.buckets if (b, length) not in self._compiled_shapes]
        if self.compile and missing:
            self._compile_in_background(missing, length)
        return decoder

    def _switch_to_compiled(self) -> None:
        """At a step boundary: buckets whose compiled forward is ready decode with it from now on."""
        with self._wake:
            ready, self._newly_compiled = self._newly_compiled, []
        for bucket, length in ready:
            if self._decoder is not None and self._decoder.length == length:
                self._decoder.use_forward(bucket, self._compiled_forward)
                log.info("decoding %d-row steps with the compiled forward from now on", bucket)

    def _compile_in_background(self, buckets: list[int], length: int) -> None:
        """Compile a decoder's shapes in a background thread (from saved artifacts when they match);
        decoding goes on with CUDA graphs of the plain forward, and switches at a step boundary."""
        if self._compiled_forward is None:
            set_torch_cache_dirs(self.settings)
            # Inductor's kernel-compiling processes made prefills 12x slower, compiling no faster (bench/contention.py).
            options = {} if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") else {"options": {"compile_threads": 1}}
            self._compiled_forward = _with_compiled_layers(_model_view(self.model), **options)
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-compile")
        future = self._compiler.submit(self._compile_shapes, buckets, length)
        future.add_done_callback(lambda f: f.exception() and log.error(
            "background compilation failed; decoding stays uncompiled", exc_info=f.exception()))

    def _compile_shapes(self, buckets: list[int], length: int) -> None:
        self._answered.wait(COMPILE_AFTER_FIRST_ANSWER_S)
        rows, interval = self.settings.max_batch_size, self.settings.sync_interval
        key = compile_cache_key(self.model_id, config=self.model.config, dtype=self.dtype,
                                shapes={"rows": rows, "buckets": buckets, "cache_len": length, "interval": interval,
                                        "compiled": "decoder layers"})  # older artifacts hold a whole model
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)  # tracing holds the GIL: the engine thread takes it back within 0.5 ms, not 5
        try:
            loaded = load_compile_artifacts(self.settings, key)  # never raises: a bad file is skipped
            done = [(bucket, length) for bucket in buckets  # a second try: a CUDA graph capture may void the first
                    if self._compile_shape(bucket, length) or self._compile_shape(bucket, length)]
            if len(done) == len(buckets) and not loaded:
                save_compile_artifacts(self.settings, key)
        finally:
            sys.setswitchinterval(switch_interval)
        # All shapes switch at once: compiled code run while another shape is traced fails (process-wide state).
        with self._wake:
            self._compiled_shapes.update(done)
            self._newly_compiled.extend(done)
            self._wake.notify()

    def _compile_shape(self, bucket: int, length: int) -> bool:
        """Trace and compile one decode shape on a shadow decoder of the same shapes (own buffers),
        so the engine's own state is never touched from this thread."""
        import torch
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                shadow = SlotDecoder(_model_view(self.model), self.eos_ids, rows=self.settings.max_batch_size,
                                     length=length, use_graph=False, interval=self.settings.sync_interval)
                params = GenerationParams(max_new_tokens=4, temperature=0.0, top_p=1.0, do_sample=False)
                items = [GenerationRequest("chat", [Turn("user", ["warm up"])], params)] * bucket
                inputs, _ = self.adapter.batch_inputs(self.processor, items, self.model.device, self.dtype)
                shadow.shift(shadow.plan(inputs["input_ids"].shape[1], params.max_new_tokens))
                shadow.prefill(inputs, list(range(bucket)), [params] * bucket)
                shadow.use_forward(bucket, self._compiled_forward)
                for _ in range(2):
                    shadow._advance(bucket)
                torch.cuda.synchronize()
        except Exception:
            log.warning("compiling the %d-row decode step failed; it stays uncompiled", bucket, exc_info=True)
            return False
        log.info("compiled the %d-row decode step in the background in %.1fs", bucket, time.perf_counter() - started)
        return True

    def warm_up(self) -> None:
        """Start compiling the decode step in the background; the engine switches shape by shape."""
        if self.continuous and self.compile:
            self.decoder  # noqa: B018 (creating it queues the compilation of its shapes)
            with self._wake:
                self._start_thread()

    def stop_after(self, grace: float) -> None:
        """Items still running `grace` seconds from now fail with `worker_stopping` (on SIGTERM)."""
        with self._wake:
            self._stop_by = time.monotonic() + grace
            self._wake.notify()

    def wait_until_compiled(self, timeout: float) -> bool:
        """Whether every shape of the current decoder decodes compiled (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        while not ((decoder := self._decoder) and all(f is self._compiled_forward for f in decoder.forwards.values())):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


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
        kept = self.ids[: _trimmed_length(self.ids, eos_ids)]
        text = tokenizer.decode(kept, skip_special_tokens=True).strip()
        delta = ""
        # Half of a multi-byte character waits for the rest; a text that changed behind what was
        # sent (tokenizers may merge) sends nothing until the final answer settles it.
        if not text.endswith("\ufffd") and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
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


_engine: Optional[Engine] = None
_engine_lock = threading.Lock()


def get_engine(quantize: Optional[str] = None) -> Engine:
    """The process's engine, loaded on first use with `quantize` if the caller asked for one."""
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                _engine = Engine(Settings.from_env(), quantize=quantize)
    return _engine


def reset_engine() -> None:
    """Forget the loaded model (tests, and a worker that must reload)."""
    global _engine
    _engine = None


# =================================================================================================
# Answers: engine results for the handler, boxes, output fields
# =================================================================================================

def generate_all(engine: Engine, items: list[GenerationRequest]) -> list[Outcome]:
    """Answer items through the engine, beside other jobs' items, in input order; blocks the calling thread."""
    results: list[Optional[Outcome]] = [None] * len(items)
    finished = threading.Semaphore(0)

    def on_event(index: int, event) -> None:
        if not isinstance(event, StreamDelta):
            results[index] = event
            finished.release()

    engine.submit_all(items, [functools.partial(on_event, index) for index in range(len(items))])
    for _ in items:
        finished.acquire()
    return results  # type: ignore[return-value]


async def stream_generation(engine: Engine, item: GenerationRequest, stream: bool = True):
    """Yields StreamDelta events (when `stream`), then the Generation or RequestError; leaving early cancels it."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    ticket = engine.submit(item, lambda event: loop.call_soon_threadsafe(events.put_nowait, event), stream)
    try:
        while True:
            event = await events.get()
            yield event
            if not isinstance(event, StreamDelta):
                return
    finally:
        ticket.cancel()  # no effect once finished; otherwise frees its row at the next step


async def generate_one(engine: Engine, item: GenerationRequest) -> Outcome:
    """The final Generation or RequestError of one item."""
    return [event async for event in stream_generation(engine, item, stream=False)][-1]


def format_output(engine: Engine, item: GenerationRequest, generation: Generation, request: RequestModel) -> dict:
    output = {"response": generation.text, "model": engine.model_id, "task": item.task,
              "image_count": len(item.images), "finish_reason": generation.finish_reason,
              "usage": {"prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens}}
    if item.task == "grounding":
        output.update(grounding_fields(item, generation, engine.adapter))
    if request.batch_images is not None:
        output["batch_images"] = request.batch_images
    if request.quantize is not None and request.quantize != engine.quantize:
        output.update(quantize=engine.quantize, quantize_warning=f"the model was loaded as {engine.quantize!r}; "
                      f"the requested {request.quantize!r} applies only when a request loads the model "
                      "(VLM_LOAD_AT_BOOT=false)")
    return output


# Each family answers boxes in its own words and its own coordinates (`FamilyAdapter.grounding`):
#   qwen-1000        Qwen2-VL: <|object_ref_start|>dog<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>;
#                    Qwen3-VL: [{"bbox_2d": [x1, y1, x2, y2], "label": "dog"}]; both relative, 0-1000
#   qwen-abs-pixels  Qwen2.5-VL: the same JSON, in pixels of the resized model input
#   paligemma-1024   PaliGemma: <loc{y1}><loc{x1}><loc{y2}><loc{x2}> dog ; ...  (bins of 1024)
#   glm-1000         GLM-4.1V: <|begin_of_box|>[[x1,y1,x2,y2], ...]<|end_of_box|>, any brackets; relative, 0-1000

_NUMBER = r"-?\d+(?:\.\d+)?"
_QUARTET = rf"({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})"
_QWEN_BOX = re.compile(r"(?:<\|object_ref_start\|>(.*?)<\|object_ref_end\|>\s*)?"
                       r"<\|box_start\|>(.*?)(?:<\|box_end\|>|$)", re.S)
_GLM_BOXES = re.compile(r"<\|begin_of_box\|>(.*?)(?:<\|end_of_box\|>|$)", re.S)
_THINKING = re.compile(r"<think>.*?(?:</think>|$)", re.S)  # a reasoning model's thoughts: not its answer
_LOC_BOX = re.compile(r"<loc(\d{4})><loc(\d{4})><loc(\d{4})><loc(\d{4})>\s*([^;<]*)")
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")  # flat objects: found one by one, even in a cut-off answer
_JSON_BOX = re.compile(rf'"(?:bbox_2d|bbox|box_2d)"\s*:\s*\[\s*{_QUARTET}\s*\]')
_JSON_LABEL = re.compile(r'"label"\s*:\s*"((?:[^"\\]|\\.)*)"')
_POINT_PAIR = re.compile(rf"\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)\s*,?\s*\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)")
_LIST_BOX = re.compile(rf"\[\s*{_QUARTET}\s*\]")


def _ordered(values) -> list[float]:
    x1, y1, x2, y2 = (float(v) for v in values)
    return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]


def _json_label(obj: str) -> Optional[str]:
    written = next(iter(_JSON_LABEL.findall(obj)), "")
    with contextlib.suppress(ValueError):  # an escape JSON does not know: keep the label as written
        return json.loads(f'"{written}"') or None
    return written


def parse_boxes(text: Optional[str]) -> list[tuple[list[float], Optional[str]]]:
    """Every (box, label or None) in an answer, boxes as [x1, y1, x2, y2] in the model's coordinates.
    The first format found wins, in the order below; last, a single plain quartet of numbers."""
    text, boxes, label = _THINKING.sub("", text or ""), [], None
    for match in _QWEN_BOX.finditer(text):  # a label holds for the boxes after it
        label = match.group(1).strip() if match.group(1) is not None else label
        numbers = re.findall(_NUMBER, match.group(2))
        if len(numbers) == 4:
            boxes.append((_ordered(numbers), label or None))
    boxed = [re.findall(_NUMBER, inside) for inside in _GLM_BOXES.findall(text)]  # four numbers a box, any brackets
    boxes = boxes or [(_ordered(numbers[i:i + 4]), None) for numbers in boxed for i in range(0, len(numbers) - 3, 4)]
    boxes = boxes or [(_ordered([x1, y1, x2, y2]), name.strip() or None)
                      for y1, x1, y2, x2, name in _LOC_BOX.findall(text)]
    boxes = boxes or [(_ordered(box.groups()), _json_label(obj))
                      for obj in _JSON_OBJECT.findall(text) if (box := _JSON_BOX.search(obj))]
    for pattern in (_POINT_PAIR, _LIST_BOX):
        boxes = boxes or [(_ordered(numbers), None) for numbers in pattern.findall(text)]
    return boxes or [(_ordered(numbers), None) for numbers in re.findall(_QUARTET, text)[:1]]


def parse_bbox(text: Optional[str]) -> Optional[list[float]]:
    """The first box in a model's answer, as [x1, y1, x2, y2] in the model's own coordinates."""
    return next((box for box, _ in parse_boxes(text)), None)


def box_to_pixels(box: list[float], system: Optional[str], size: tuple[int, int],
                  input_size: Optional[tuple[int, int]] = None) -> list[int]:
    """Scale a box from the model's coordinate system to the original image's pixels, clamped."""
    frame = {"qwen-1000": (1000, 1000), "glm-1000": (1000, 1000), "paligemma-1024": (1024, 1024),
             "qwen-abs-pixels": input_size}.get(system)
    frame_width, frame_height = frame or ((1, 1) if max(box) <= 1.0 else size)  # no frame: normalised or pixels
    scales, limits = (size[0] / frame_width, size[1] / frame_height) * 2, tuple(size) * 2
    return [int(round(min(max(v * scale, 0), limit))) for v, scale, limit in zip(box, scales, limits)]


def grounding_fields(item: GenerationRequest, generation: Generation, adapter: FamilyAdapter) -> dict:
    """Every box in the first image's pixels with its label, the first as `bbox`; drawn on request."""
    if adapter.grounding is None:
        return {"bbox": None, "supports_grounding": False,
                "bbox_warning": f"the {adapter.name} family has no grounding output; see response"}
    image, input_size = item.images[0], generation.image_input_size
    boxes = [{"bbox": box_to_pixels(box, adapter.grounding, image.size, input_size), "label": label}
             for box, label in parse_boxes(generation.raw_text or generation.text)]
    fields = {"bbox": boxes[0]["bbox"] if boxes else None, "supports_grounding": True,
              "box_format": adapter.grounding, "image_size": list(image.size), "boxes": boxes}
    if not boxes:
        fields["bbox_warning"] = "no bounding box found in the model's answer"
    if item.annotate:
        fields["annotated_image"] = annotated_image(image, boxes)
    return fields


def annotated_image(image, boxes: list[dict]) -> str:
    """The image with each box outlined and labelled, as a PNG data URI."""
    from PIL import ImageDraw
    canvas = image.convert("RGB")  # a copy: the request's image stays as it was
    draw = ImageDraw.Draw(canvas)
    line = max(2, round(min(canvas.size) / 200))
    colours = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45")
    for box, colour in zip(boxes, colours * len(boxes)):  # the colours in turn
        draw.rectangle(box["bbox"], outline=colour, width=line)
        if box["label"]:
            corner = (box["bbox"][0] + line, box["bbox"][1] + line)
            left, top, right, bottom = draw.textbbox(corner, box["label"])
            draw.rectangle((left - line, top - line, right + line, bottom + line), fill=colour)
            draw.text(corner, box["label"], fill="white")
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


# =================================================================================================
# OpenAI route: RunPod's /openai/v1 jobs
# =================================================================================================

# RunPod's gateway turns calls to .../openai/v1/... into jobs with input {"openai_route": "/v1/chat/completions",
# "openai_input": <the body>} (GET /v1/models has none). The body becomes a native request read by `read_request`
# (the same validation, media policy, limits and error codes); answers and errors take OpenAI's shapes.

# Fields this worker cannot honour, accepted at neutral values only (ignoring others would answer another question).
OPENAI_UNSUPPORTED = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "logprobs": (False,),
    "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "modalities": (["text"],), "audio": (), "prediction": (),
    "web_search_options": (), "moderation": (), "reasoning_effort": (), "verbosity": ()}
# Accepted and ignored (`seed` too: sampled rows share the engine's random generator).
OPENAI_IGNORED = ("seed", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_options", "prompt_cache_retention", "parallel_tool_calls")


class OpenAIStreamOptions(BaseModel, extra="forbid", strict=True):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # accepted; chunks carry no obfuscation field


class VlmOptions(BaseModel, extra="forbid", strict=True):
    """The worker's own extras, reachable from an OpenAI body as `"vlm": {...}`."""

    task: str = Field("chat", pattern="^(chat|grounding)$")
    target: Optional[str] = None


class ChatCompletionBody(BaseModel, extra="forbid", strict=True):
    """An OpenAI chat-completions body. Unknown fields are refused, as OpenAI refuses them."""

    messages: Any = None  # read by parse_messages, with the native route's paths and limits
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[str | list[str]] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[OpenAIStreamOptions] = None
    vlm: Optional[VlmOptions] = None

    @property
    def stop_sequences(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def read_openai_body(raw: Any) -> ChatCompletionBody:
    """Check an OpenAI chat-completions body's fields (its messages are read with the item)."""
    if not isinstance(raw, dict):
        raise RequestError("invalid_request", "the request body must be a JSON object")
    for name, neutral in OPENAI_UNSUPPORTED.items():
        if raw.get(name) is not None and raw[name] not in neutral:
            accepted = f" (only {json.dumps(neutral[0])} is accepted)" if neutral else ""
            raise RequestError("unsupported_parameter", f"not supported by this worker{accepted}", name)
    try:
        body = ChatCompletionBody.model_validate(
            {k: v for k, v in raw.items() if k not in OPENAI_UNSUPPORTED and k not in OPENAI_IGNORED})
    except ValidationError as error:
        raise _pydantic_error(error, None) from None
    stops, grounding = body.stop_sequences, body.vlm is not None and body.vlm.task == "grounding"
    for refused, message, param in (
        (body.n not in (None, 1), "must be 1: this worker returns one choice per request", "n"),
        (body.stream_options is not None and not body.stream, "only allowed when stream is true", "stream_options"),
        (len(stops) > 4, "at most 4 stop sequences", "stop"),  # as OpenAI's API
        ("" in stops, "a stop sequence must not be empty", "stop"),
        (stops and grounding, "not supported with vlm.task grounding", "stop"),
    ):
        if refused:
            raise RequestError("invalid_request", message, param)
    return body


def openai_item(body: ChatCompletionBody, settings: Settings, model_id: str) -> GenerationRequest:
    """The item a checked body asks for, read as the native request it translates to."""
    messages = body.messages
    if isinstance(messages, list):  # OpenAI's newer name for the system role
        messages = [dict(m, role="system") if isinstance(m, dict) and m.get("role") == "developer" else m
                    for m in messages]
    temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default: sampled
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    native = {"task": "chat", "messages": messages, "temperature": temperature, "do_sample": temperature > 0,
              "top_p": body.top_p, "max_new_tokens": max_tokens, "model": body.model}
    _, item = read_request({k: v for k, v in native.items() if v is not None}, settings, model_id, None)
    if body.vlm is not None and body.vlm.task == "grounding":
        target = _required_text(body.vlm.target, "vlm.target", "the grounding task")
        item = dataclasses.replace(item, task="grounding", grounding_target=target)
        _check_text_length(item, settings, "messages")
        if not item.images:
            raise RequestError("missing_image", "the grounding task needs an image in the messages", "messages")
    return item


def openai_error(error: RequestError, body: Optional[ChatCompletionBody] = None) -> dict:
    """An error in OpenAI's shape, its `param` as the body spells it (max_tokens or max_completion_tokens, messages)."""
    if body is not None:
        by_max_tokens = body.max_completion_tokens is None and body.max_tokens is not None
        renames = {"max_new_tokens": "max_tokens" if by_max_tokens else "max_completion_tokens", "input": "messages"}
        error.param = renames.get(error.param, error.param)
    server_side = error.code in ("internal_error", "generation_failed", "worker_misconfigured")
    text = f"{error.param}: {error.message}" if error.param else error.message
    return {"error": {"message": text, "type": "server_error" if server_side else "invalid_request_error",
                      "param": error.param, "code": error.code}}


async def answer_pieces(engine: Engine, item: GenerationRequest, stops: list[str], stream: bool):
    """Yields the answer's text as it becomes safe to show (when `stream`), then its Generation, cut
    before the first stop sequence; raises the item's RequestError. A stop or leaving early cancels the item."""
    events = stream_generation(engine, item, stream or bool(stops))
    generated, shown = "", 0  # `shown` only grows when streaming
    try:
        async for event in events:
            if isinstance(event, RequestError):
                raise event
            if isinstance(event, Generation):
                break
            generated += event.text
            cut = min((i for i in (generated.find(stop, shown) for stop in stops) if i >= 0), default=None)
            if cut is not None:
                await events.aclose()  # before anything else is sent: the row stops generating now
                event = Generation(generated[:cut], "stop", event.prompt_tokens, event.completion_tokens)
                break
            # What could begin a stop sequence waits, and so do trailing spaces (the final text is stripped).
            held = max((k for stop in stops for k in range(1, len(stop)) if generated.endswith(stop[:k])), default=0)
            ready = min(len(generated) - held, len(generated.rstrip()))
            if stream and ready > shown:
                yield generated[shown:ready]
                shown = ready
        # The engine's own text is the answer when what was shown is a prefix of it.
        if not event.text.startswith(generated[:shown]):
            event = dataclasses.replace(event, text=generated)
        if stream and len(event.text) > shown:
            yield event.text[shown:]
        yield event
    finally:
        await events.aclose()


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def chat_completion(engine: Engine, item: GenerationRequest, body: ChatCompletionBody):
    """One `chat.completion`, or when `body.stream` chunks at most once per VLM_STREAM_INTERVAL_MS, the role held
    until the first piece (an early error is refused whole), then usage when asked and `data: [DONE]`."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion" + (".chunk" if body.stream else ""),
            "created": int(time.time()), "model": engine.model_id, **({"usage": None} if include_usage else {})}

    def chunk(delta: dict, finish_reason: Optional[str] = None, **extra) -> str:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}], **extra})

    interval, last, pending = engine.settings.stream_interval_ms / 1000, float("-inf"), ""
    opening = chunk({"role": "assistant", "content": ""})
    stream = body.stream and item.task != "grounding"  # a grounding answer is written whole at the end, with its box
    async with contextlib.aclosing(answer_pieces(engine, item, body.stop_sequences, stream)) as pieces:
        async for piece in pieces:
            if isinstance(piece, str):
                pending += piece
                if time.monotonic() - last >= interval:
                    yield opening + chunk({"content": pending})
                    opening, pending, last = "", "", time.monotonic()
                continue
            content, extra = pending if stream else piece.text, {}
            if item.task == "grounding":
                fields = grounding_fields(item, piece, engine.adapter)
                content, extra["vlm"] = json.dumps({**fields, "response": piece.text}), {"task": "grounding", **fields}
            usage = {"prompt_tokens": piece.prompt_tokens, "completion_tokens": piece.completion_tokens,
                     "total_tokens": piece.prompt_tokens + piece.completion_tokens}
            if not body.stream:
                yield {**head, "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                            "logprobs": None, "finish_reason": piece.finish_reason}],
                       "usage": usage, **extra}
                return
            usage_chunk = sse({**head, "choices": [], "usage": usage}) if include_usage else ""
            yield opening + chunk({"content": content}, piece.finish_reason, **extra) + usage_chunk + sse("[DONE]")


async def openai_answers(engine_getter, job_input: dict):
    """An `openai_route` job's answer: a model list, a `chat.completion`, streamed events (strings) or
    an OpenAI error. Never raises: a failure after a stream's first event ends it with an error event."""
    body, started = None, False
    try:
        route = job_input.get("openai_route")
        settings, model_id = served_model()
        if route == "/v1/models":
            model = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "runpod-vlm"}
            yield {"object": "list", "data": [model]}
            return
        if route != "/v1/chat/completions":
            raise RequestError("invalid_request", "this worker serves /v1/chat/completions and /v1/models",
                               "openai_route")
        body = read_openai_body(job_input.get("openai_input"))
        # Reading fetches and decodes images, and the engine may still be loading: both block.
        item = await asyncio.to_thread(openai_item, body, settings, model_id)
        engine = await asyncio.to_thread(engine_getter)
        # Closing this generator (client gone, job cancelled) closes the answer, which cancels the item.
        async with contextlib.aclosing(chat_completion(engine, item, body)) as answers:
            async for answer in answers:
                yield answer
                started = True
    except Exception as failure:
        answer = openai_error(as_request_error(failure), body)
        yield sse(answer) + sse("[DONE]") if started else answer


# =================================================================================================
# Entry point: the RunPod handler and `python handler.py`
# =================================================================================================


async def handler(job: dict):
    """RunPod entry, an async generator: a streamed request yields its answer in pieces, any other
    job yields one output (an answer, a batch's answers, or an error)."""
    _bound_the_shutdown()
    try:
        payload = job.get("input") if isinstance(job, dict) else None
        if not isinstance(payload, dict):
            raise RequestError("invalid_request", "the job needs an 'input' object", "input")
        if "openai_route" in payload:  # RunPod's /openai/v1/... gateway (see "OpenAI route")
            async for answer in openai_answers(get_engine, payload):
                yield answer
            return
        if "requests" in payload:
            yield await asyncio.to_thread(answer_batch, job, payload)
            return
        settings, model_id = served_model()
        request, item = await asyncio.to_thread(read_request, payload, settings, model_id, None)
        engine = await asyncio.to_thread(get_engine, request.quantize)
        if request.stream:
            async for chunk in stream_chunks(engine, item, request):
                yield chunk
            return
        result = await generate_one(engine, item)
        yield result.to_dict() if isinstance(result, RequestError) else format_output(engine, item, result, request)
    except Exception as failure:
        yield as_request_error(failure).to_dict()


async def stream_chunks(engine: Engine, item: GenerationRequest, request: RequestModel):
    """A streamed answer as `{"text": ...}` chunks, at most one per VLM_STREAM_INTERVAL_MS; the last
    one carries finish_reason, usage and the other fields of a whole answer (but `response`)."""
    interval, sent, pending, last = engine.settings.stream_interval_ms / 1000, "", "", time.monotonic()
    events = stream_generation(engine, item)
    async for event in events:
        if isinstance(event, RequestError):
            yield event.to_dict()
            return
        if isinstance(event, Generation):
            tail = event.text[len(sent + pending):] if event.text.startswith(sent + pending) else ""
            final = format_output(engine, item, event, request)
            del final["response"]
            yield {"text": pending + tail, **final}
            return
        pending += event.text
        if pending and time.monotonic() - last >= interval:
            yield {"text": pending}
            sent, pending, last = sent + pending, "", time.monotonic()


@functools.cache
def _bound_the_shutdown() -> None:
    """On SIGTERM the runpod SDK stops taking jobs and waits for those in flight, however long: this
    bounds the wait (VLM_SHUTDOWN_GRACE). Set by the first job in the SDK's loop, after the SDK's own."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if _engine is not None:
            _engine.stop_after(_engine.settings.shutdown_grace)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


def served_model() -> tuple[Settings, str]:
    """The settings and model id in force: the loaded engine's, else the environment's."""
    if _engine is not None:
        return _engine.settings, _engine.model_id
    settings = Settings.from_env()
    return settings, settings.model


def read_request(raw: Any, settings: Settings, model_id: str, param: Optional[str]) -> tuple[RequestModel, Any]:
    """A request validated against the served model (images fetched: call off the event loop)."""
    request, item = parse_request(raw, settings, param)
    if request.model is not None and request.model != model_id:
        message = f"this worker serves {model_id}; it cannot switch to {_cut(request.model)!r}"
        raise RequestError("model_mismatch", message, _join(param, "model"))
    return request, item


def answer_batch(job: dict, payload: dict) -> dict:
    """A `{"requests": [...]}` call: every item answered (or refused) on its own."""
    extra = set(payload) - {"requests"}
    if extra:
        raise RequestError("invalid_request", "unknown field beside 'requests'", sorted(extra)[0])
    raw_items = payload["requests"]
    settings, model_id = served_model()
    if not isinstance(raw_items, list) or not raw_items:
        raise RequestError("invalid_request", "must be a non-empty list of requests", "requests")
    if len(raw_items) > settings.max_batch_requests:
        raise RequestError("too_many_requests", f"at most {settings.max_batch_requests} requests per call", "requests")

    def read_item(index: int, raw: Any):
        param = f"requests[{index}]"
        try:
            request, item = read_request(raw, settings, model_id, param)
            if request.stream:
                raise RequestError("invalid_request", "items of a batch call cannot stream", _join(param, "stream"))
            return request, item
        except (RequestError, SettingsError) as error:
            return error
        except Exception:
            log.exception("could not read %s", param)
            return RequestError("internal_error", "this request could not be read", param)

    # Side by side: their images download and decode in parallel (Pillow's decoders release the GIL).
    with ThreadPoolExecutor(max_workers=min(8, len(raw_items))) as pool:
        outcomes = list(pool.map(read_item, range(len(raw_items)), raw_items))
    for outcome in outcomes:
        if isinstance(outcome, SettingsError):
            raise outcome
    results = [outcome.to_dict() if isinstance(outcome, RequestError) else None for outcome in outcomes]
    parsed = [(index, outcome) for index, outcome in enumerate(outcomes) if not isinstance(outcome, RequestError)]
    if parsed:  # the first request asking for a quantization decides it if this call loads the model
        engine = get_engine(next((request.quantize for _, (request, _) in parsed if request.quantize), None))
        for (index, (request, item)), result in zip(parsed, generate_all(engine, [item for _, (_, item) in parsed])):
            results[index] = result.to_dict() if isinstance(result, RequestError) else format_output(
                engine, item, result, request)
    return {"model": model_id, "count": len(results), "id": job.get("id"), "results": results}


async def answer(job: dict) -> Any:
    """The job's whole output: its one output, or the list of a streamed job's chunks (what RunPod's
    `return_aggregate_stream` gives /runsync). For `--test_input`, which cannot iterate a generator."""
    outputs = [output async for output in handler(job)]
    return outputs[0] if len(outputs) == 1 and "text" not in outputs[0] else outputs


def main() -> None:
    os.environ.setdefault("RUNPOD_LOG_LEVEL", "INFO")  # the SDK's DEBUG default logs every answer
    import runpod
    logging.basicConfig(level=os.environ.get("VLM_LOG_LEVEL", "INFO"))
    settings = Settings.from_env()
    if settings.load_at_boot:
        get_engine().warm_up()  # load before taking jobs; the compiled step follows in the background
    local_test = any(arg.startswith("--test_input") for arg in sys.argv)
    _RUNPOD_CONFIG.update({
        "handler": answer if local_test else handler, "return_aggregate_stream": True,
        "concurrency_modifier": lambda current: 0 if _engine and _engine.broken else settings.max_concurrency})
    runpod.serverless.start(_RUNPOD_CONFIG)


if __name__ == "__main__":
    main()
