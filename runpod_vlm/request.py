"""A job's input validated into a GenerationRequest: fields, hostile-input checks, limits."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runpod_vlm.settings import QUANTIZE_CHOICES, Settings
from runpod_vlm.vocabulary import (
    GenerationParams,
    GenerationRequest,
    ImageSpec,
    RequestError,
    Turn,
    VideoSpec,
    cut_text,
    join_param,
)

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
    seed: Optional[int] = Field(default=None, ge=-(2**63), le=2**63 - 1)  # OpenAI's: an int64
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    response_format: Optional[Any] = None  # OpenAI's: text, json_object or json_schema
    max_pixels: Optional[int] = Field(default=None, ge=1)  # each image resized to at most this many pixels
    stream: bool = False
    n: int = Field(default=1, ge=1)  # choices: answers to the same prompt, each its own seed stream
    batch_images: Optional[bool] = None
    annotate: bool = False  # grounding: also return the image with the boxes drawn

    @field_validator("task")
    @classmethod
    def _known_task(cls, value):
        if value is not None and value not in TASKS:
            raise ValueError(f"unknown task {cut_text(value)!r}; use one of {', '.join(TASKS)}")
        return value


def pydantic_error(error: ValidationError, param: Optional[str]) -> RequestError:
    first = error.errors(include_input=False, include_url=False)[0]
    location = ".".join(cut_text(str(p)) for p in first["loc"])  # an unknown field's name is the caller's
    message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
    return RequestError("invalid_request", message, join_param(param, location) if location else param)


def parse_request(raw: Any, settings: Settings, param: Optional[str] = None) -> tuple[RequestModel, GenerationRequest]:
    """Validate one request dict into its fields and a GenerationRequest (images not yet fetched: read_images)."""
    if not isinstance(raw, dict):
        raise RequestError("invalid_request", "must be a JSON object", param or "input")
    check_strings(raw, param)
    try:
        request = RequestModel.model_validate(raw)
    except ValidationError as error:
        raise pydantic_error(error, param) from None

    def refuse(field: str, message: str, code: str = "invalid_request"):
        raise RequestError(code, message, join_param(param, field))

    task = request.task or ("chat" if request.messages is not None else None)
    if task is None:
        refuse("task", f"missing; use one of {', '.join(TASKS)} (or send messages)")
    # The default never exceeds the cap: a request that sets nothing must not be refused.
    max_new_tokens = request.max_new_tokens or min(settings.default_max_new_tokens, settings.max_new_tokens)
    if max_new_tokens > settings.max_new_tokens:
        refuse("max_new_tokens", f"must be at most {settings.max_new_tokens} on this worker")
    if request.do_sample and request.temperature == 0:
        refuse("temperature", "must be above 0 when do_sample is true")
    if request.top_logprobs and not request.logprobs:
        refuse("top_logprobs", "needs logprobs true")
    json_schema = schema_of(request.response_format, join_param(param, "response_format"), settings.max_schema_bytes)
    if json_schema is not None and request.min_new_tokens:
        refuse("min_new_tokens", "not used with a response_format: the schema decides where the answer ends")
    if request.annotate and task != "grounding":
        refuse("annotate", "only used by the grounding task")
    if request.n > settings.max_choices:
        refuse("n", f"must be at most {settings.max_choices} on this worker (VLM_MAX_CHOICES)")
    if request.n > 1 and request.stream:
        refuse("n", "a streamed answer on this route has one choice; the OpenAI route streams several")
    params = GenerationParams(
        max_new_tokens=max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        do_sample=request.do_sample,
        min_new_tokens=min(request.min_new_tokens, max_new_tokens),
        seed=request.seed,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        json_schema=json_schema,
    )
    loose_images, target = _loose_images(request, param), None
    if task == "chat":
        if request.messages is None:
            refuse("messages", "required for the chat task")
        turns = parse_messages(request.messages, settings, join_param(param, "messages"))
        next(t for t in turns if t.role == "user").parts[:0] = loose_images  # the last turn is a user's
    else:
        if request.messages is not None:
            refuse("messages", f"not used by the {task} task; send task 'chat' instead")
        if not loose_images:
            refuse("image_url", f"the {task} task needs an image (image_url, image_b64 or images)", "missing_image")
        if task == "grounding":  # its prompt is the family's own: the adapter adds it (FamilyAdapter.request_turns)
            target, parts = (
                required_text(request.target, join_param(param, "target"), "the grounding task"),
                loose_images,
            )
        elif task == "vqa":
            parts = [*loose_images, required_text(request.question, join_param(param, "question"), "the vqa task")]
        else:
            parts = [*loose_images, TASK_PROMPTS[task]]
        turns = [Turn("user", parts)]
    if request.max_pixels is not None:  # the deployment's own bound still applies below it (FamilyAdapter)
        for turn in turns:
            turn.parts = [
                dataclasses.replace(p, max_pixels=min(p.max_pixels or request.max_pixels, request.max_pixels))
                if isinstance(p, ImageSpec)
                else p
                for p in turn.parts
            ]
    prepared = GenerationRequest(
        task, turns, params, grounding_target=target, annotate=request.annotate, param=param, choices=request.n
    )
    check_text_length(prepared, settings, param)
    return request, prepared


LOW_DETAIL_PIXELS = 512 * 512  # OpenAI's detail "low": an image the size of 512x512 at most
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
    return join_param(
        parent, f"[{key}]" if isinstance(key, int) else cut_text(key if isinstance(key, str) else repr(key))
    )


def _check_text(text: str, where: Optional[str], what: str) -> None:
    if "\x00" in text:
        raise RequestError("invalid_request", f"the {what} holds a NUL character", where or "input")
    if not text.isascii() and _SURROGATE.search(text):  # isascii() reads a flag: a data URI is not scanned
        raise RequestError("invalid_request", f"the {what} holds invalid Unicode (a lone surrogate)", where or "input")


def required_text(value: Optional[str], param: str, what: str) -> str:
    if value is None or not value.strip():
        raise RequestError("invalid_request", f"required for {what}", param)
    return value.strip()


def _loose_images(request: RequestModel, param: Optional[str]) -> list[ImageSpec]:
    """Images given beside the prompt: image_url, image_b64 and images[...], in that order."""
    fields = ("image_url", "image_b64")
    specs = [ImageSpec(getattr(request, f), join_param(param, f)) for f in fields if getattr(request, f) is not None]
    specs.extend(ImageSpec(spec, join_param(param, f"images[{i}]")) for i, spec in enumerate(request.images or ()))
    return specs


def parse_messages(messages: Any, settings: Settings, param: str) -> list[Turn]:
    """OpenAI-style messages -> turns; images stay ImageSpec for `read_images` to fetch."""
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
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError("invalid_request", "must be system, user, assistant or tool", f"{where}.role")
        calls = _tool_calls(message.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else None
        if isinstance(content, str):
            parts = [content]
        elif isinstance(content, list) and content:
            parts = [_parse_block(block, f"{where}.content[{j}]") for j, block in enumerate(content)]
        elif calls and content is None:  # an assistant's turn that only calls tools
            parts = []
        else:
            raise RequestError("invalid_request", "must be a string or a non-empty list of blocks", f"{where}.content")
        if role != "user" and any(not isinstance(p, str) for p in parts):
            message = "images and videos are allowed in user messages only"
            raise RequestError("invalid_request", message, f"{where}.content")
        call_id = message.get("tool_call_id") if role == "tool" else None
        if role == "tool" and not isinstance(call_id, str):
            raise RequestError(
                "invalid_request", "a tool message needs the tool_call_id it answers", f"{where}.tool_call_id"
            )
        turns.append(Turn(role, parts, tool_calls=calls, tool_call_id=call_id))
    if turns[-1].role not in ("user", "tool"):
        raise RequestError("invalid_request", "the last message must come from the user or a tool", f"{where}.role")
    return turns


def _tool_calls(calls: Any, where: str) -> Optional[list]:
    """An assistant message's `tool_calls` (OpenAI's shape, arguments as JSON text) -> [{"id", "name", "arguments"}]
    with each call's arguments an object, as chat templates take them."""
    if calls is None:
        return None
    if not isinstance(calls, list) or not calls:
        raise RequestError("invalid_request", "must be a non-empty list of calls", where)
    read = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                "invalid_request", 'must be {"id", "type": "function", "function": {"name", "arguments"}}', at
            )
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise RequestError("invalid_request", "must be JSON text", f"{at}.function.arguments") from None
        read.append({"id": str(call.get("id") or f"call_{k}"), "name": function["name"], "arguments": arguments})
    return read


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
        detail = block[kind].get("detail") if isinstance(block[kind], dict) else None
        if detail not in (None, "auto", "high", "low"):
            raise RequestError("invalid_request", "must be auto, high or low", f"{where}.{kind}.detail")
        return ImageSpec(block[kind], f"{where}.{kind}", LOW_DETAIL_PIXELS if detail == "low" else None)
    if kind in ("video_url", "video"):
        if kind not in block:
            raise RequestError("invalid_request", f"a {kind} block needs '{kind}'", f"{where}.{kind}")
        return VideoSpec(block[kind], f"{where}.{kind}")
    raise RequestError("invalid_request", "type must be text, image_url, image or video_url", f"{where}.type")


def check_text_length(item: GenerationRequest, settings: Settings, param: Optional[str]) -> None:
    text = sum(len(p) for t in item.turns for p in t.parts if isinstance(p, str))
    text += len(item.grounding_target or "")  # becomes part of the prompt when the batch runs
    if text > settings.max_text_chars:
        message = f"the request's text is over {settings.max_text_chars} characters"
        raise RequestError("text_too_long", message, param or "input")


def read_request(
    raw: Any, settings: Settings, model_id: str, param: Optional[str] = None
) -> tuple[RequestModel, GenerationRequest]:
    """A request validated against the served model; its images are read next (media.read_images)."""
    request, item = parse_request(raw, settings, param)
    if request.model is not None and request.model != model_id:
        message = f"this worker serves {model_id}; it cannot switch to {cut_text(request.model)!r}"
        raise RequestError("model_mismatch", message, join_param(param, "model"))
    return request, item


def schema_of(response_format: Any, param: str, max_bytes: int) -> Optional[str]:
    """OpenAI's `response_format` -> the JSON schema it asks for (JSON text in the caller's key order: the answer
    writes its properties in that order), or None for text. Refused past OpenAI's size limits for a strict schema."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("invalid_request", "must be an object with a type", param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind != "json_schema":
        raise RequestError("invalid_request", "type must be text, json_object or json_schema", f"{param}.type")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    where = f"{param}.json_schema.schema"
    if not isinstance(schema, dict):
        raise RequestError("invalid_request", "needs a schema object", where)
    return checked_schema(schema, where, max_bytes)


def checked_schema(schema: dict, where: str, max_bytes: int) -> str:
    """A JSON schema as JSON text in its own key order, refused naming `where` past the size limits."""
    text = json.dumps(schema, separators=(",", ":"))
    if len(text.encode()) > max_bytes:
        raise RequestError("schema_too_complex", f"the schema is over {max_bytes} bytes as JSON", where)
    properties, enum_values = schema_size(schema)
    if properties > MAX_SCHEMA_PROPERTIES:
        message = f"the schema has {properties} properties; at most {MAX_SCHEMA_PROPERTIES}"
        raise RequestError("schema_too_complex", message, where)
    if enum_values > MAX_SCHEMA_ENUM_VALUES:
        message = f"the schema has {enum_values} enum values; at most {MAX_SCHEMA_ENUM_VALUES}"
        raise RequestError("schema_too_complex", message, where)
    return text


MAX_SCHEMA_PROPERTIES = 5000  # OpenAI's bounds on a strict schema, in all its objects together
MAX_SCHEMA_ENUM_VALUES = 1000


def schema_size(schema: Any) -> tuple[int, int]:
    """The object properties and enum values of a schema, counted over all its subschemas (nesting is bounded by
    check_strings already)."""
    properties = enum_values = 0
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("properties"), dict):
                properties += len(value["properties"])
            if isinstance(value.get("enum"), list):
                enum_values += len(value["enum"])
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return properties, enum_values
