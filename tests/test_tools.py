"""Tool calls with images (tiny Qwen2.5-VL and Qwen3-VL, CPU; the official openai client and langchain-openai on the
local server): the tools reach the model through its own chat template, `required` and a named function give calls
whose arguments validate against the function's parameters even with random weights, streamed deltas join into the
same calls, `auto` reads the card's own format, and a family whose template takes no tools refuses them."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

import handler
from conftest import openai_server
from runpod_vlm.tools import read_calls
from runpod_vlm.vocabulary import ToolUse
from tools.sample_images import data_uri, striped

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ZOOM = {
    "type": "function",
    "function": {
        "name": "zoom",
        "parameters": {
            "type": "object",
            "properties": {"factor": {"type": "integer", "minimum": 2, "maximum": 4}},
            "required": ["factor"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, ZOOM)}


def with_image(text: str) -> list:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(striped((64, 48)))}},
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with openai_server(tiny_model("qwen3-vl"), tmp_path_factory.mktemp("tools") / "server.log") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)


def model_of(client) -> str:
    return client.models.list().data[0].id


def valid(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_a_named_function_gets_a_valid_call_with_an_image(client):
    answer = client.chat.completions.create(
        model=model_of(client),
        messages=with_image("What is the weather where this was taken?"),
        tools=[WEATHER, ZOOM],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    valid(call)


def test_required_gives_valid_calls_streamed_deltas_join_into_the_same(client):
    request = dict(
        model=model_of(client),
        messages=with_image("Zoom in, or look up the weather."),
        tools=[WEATHER, ZOOM],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=3,
        temperature=1.0,
    )
    whole = client.chat.completions.create(**request)
    [call] = whole.choices[0].message.tool_calls
    valid(call)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                joined = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                joined["name"] += delta.function.name or ""
                joined["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}  # seeded: the same call


def test_a_tool_result_in_the_history_is_rendered_by_the_template_and_answered(client, tiny_model, serve):
    messages = [
        *with_image("What is the weather here?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
    ]
    answer = client.chat.completions.create(
        model=model_of(client), messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    engine = serve(tiny_model("qwen3-vl"))
    from runpod_vlm.openai_route import openai_item, read_openai_body

    body = read_openai_body({"messages": messages, "tools": [WEATHER], "tool_choice": "none"})
    prompt = engine.adapter.prompt(engine.processor, openai_item(body, engine.settings, engine.model_id))
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 24C\n</tool_response><|im_end|>" in prompt
    assert prompt.count("<|image_pad|>") == 1


def chat_job(model: str, **body) -> list:
    job = {
        "id": "tools",
        "input": {"openai_route": "/v1/chat/completions", "openai_input": {"messages": with_image("Hi"), **body}},
    }

    async def collect():
        return [answer async for answer in handler.handler(job)]

    return asyncio.run(collect())


def test_the_tokenizer_template_carries_the_tools_where_the_processors_has_none(tiny_model, serve):
    """Qwen2.5-VL's processor template takes no tools, its tokenizer's does (as on the hub): that one renders them."""
    engine = serve(tiny_model("qwen2.5-vl"))
    assert "tools" not in engine.processor.chat_template
    body = dict(tools=[ZOOM], tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    [answer] = chat_job(engine.model_id, **body)
    [call] = answer["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["zoom"])


def test_a_family_whose_template_takes_no_tools_refuses_them_naming_the_field(tiny_model, serve):
    engine = serve(tiny_model("qwen2-vl"))
    [refused] = chat_job(engine.model_id, tools=[WEATHER])
    assert refused["error"]["code"] == "unsupported_parameter" and refused["error"]["param"] == "tools", refused


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": "2"}}\n</tool_call>'


@pytest.mark.parametrize(
    "raw, opener, content, calls",
    [
        ("Let me look.\n" + HERMES, "<tool_call>", "Let me look.", [("get_weather", {"city": "Rome", "days": 2})]),
        (
            HERMES + "\n" + HERMES.replace("Rome", "Paris"),
            "<tool_call>",
            None,
            [("get_weather", {"city": "Rome", "days": 2}), ("get_weather", {"city": "Paris", "days": 2})],
        ),
        ('[TOOL_CALLS][{"name": "zoom", "arguments": {"factor": 3}}]', "[TOOL_CALLS]", None, [("zoom", {"factor": 3})]),
        ('<tool_call>\n{"name": broken\n</tool_call>', "<tool_call>", '<tool_call>\n{"name": broken\n</tool_call>', []),
        ("No call here.", "<tool_call>", "No call here.", []),
    ],
    ids=["hermes", "hermes-parallel", "mistral", "malformed", "text"],
)
def test_auto_reads_calls_in_the_cards_format_and_keeps_the_rest_as_text(raw, opener, content, calls):
    use = ToolUse([WEATHER, ZOOM], "auto")
    text, found = read_calls(use, raw, raw, opener)
    assert text == content
    assert [(call.name, json.loads(call.arguments)) for call in found] == calls  # "2" cast to the schema's integer


def test_langchain_binds_tools_and_structures_output_on_the_local_server(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Zoom(BaseModel):
        """Zoom into the image."""

        factor: int = Field(ge=2, le=4)

    model = model_of(openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0))
    llm = ChatOpenAI(base_url=server + "/v1", api_key="x", model=model, max_tokens=200, max_retries=0)
    called = llm.bind_tools([Zoom], tool_choice="Zoom").invoke("Zoom in twice.")
    assert called.tool_calls[0]["name"] == "Zoom" and 2 <= called.tool_calls[0]["args"]["factor"] <= 4
    structured = llm.with_structured_output(Zoom).invoke("How much should I zoom?")
    assert isinstance(structured, Zoom) and 2 <= structured.factor <= 4


def test_the_responses_api_takes_function_tools_and_their_outputs(client):
    from openai.types.responses import Response

    tools = [{"type": "function", **WEATHER["function"]}]
    image = {"type": "input_image", "image_url": data_uri(striped((64, 48)))}
    ask = [{"role": "user", "content": [image, {"type": "input_text", "text": "Weather here?"}]}]
    request = dict(
        model=model_of(client), input=ask, tools=tools, tool_choice={"type": "function", "name": "get_weather"}
    )
    response = client.responses.create(**request, max_output_tokens=60)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and response.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    events = list(client.responses.create(**request, max_output_tokens=60, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_weather"
    jsonschema.validate(json.loads(done[0].arguments), SCHEMAS["get_weather"])
    final = Response.model_validate(events[-1].response.model_dump())
    assert [item.type for item in final.output][-1] == "function_call"
    history = [
        *ask,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    answered = client.responses.create(
        model=model_of(client), input=history, tools=tools, tool_choice="none", max_output_tokens=4
    )
    assert answered.output[0].type == "message" and answered.usage.input_tokens > response.usage.input_tokens
