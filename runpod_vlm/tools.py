"""Tool calls: OpenAI's function tools read from a request, the calls a constrained answer must be, and the calls
read back from a model's answer in its family's own format.

The tools reach the model through its own chat template (FamilyAdapter.tool_template). With `tool_choice`
`required` or a named function the answer is constrained, token by token, to JSON of the call (the arguments
valid against the function's parameters), as vLLM constrains them: even a model that would not call gives a
valid call. With `auto` the model writes freely and its calls are read in its card's format by transformers'
response parser (`TOOL_FORMATS`): Hermes-style `<tool_call>` blocks (Qwen2.5-VL, Qwen3-VL) or Mistral's
`[TOOL_CALLS]` list.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Optional

from runpod_vlm.vocabulary import RequestError, ToolUse, join_param

# transformers' response templates of the calls' formats, and the text that opens a call in each.
TOOL_FORMATS = {
    "<tool_call>": {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "content": {},
            "tool_calls": {
                "open": "<tool_call>",
                "close": "</tool_call>",
                "content": "json",
                "repeats": True,
                "transform": {
                    "type": "function",
                    "function": {"name": "{content.name}", "arguments": "{content.arguments}"},
                },
            },
        },
    },
    "[TOOL_CALLS]": {
        "start_anchor": "[/INST]",
        "fields": {
            "content": {},
            "tool_calls": {
                "open": "[TOOL_CALLS]",
                "content": "json",
                "transform_each": True,
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
            },
        },
    },
}


def read_tools(
    tools: Any, tool_choice: Any, parallel: Optional[bool], param: Optional[str] = None
) -> Optional[ToolUse]:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (chat completions' shapes) -> a ToolUse, or None
    when no tool is given; refused naming the field."""
    where = lambda name: join_param(param, name)  # noqa: E731
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise RequestError("invalid_request", "names a tool, but no tools are given", where("tool_choice"))
        return None
    if not isinstance(tools, list):
        raise RequestError("invalid_request", "must be a list of function tools", where("tools"))
    functions: list[dict] = []
    for n, tool in enumerate(tools):
        at = where(f"tools[{n}]")
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(tool, dict) and isinstance(tool.get("type"), str) and tool["type"] != "function":
            raise RequestError("unsupported_parameter", "only function tools are supported", f"{at}.type")
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestError("invalid_request", 'must be {"type": "function", "function": {...}}', at)
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise RequestError("invalid_request", "needs a name of 1 to 64 characters", f"{at}.function.name")
        if any(f["function"]["name"] == name for f in functions):
            raise RequestError("invalid_request", "two tools have this name", f"{at}.function.name")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise RequestError("invalid_request", "must be a JSON schema object", f"{at}.function.parameters")
        described = {"description": function["description"]} if isinstance(function.get("description"), str) else {}
        functions.append({"type": "function", "function": {"name": name, **described, "parameters": parameters}})
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        choice = named.get("name") if isinstance(named, dict) else None
        if choice not in {f["function"]["name"] for f in functions}:
            message = 'must be auto, none, required or {"type": "function", "function": {"name": <a tool>}}'
            raise RequestError("invalid_request", message, where("tool_choice"))
    elif choice not in ("auto", "none", "required"):
        raise RequestError("invalid_request", "must be auto, none, required or a named function", where("tool_choice"))
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("invalid_request", "must be true or false", where("parallel_tool_calls"))
    return ToolUse(functions, choice, True if parallel is None else parallel)


def call_schema(use: ToolUse) -> Optional[dict]:
    """The JSON schema a constrained answer follows (`required` or a named function); None for `auto` and `none`.
    A named function's answer is its arguments; `required`'s a list of calls, one unless parallel."""
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in use.tools}
    if use.choice in ("auto", "none"):
        return None
    if use.choice != "required":
        return by_name[use.choice]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in by_name.items()
    ]
    listed: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not use.parallel:
        listed["maxItems"] = 1
    return listed


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: Optional[int] = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def read_calls(use: ToolUse, text: str, raw_text: Optional[str], opener: Optional[str]) -> tuple[Optional[str], list]:
    """An answer's content and tool calls. A constrained answer is JSON of its calls (`call_schema`); an `auto` one
    is read in its family's format (`opener`'s response template) from `raw_text`, its special tokens kept. What
    cannot be read as calls stays the answer's text."""
    if use.choice == "none":
        return text, []
    if use.choice not in ("auto", "required"):
        return (None, [ToolCall(use.choice, text)]) if _is_json(text) else (text, [])
    if use.choice == "required":
        try:
            return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []
    if opener is None or raw_text is None or opener not in raw_text:
        return text, []
    from transformers.utils.chat_parsing.response_parser import parse_response

    template = TOOL_FORMATS[opener]
    try:
        message = parse_response(raw_text, template, prefix=template["start_anchor"], tools=use.tools)
        functions = [call["function"] for call in message.get("tool_calls") or []]
        calls = [
            ToolCall(f["name"], f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"]))
            for f in functions
        ]
    except Exception:  # the model's call is not JSON: its text is the answer
        return text, []
    content = (message.get("content") or "").strip() or None
    return content, calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
