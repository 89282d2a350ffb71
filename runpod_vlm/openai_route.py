"""RunPod's /openai/v1 jobs: OpenAI bodies read as native requests, answers and errors in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel, Field, ValidationError

from runpod_vlm.answers import answer_pieces, choice_items, paced, stream_generations
from runpod_vlm.grounding import grounding_fields
from runpod_vlm.media import read_images
from runpod_vlm.request import check_text_length, checked_schema, pydantic_error, read_request, required_text
from runpod_vlm.settings import Settings
from runpod_vlm.tools import TOOL_FORMATS, call_schema, read_calls, read_tools
from runpod_vlm.video import read_videos
from runpod_vlm.vocabulary import GenerationRequest, RequestError, as_request_error

if TYPE_CHECKING:
    from runpod_vlm.engine.engine import Engine


# RunPod's gateway turns calls to .../openai/v1/... into jobs with input {"openai_route": "/v1/chat/completions",
# "openai_input": <the body>} (GET /v1/models has none). The body becomes a native request read by `read_request`
# (the same validation, media policy, limits and error codes); answers and errors take OpenAI's shapes.

# Fields this worker cannot honour, accepted at neutral values only (ignoring others would answer another question).
OPENAI_UNSUPPORTED = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "moderation": (),
    "reasoning_effort": (),
    "verbosity": (),
}
# Accepted and ignored.
OPENAI_IGNORED = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
)


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
    seed: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[Any] = None
    n: Optional[int] = None
    tools: Optional[Any] = None  # read by tools.read_tools, naming its fields
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[OpenAIStreamOptions] = None
    vlm: Optional[VlmOptions] = None

    @property
    def stop_sequences(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def read_body(raw: Any, model: type[BaseModel], unsupported: dict, ignored: tuple):
    """An OpenAI body as `model`: a field of `unsupported` away from its neutral values is refused with
    `unsupported_parameter`, the `ignored` ones are dropped, any other unknown field is refused."""
    if not isinstance(raw, dict):
        raise RequestError("invalid_request", "the request body must be a JSON object")
    for name, neutral in unsupported.items():
        if raw.get(name) is not None and raw[name] not in neutral:
            accepted = f" (only {json.dumps(neutral[0])} is accepted)" if neutral else ""
            raise RequestError("unsupported_parameter", f"not supported by this worker{accepted}", name)
    try:
        return model.model_validate({k: v for k, v in raw.items() if k not in unsupported and k not in ignored})
    except ValidationError as error:
        raise pydantic_error(error, None) from None


def read_openai_body(raw: Any) -> ChatCompletionBody:
    """Check an OpenAI chat-completions body's fields (its messages are read with the item)."""
    body = read_body(raw, ChatCompletionBody, OPENAI_UNSUPPORTED, OPENAI_IGNORED)
    stops, grounding = body.stop_sequences, body.vlm is not None and body.vlm.task == "grounding"
    for refused, message, param in (
        (body.stream_options is not None and not body.stream, "only allowed when stream is true", "stream_options"),
        (len(stops) > 4, "at most 4 stop sequences", "stop"),  # as OpenAI's API
        ("" in stops, "a stop sequence must not be empty", "stop"),
        (stops and grounding, "not supported with vlm.task grounding", "stop"),
        (stops and body.logprobs, "not supported with logprobs", "stop"),
    ):
        if refused:
            raise RequestError("invalid_request", message, param)
    return body


def openai_item(body: ChatCompletionBody, settings: Settings, model_id: str) -> GenerationRequest:
    """The item a checked body asks for, read as the native request it translates to."""
    messages = body.messages
    if isinstance(messages, list):  # OpenAI's newer name for the system role
        messages = [
            dict(m, role="system") if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages
        ]
    temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default: sampled
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    native = {
        "task": "chat",
        "messages": messages,
        "temperature": temperature,
        "do_sample": temperature > 0,
        "top_p": body.top_p,
        "max_new_tokens": max_tokens,
        "model": body.model,
        "seed": body.seed,
        "logprobs": body.logprobs,
        "top_logprobs": body.top_logprobs,
        "response_format": body.response_format,
        "n": body.n,
    }
    _, item = read_request({k: v for k, v in native.items() if v is not None}, settings, model_id, None)
    tool_use = read_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tool_use is not None:
        schema = call_schema(tool_use)
        if schema is not None and body.response_format is not None:
            message = "not with tool_choice required or a named function: the answer is the call"
            raise RequestError("invalid_request", message, "response_format")
        params = item.params
        if schema is not None:
            text = checked_schema(schema, "tools", settings.max_schema_bytes)
            params = dataclasses.replace(params, json_schema=text, schema_param="tools")
        item = dataclasses.replace(item, tool_use=tool_use, params=params)
    if body.vlm is not None and body.vlm.task == "grounding":
        target = required_text(body.vlm.target, "vlm.target", "the grounding task")
        item = dataclasses.replace(item, task="grounding", grounding_target=target)
        check_text_length(item, settings, "messages")
        if not item.images:
            raise RequestError("missing_image", "the grounding task needs an image in the messages", "messages")
    read_images(item, settings)
    read_videos(item, settings)
    return item


def openai_error(error: RequestError, body: Optional[ChatCompletionBody] = None) -> dict:
    """An error in OpenAI's shape, its `param` as the body spells it (max_tokens or max_completion_tokens, messages)."""
    if body is not None:
        by_max_tokens = body.max_completion_tokens is None and body.max_tokens is not None
        renames = {"max_new_tokens": "max_tokens" if by_max_tokens else "max_completion_tokens", "input": "messages"}
        error.param = renames.get(error.param, error.param)
    server_side = error.code in ("internal_error", "generation_failed", "worker_misconfigured")
    text = f"{error.param}: {error.message}" if error.param else error.message
    return {
        "error": {
            "message": text,
            "type": "server_error" if server_side else "invalid_request_error",
            "param": error.param,
            "code": error.code,
        }
    }


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def chat_completion(engine: Engine, item: GenerationRequest, body: ChatCompletionBody):
    """One `chat.completion` of `n` choices, or when `body.stream` chunks at most once per VLM_STREAM_INTERVAL_MS per
    choice, each choice's role held until its first piece (an early error is refused whole), then usage when asked
    (summed as OpenAI sums it: the prompt once) and `data: [DONE]`."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion" + (".chunk" if body.stream else ""),
        "created": int(time.time()),
        "model": engine.model_id,
        **({"usage": None} if include_usage else {}),
    }

    def chunk(index: int, delta: dict, finish_reason=None, logprobs: Optional[dict] = None, **extra) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**head, "choices": [choice], **extra})

    interval_s = engine.settings.stream_interval_ms / 1000
    stream = body.stream and item.task != "grounding"  # a grounding answer is written whole at the end, with its box
    items, stops = choice_items(item), body.stop_sequences
    use, opener = item.tool_use, tool_format(engine, item)
    shown = ToolText(use, opener, engine.tokenizer if opener else None, len(items))
    events = stream_generations(engine, items, stream or bool(stops))
    answers = [paced(answer_pieces(engine, it, stops, stream, ev), interval_s) for it, ev in zip(items, events)]
    opened: set[int] = set()  # choices whose role was sent

    def opening(index: int) -> str:
        first = index not in opened
        opened.add(index)
        return chunk(index, {"role": "assistant", "content": ""}) if first else ""

    finals, extra = [None] * len(items), {}
    async for index, text, piece in merged(answers):  # each choice's last pair holds its Generation
        if piece is None:
            if text := shown.new(index, text):
                yield opening(index) + chunk(index, {"content": text})
            continue
        content, fields, calls = text if stream else piece.text, {}, []
        if item.task == "grounding":
            boxes = grounding_fields(item, piece, engine.adapter)
            content, fields["vlm"] = json.dumps({**boxes, "response": piece.text}), {"task": "grounding", **boxes}
        if use is not None:
            answer, calls = read_calls(use, piece.text, piece.raw_text, opener)
            content = shown.last(index, text, bool(calls)) if stream else answer
        extra = extra or fields  # the first choice's
        # A stream's logprobs all come in its last chunk: its text pieces are cut at characters, not tokens.
        logprobs = {"content": piece.logprobs, "refusal": None} if piece.logprobs is not None else None
        finish = "tool_calls" if calls and piece.finish_reason == "stop" else piece.finish_reason
        finals[index] = piece, content, logprobs, calls, finish
        if body.stream:
            delta = {"content": content or (None if calls else "")}
            if calls:
                delta["tool_calls"] = [call.openai(k) for k, call in enumerate(calls)]
            yield opening(index) + chunk(index, delta, finish, logprobs, **fields)
    prompt = finals[0][0].prompt_tokens
    completion = sum(final[0].completion_tokens for final in finals)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if body.stream:
        yield (sse({**head, "choices": [], "usage": usage}) if include_usage else "") + sse("[DONE]")
        return
    choices = [
        {
            "index": index,
            "message": {
                "role": "assistant",
                "content": content,
                **({"tool_calls": [call.openai() for call in calls]} if calls else {}),
            },
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        for index, (_, content, logprobs, calls, finish) in enumerate(finals)
    ]
    yield {**head, "choices": choices, "usage": usage, **extra}


def tool_format(engine: Engine, item: GenerationRequest) -> Optional[str]:
    """The text that opens a call in the model's format (a TOOL_FORMATS key), None without tools; refused naming
    `tools` where the model's chat template takes none, or where its calls could not be read back (`auto`)."""
    use = item.tool_use
    if use is None:
        return None
    template = engine.adapter.tool_template(engine.processor) if engine.adapter.native else None
    if template is None:
        message = f"this model's chat template ({engine.adapter.name}) takes no tools"
        raise RequestError("unsupported_parameter", message, "tools")
    opener = next((opener for opener in TOOL_FORMATS if opener in template), None)
    if opener is None and use.choice == "auto":
        message = "this worker cannot read this model's tool calls: use tool_choice required or a named function"
        raise RequestError("unsupported_parameter", message, "tool_choice")
    return opener


class ToolText:
    """What of each choice's streamed text may be shown while it may call tools: none of a constrained answer (it
    is the call), and in `auto` nothing from where a call opens, or might (its opener begun); everything when the
    opener is a special token, which the streamed text never shows."""

    def __init__(self, use, opener: Optional[str], tokenizer, choices: int):
        self.use, self.held, self.calling = use, [""] * choices, [False] * choices
        special = opener in getattr(tokenizer, "all_special_tokens", ())
        self.opener = None if special else opener

    def new(self, index: int, text: str) -> str:
        if self.use is None or self.use.choice == "none":
            return text
        self.held[index] += text
        if self.calling[index] or self.use.choice != "auto" or self.opener is None:
            return ""
        held, opener = self.held[index], self.opener
        cut = held.find(opener)
        if cut >= 0:
            self.calling[index] = True
        else:
            cut = len(held) - max((k for k in range(1, len(opener)) if held.endswith(opener[:k])), default=0)
        self.held[index] = held[cut:]
        return held[:cut]

    def last(self, index: int, text: str, called: bool) -> Optional[str]:
        """A choice's last content delta: what is left to show of its text, none of a call."""
        shown = self.new(index, text)
        return (shown or None) if called else shown + self.held[index]


async def merged(generators: list):
    """(index, *pair) from several async generators at once, as each yields; the first failure is raised, and
    leaving early (or a failure) cancels and closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def drain(index: int, generator) -> None:
        async with contextlib.aclosing(generator):
            try:
                async for pair in generator:
                    await queue.put((index, pair, None))
            except Exception as error:
                await queue.put((index, None, error))
            else:
                await queue.put((index, None, ended))

    tasks = [asyncio.create_task(drain(index, generator)) for index, generator in enumerate(generators)]
    try:
        running = len(tasks)
        while running:
            index, pair, outcome = await queue.get()
            if outcome is ended:
                running -= 1
            elif outcome is not None:
                raise outcome
            else:
                yield (index, *pair)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def served_models(served_model) -> list[dict]:
    """/v1/models' list: the served model, none once it failed to load."""
    try:
        _, model_id = served_model()
    except RequestError as error:
        if error.code != "model_load_failed":
            raise
        return []
    return [{"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "runpod-vlm"}]


async def openai_answers(engine_getter, served_model, job_input: dict):
    """An `openai_route` job's answer: a model list, a `chat.completion`, streamed events (strings) or
    an OpenAI error. Never raises: a failure after a stream's first event ends it with an error event.
    `served_model()` gives the settings and model id in force, `engine_getter()` the (loading) engine."""
    body, started = None, False
    try:
        route = job_input.get("openai_route")
        if route == "/v1/models":
            yield {"object": "list", "data": served_models(served_model)}
            return
        settings, model_id = served_model()
        if route != "/v1/chat/completions":
            raise RequestError(
                "invalid_request",
                "this worker serves /v1/chat/completions, /v1/responses and /v1/models",
                "openai_route",
            )
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
