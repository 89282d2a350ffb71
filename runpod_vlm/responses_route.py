"""OpenAI's Responses API (`/v1/responses`): its input items are read as the chat-completions body they
mean (the same checks, limits and error codes), answered by the same pieces, in the Responses shapes.

The worker keeps no state between requests: `previous_response_id`, `conversation` and `store: true`
are refused, and every response says `"store": false`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel

from runpod_vlm.answers import answer_pieces, paced
from runpod_vlm.openai_route import ToolText, openai_error, openai_item, read_body, read_openai_body, tool_format
from runpod_vlm.tools import read_calls
from runpod_vlm.vocabulary import Generation, GenerationRequest, RequestError, as_request_error

if TYPE_CHECKING:
    from runpod_vlm.engine.engine import Engine

# Fields accepted only at neutral values; a stateful or tool field gets an error that says why.
RESPONSES_UNSUPPORTED = {
    "max_tool_calls": (),
    "reasoning": (),
    "include": ([],),
    "top_logprobs": (0,),
    "background": (False,),
    "background_options": (),
    "access_programs": (),
    "image": (),
    "prompt": (),
    "truncation": ("disabled",),
    "context_management": (),
    "moderation": (),
}
STATELESS = "this worker keeps no responses: send the whole conversation in input"
RESPONSES_IGNORED = (
    "metadata",
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "stream_options",
)


class ResponsesBody(BaseModel, extra="forbid", strict=True):
    input: Any = None
    instructions: Optional[str] = None
    model: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = None
    store: Optional[bool] = None
    text: Optional[dict] = None
    tools: Optional[list] = None  # function tools, in the Responses shape (chat_tools)
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None


def read_responses_body(raw: Any) -> ResponsesBody:
    for name in ("previous_response_id", "conversation"):
        if isinstance(raw, dict) and raw.get(name) is not None:
            raise RequestError("unsupported_parameter", STATELESS, name)
    body = read_body(raw, ResponsesBody, RESPONSES_UNSUPPORTED, RESPONSES_IGNORED)
    if body.store:
        raise RequestError("unsupported_parameter", f"{STATELESS} (send store false, or leave it out)", "store")
    return body


def response_format(body: ResponsesBody) -> Optional[dict]:
    """`text.format` as chat completions' `response_format` (the Responses API flattens json_schema's fields)."""
    form = (body.text or {}).get("format")
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        return form
    return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}


def chat_messages(body: ResponsesBody) -> list:
    """The input items (a string, or messages whose content is a string or input_text / input_image /
    output_text parts) as chat-completions messages, after the instructions as a system message."""
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not isinstance(items, list) or not items:
        raise RequestError("invalid_request", "must be a string or a non-empty list of input items", "input")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":  # a call the model made earlier: consecutive ones are one assistant turn
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {k: item.get(k) for k in ("name", "arguments")},
            }
            if messages and messages[-1].get("tool_calls") and messages[-1]["content"] is None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
            continue
        if kind != "message":
            message = "must be a message, function_call or function_call_output item"
            raise RequestError("invalid_request", message, f"input[{i}]")
        content = item.get("content")
        if isinstance(content, list):
            content = [chat_part(part, f"input[{i}].content[{j}]") for j, part in enumerate(content)]
        messages.append({"role": item.get("role"), "content": content})
    return messages


def chat_tools(body: ResponsesBody) -> dict:
    """The Responses API's function tools and tool_choice (flat: `name` beside `type`) as chat completions' fields."""
    fields: dict = {"parallel_tool_calls": body.parallel_tool_calls}
    if body.tools is not None:
        fields["tools"] = [
            {"type": "function", "function": {k: v for k, v in tool.items() if k not in ("type", "strict")}}
            if isinstance(tool, dict) and tool.get("type") == "function"
            else tool
            for tool in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fields["tool_choice"] = choice
    return fields


def chat_part(part: Any, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        if part.get("image_url") is None:
            raise RequestError("invalid_request", "an input_image needs image_url (file_id is not supported)", where)
        detail = {"detail": part["detail"]} if part.get("detail") is not None else {}
        return {"type": "image_url", "image_url": {"url": part["image_url"], **detail}}
    raise RequestError("invalid_request", "type must be input_text, input_image or output_text", f"{where}.type")


def responses_param(param: Optional[str], offset: int) -> Optional[str]:
    """A chat-completions field path as the Responses body spells it (messages[k] is input[k - offset])."""
    if not param:
        return param
    renamed = {"max_completion_tokens": "max_output_tokens", "max_new_tokens": "max_output_tokens"}.get(param)
    if param.startswith("response_format"):
        return "text.format" + param.removeprefix("response_format").replace(".json_schema", "")
    if renamed:
        return renamed
    param = re.sub(r"^(tools\[\d+\])\.function", r"\1", param).replace(".tool_call_id", ".call_id")
    return re.sub(r"^messages\[(\d+)\]", lambda m: f"input[{int(m.group(1)) - offset}]", param).replace(
        "messages", "input"
    )


def responses_item(body: ResponsesBody, settings, model_id: str) -> GenerationRequest:
    chat = {
        "messages": chat_messages(body),
        "model": body.model,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": response_format(body),
        **chat_tools(body),
    }
    try:
        return openai_item(read_openai_body({k: v for k, v in chat.items() if v is not None}), settings, model_id)
    except RequestError as error:
        offset = 1 if body.instructions else 0
        raise RequestError(error.code, error.message, responses_param(error.param, offset)) from None


class ResponseWriter:
    """The Response object and its stream events, for one answer."""

    def __init__(self, body: ResponsesBody, model_id: str):
        self.body, self.model_id = body, model_id
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created, self.sequence = int(time.time()), 0

    def message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def function_call(call, status: str = "completed") -> dict:
        arguments = call.arguments if status == "completed" else ""
        fields = {"id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id, "name": call.name}
        return {"type": "function_call", **fields, "arguments": arguments, "status": status}

    def response(self, generation: Optional[Generation] = None, text: str = "", calls: tuple = ()) -> dict:
        """The Response: in progress, or done with its message (`text`, left out when a call came with none, as
        OpenAI's) and its function calls."""
        done = generation is not None
        cut = done and generation.finish_reason == "length"
        usage = (
            {
                "input_tokens": generation.prompt_tokens,
                "output_tokens": generation.completion_tokens,
                "total_tokens": generation.prompt_tokens + generation.completion_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
            if done
            else None
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model_id,
            "status": ("incomplete" if cut else "completed") if done else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": (
                [self.message(text, "incomplete" if cut else "completed")] * (bool(text) or not calls)
                + [self.function_call(call) for call in calls]
                if done
                else []
            ),
            "usage": usage,
            "error": None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "parallel_tool_calls": bool(self.body.tools) and self.body.parallel_tool_calls is not False,
            "tool_choice": self.body.tool_choice or ("auto" if self.body.tools else "none"),
            "tools": [{"strict": None, **tool} for tool in self.body.tools or ()],
            "text": {"format": self.body.text.get("format") if self.body.text else {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "metadata": {},
        }

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> str:
        part = {"type": "output_text", "text": "", "annotations": []}
        return (
            self.event("response.created", response=self.response())
            + self.event("response.in_progress", response=self.response())
            + self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
            + self.event("response.content_part.added", part=part, **self.place())
        )

    def delta(self, text: str) -> str:
        return self.event("response.output_text.delta", delta=text, logprobs=[], **self.place())

    def closing(self, generation: Generation, text: str, calls: tuple = ()) -> str:
        """The stream's last events: the message (always opened, so always closed), each function call, the end."""
        final = self.response(generation, text, calls)
        message = self.message(text, "incomplete" if final["status"] == "incomplete" else "completed")
        events = (
            self.event("response.output_text.done", text=text, logprobs=[], **self.place())
            + self.event("response.content_part.done", part=message["content"][0], **self.place())
            + self.event("response.output_item.done", output_index=0, item=message)
        )
        for index, call in enumerate(calls, 1):
            item = self.function_call(call)
            place = {"output_index": index, "item_id": item["id"]}
            events += (
                self.event(
                    "response.output_item.added", output_index=index, item=self.function_call(call, "in_progress")
                )
                + self.event("response.function_call_arguments.delta", delta=call.arguments, **place)
                + self.event("response.function_call_arguments.done", arguments=call.arguments, name=call.name, **place)
                + self.event("response.output_item.done", output_index=index, item=item)
            )
        if calls and not text:  # the message item the stream opened (output 0) stays in its final Response
            final["output"] = [message, *final["output"]]
        return events + self.event(f"response.{final['status']}", response=final)

    def place(self) -> dict:
        return {"output_index": 0, "content_index": 0, "item_id": self.message_id}


async def responses(engine: Engine, item: GenerationRequest, body: ResponsesBody, writer: ResponseWriter):
    """One Response object, or when `body.stream` its events, text at most once per VLM_STREAM_INTERVAL_MS."""
    interval_s = engine.settings.stream_interval_ms / 1000
    opening = writer.opening() if body.stream else ""
    use, opener = item.tool_use, tool_format(engine, item)
    shown = ToolText(use, opener, engine.tokenizer if opener else None, 1)
    async with contextlib.aclosing(paced(answer_pieces(engine, item, [], bool(body.stream)), interval_s)) as sent:
        async for piece, generation in sent:  # the last pair holds the Generation
            if generation is None and (piece := shown.new(0, piece)):
                yield opening + writer.delta(piece)
                opening = ""
    text, calls = generation.text, []
    if use is not None:
        text, calls = read_calls(use, generation.text, generation.raw_text, opener)
        text = text or ""
    if not body.stream:
        yield writer.response(generation, text, tuple(calls))
        return
    last = (shown.last(0, piece, bool(calls)) or "") if use is not None else piece
    yield opening + (writer.delta(last) if last else "") + writer.closing(generation, text, tuple(calls))


async def responses_answers(engine_getter, served_model, job_input: dict):
    """A `/v1/responses` job's answer: a Response, its stream events, or an OpenAI error. Never raises:
    a failure after the first event ends the stream with an `error` event."""
    writer, started = None, False
    try:
        settings, model_id = served_model()
        body = read_responses_body(job_input.get("openai_input"))
        item = await asyncio.to_thread(responses_item, body, settings, model_id)
        engine = await asyncio.to_thread(engine_getter)
        writer = ResponseWriter(body, model_id)
        async with contextlib.aclosing(responses(engine, item, body, writer)) as answers:
            async for answer in answers:
                yield answer
                started = True
    except Exception as failure:
        error = as_request_error(failure)
        if not started:
            yield openai_error(error)
            return
        yield writer.event("error", code=error.code, message=error.message, param=error.param)
