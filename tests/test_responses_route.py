"""OpenAI's Responses API (/v1/responses) on the tiny Qwen2-VL: the route's objects and events checked
with the `openai` package's own types, the same tokens as the native route, clear refusals of what
the worker does not keep or do, and the official client's `responses.create` against the local server."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.responses import Response, ResponseCreateParams
from pydantic import TypeAdapter

import handler
from conftest import openai_server
from runpod_vlm.responses_route import RESPONSES_IGNORED, RESPONSES_UNSUPPORTED, ResponsesBody
from tools.sample_images import data_uri, striped

EVENTS = TypeAdapter(openai.types.responses.ResponseStreamEvent)


@pytest.fixture
def engine(tiny_model, serve):
    return serve(tiny_model("qwen2-vl"))


def answers(body: dict) -> list:
    job = {"id": "responses", "input": {"openai_route": "/v1/responses", "openai_input": body}}

    async def collect():
        return [answer async for answer in handler.handler(job)]

    return asyncio.run(collect())


def events_of(stream: str) -> list[dict]:
    """The SSE events of a streamed answer, each `event: <type>` matching its data's type."""
    events = []
    for block in filter(None, stream.split("\n\n")):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[6:])
        assert event["type"] == kind[7:]
        events.append(event)
    return events


IMAGE_INPUT = [
    {
        "role": "user",
        "content": [
            {"type": "input_image", "image_url": data_uri(striped((64, 48)))},
            {"type": "input_text", "text": "What is in the picture?"},
        ],
    }
]


def test_a_response_parses_as_openai_response_and_matches_the_native_route(engine):
    [out] = answers({"input": IMAGE_INPUT, "instructions": "Answer briefly.", "max_output_tokens": 6, "temperature": 0})
    response = Response.model_validate(out)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.store is False
    native_messages = [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": IMAGE_INPUT[0]["content"][0]["image_url"]}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        },
    ]
    native = asyncio.run(handler.local_test_answer({"input": {"messages": native_messages, "max_new_tokens": 6}}))
    assert response.output_text == native["response"]
    assert response.usage.input_tokens == native["usage"]["prompt_tokens"]


def test_an_input_images_detail_bounds_its_tokens_as_on_the_chat_route(tiny_model, serve):
    """OpenAI's `detail: "low"` (an image of 512x512 at most) on an input_image, as on an image_url block."""
    serve(tiny_model("qwen2-vl"), VLM_MAX_PIXELS="600000")  # above 512x512: the tiny processor's own bound is not
    big = data_uri(striped((800, 600)))

    def prompt_tokens(detail=None) -> int:
        part = {"type": "input_image", "image_url": big, **({"detail": detail} if detail else {})}
        body = {"input": [{"role": "user", "content": [part, {"type": "input_text", "text": "Hi"}]}]}
        [out] = answers({**body, "max_output_tokens": 1})
        return Response.model_validate(out).usage.input_tokens

    low, high = prompt_tokens("low"), prompt_tokens("high")
    assert low < high == prompt_tokens()
    chat_low = {"type": "image_url", "image_url": {"url": big, "detail": "low"}}
    native = {
        "messages": [{"role": "user", "content": [chat_low, {"type": "text", "text": "Hi"}]}],
        "max_new_tokens": 1,
    }
    assert low == asyncio.run(handler.local_test_answer({"input": native}))["usage"]["prompt_tokens"]
    [refused] = answers(
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": big, "detail": "x"}]}]}
    )
    assert refused["error"]["param"] == "input[0].content[0].image_url.detail", refused


def test_a_string_input_and_an_earlier_assistant_turn(engine):
    [out] = answers({"input": "Hi", "max_output_tokens": 3, "temperature": 0})
    assert Response.model_validate(out).usage.output_tokens <= 3
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "And now?"},
    ]
    [out] = answers({"input": turns, "max_output_tokens": 3, "temperature": 0})
    assert Response.model_validate(out).status in ("completed", "incomplete")


def test_a_streamed_response_is_the_responses_events_in_order(engine):
    body = {"input": IMAGE_INPUT, "max_output_tokens": 12, "temperature": 0}
    [whole] = answers(body)
    events = events_of("".join(answers({**body, "stream": True})))
    for event in events:
        EVENTS.validate_python(event)
    kinds = [event["type"] for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    deltas = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert deltas == events[-4]["text"] == Response.model_validate(whole).output_text
    assert Response.model_validate(events[-1]["response"]).usage.output_tokens == 12


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"input": "Hi", "store": True}, "store", "unsupported_parameter"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_request"),
        ({"input": []}, "input", "invalid_request"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "invalid_request"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "invalid_request"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
            "invalid_request",
        ),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_request"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,%%"}]}
                ]
            },
            "input[0].content[0].image_url.url",
            "invalid_base64",
        ),
        ({"input": "Hi", "temprature": 1}, "temprature", "invalid_request"),
    ],
)
def test_what_the_worker_does_not_do_is_refused_naming_the_field(engine, body, param, code):
    [out] = answers(body)
    assert out["error"]["param"] == param and out["error"]["code"] == code, out
    assert out["error"]["type"] == "invalid_request_error"


def test_text_format_json_schema_constrains_the_answer(engine):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    form = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    [out] = answers({"input": "Is it fine?", "text": {"format": form}, "max_output_tokens": 40, "temperature": 0})
    response = Response.model_validate(out)
    assert response.text.format.type == "json_schema" and json.loads(response.output_text) in (
        {"ok": True},
        {"ok": False},
    )


def test_every_responses_field_is_known_to_the_route():
    """No field of OpenAI's Responses body is refused as unknown: each is honoured, ignored or refused
    with its reason (this fails when a new openai release adds a field)."""
    stateful = {"previous_response_id", "conversation"}
    known = set(ResponsesBody.model_fields) | set(RESPONSES_UNSUPPORTED) | set(RESPONSES_IGNORED) | stateful
    fields = set().union(*(getattr(t, "__annotations__", {}) for t in ResponseCreateParams.__args__))
    assert fields <= known, sorted(fields - known)


# ---- the official client against the local server -------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    with openai_server(tiny_model("qwen2-vl"), tmp_path_factory.mktemp("responses-server") / "server.log") as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


def test_the_official_client_creates_responses_streamed_and_not(client):
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input=IMAGE_INPUT, max_output_tokens=5, temperature=0)
    assert isinstance(response, Response) and response.usage.output_tokens == 5
    streamed = client.responses.create(model=model, input=IMAGE_INPUT, max_output_tokens=5, temperature=0, stream=True)
    events = list(streamed)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input="Hi", previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"
