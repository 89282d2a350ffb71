"""The OpenAI route: jobs {"openai_route": ..., "openai_input": ...} as RunPod's /openai/v1 gateway
sends them, and the local server (scripts/openai_server.py) with the official `openai` client.

Every answer is validated with the `openai` package's own types; the tiny Qwen2-VL runs on CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import typing
import urllib.error
import urllib.request

import openai
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.completion_create_params import CompletionCreateParamsBase

import handler
from conftest import openai_server
from runpod_vlm.families.native import QwenVLAdapter
from runpod_vlm.openai_route import OPENAI_IGNORED, OPENAI_UNSUPPORTED, ChatCompletionBody, openai_answers
from runpod_vlm.settings import Settings
from runpod_vlm.vocabulary import Generation, StreamDelta
from tools.sample_images import data_uri, striped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def engine(tiny_model, serve):
    return serve(tiny_model("qwen2-vl"))


def answers(job_input: dict, engine_getter=handler.get_engine) -> list:
    """Everything the route yields for one job."""

    async def collect():
        return [answer async for answer in openai_answers(engine_getter, handler.served_model, job_input)]

    return asyncio.run(collect())


def completion(body: dict, engine_getter=handler.get_engine) -> dict:
    [answer] = answers({"openai_route": "/v1/chat/completions", "openai_input": body}, engine_getter)
    return answer


def stream_events(body: dict, engine_getter=handler.get_engine) -> list[dict]:
    """The streamed answer's events, checked to be `data: ...` lines ending with [DONE]."""
    yielded = answers({"openai_route": "/v1/chat/completions", "openai_input": dict(body, stream=True)}, engine_getter)
    assert all(isinstance(piece, str) for piece in yielded), yielded
    text = "".join(yielded)
    assert text.endswith("data: [DONE]\n\n")
    blocks = text.split("\n\n")[:-1]
    assert all(block.startswith("data: ") for block in blocks)
    return [json.loads(block[len("data: ") :]) for block in blocks[:-1]]


def streamed_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def image_message(url: str, text: str = "What is in the picture?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
                {"type": "text", "text": text},
            ],
        }
    ]


GREEDY = {"temperature": 0, "max_tokens": 6}


# ---- answers in OpenAI's shapes -----------------------------------------------------------------


def test_a_completion_parses_strictly_as_openai_chat_completion(engine):
    out = completion(
        {
            "model": engine.model_id,
            "messages": image_message(data_uri(striped())),
            **GREEDY,
            "user": "someone",
            "seed": 7,
            "metadata": {"k": "v"},
        }
    )
    parsed = ChatCompletion.model_validate(out, strict=True)
    assert parsed.object == "chat.completion" and parsed.model == engine.model_id
    [choice] = parsed.choices
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and parsed.usage.completion_tokens == 6
    assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + 6 and parsed.usage.prompt_tokens > 0


def test_the_same_body_gives_the_native_route_s_text_and_tokens(engine):
    """The OpenAI body is read as the native request it translates to: same prompt (a developer
    message is a system message), same greedy tokens."""
    image = data_uri(striped((64, 48)))
    openai_messages = [{"role": "developer", "content": "Answer briefly."}, *image_message(image)]
    native_messages = [{"role": "system", "content": "Answer briefly."}, *image_message(image)]
    out = completion({"messages": openai_messages, "temperature": 0, "max_completion_tokens": 7})
    native = asyncio.run(handler.local_test_answer({"input": {"messages": native_messages, "max_new_tokens": 7}}))
    assert out["choices"][0]["message"]["content"] == native["response"]
    assert out["usage"]["prompt_tokens"] == native["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == native["usage"]["completion_tokens"] == 7


def test_max_completion_tokens_wins_over_max_tokens(engine):
    # OpenAI deprecates max_tokens; a body with both is read as vLLM reads it.
    body = {"messages": TEXT, "temperature": 0, "max_tokens": 9, "max_completion_tokens": 4}
    assert completion(body)["usage"]["completion_tokens"] == 4
    refused = completion({**body, "max_tokens": 2, "max_completion_tokens": 0})
    assert refused["error"]["param"] == "max_completion_tokens"


def test_a_streamed_answer_is_chat_completion_chunks_with_role_finish_and_usage(engine):
    body = {"messages": image_message(data_uri(striped())), **GREEDY}
    whole = completion(body)
    chunks = stream_events(dict(body, stream_options={"include_usage": True}))
    parsed = [ChatCompletionChunk.model_validate(chunk, strict=True) for chunk in chunks]
    assert len({p.id for p in parsed}) == 1 and all(p.object == "chat.completion.chunk" for p in parsed)
    with_choices = [p for p in parsed if p.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert [p.choices[0].finish_reason for p in with_choices] == [None] * (len(with_choices) - 1) + ["length"]
    assert with_choices[-1].choices[0].delta.content is not None  # the finish rides on a content chunk
    usage_chunk = parsed[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump() == dict(
        whole["usage"], completion_tokens_details=None, prompt_tokens_details=None
    )
    assert all(p.usage is None for p in parsed[:-1])
    assert streamed_text(chunks) == whole["choices"][0]["message"]["content"]


def test_a_stream_brings_the_text_as_the_engine_produces_it(engine, monkeypatch):
    monkeypatch.setattr(engine, "settings", dataclasses.replace(engine.settings, stream_interval_ms=0))
    steps = engine.settings.sync_interval  # the engine hands out tokens every `steps` decode steps
    body = {"messages": image_message(data_uri(striped())), "temperature": 0, "max_tokens": 3 * steps, "stream": True}
    yielded = answers({"openai_route": "/v1/chat/completions", "openai_input": body})
    assert len(yielded) >= 3, yielded  # pieces as they come, not the whole answer at the end
    chunks = [json.loads(event[len("data: ") :]) for event in "".join(yielded).split("\n\n")[:-2]]
    assert sum(bool(c["choices"] and c["choices"][0]["delta"].get("content")) for c in chunks) >= 2
    whole = completion(dict(body, stream=False))
    assert streamed_text(chunks) == whole["choices"][0]["message"]["content"]


def test_a_stream_without_include_usage_has_no_usage_chunk(engine):
    chunks = stream_events({"messages": [{"role": "user", "content": "Hi"}], **GREEDY})
    assert all(chunk["choices"] for chunk in chunks) and all("usage" not in chunk for chunk in chunks)


def test_models_is_a_list_of_one_openai_model(engine):
    [out] = answers({"openai_route": "/v1/models"})
    assert out["object"] == "list"
    [model] = [Model.model_validate(entry, strict=True) for entry in out["data"]]
    assert model.id == engine.model_id and model.object == "model"


def test_the_entry_point_sends_openai_jobs_to_the_route(engine):
    job = {"id": "job-1", "input": {"openai_route": "/v1/models"}}
    if inspect.isasyncgenfunction(handler.handler):  # the streaming entry point

        async def collect():
            return [answer async for answer in handler.handler(job)]

        result = asyncio.run(collect())
    else:
        result = [handler.handler(job)]
    assert result == [{"object": "list", "data": [dict(result[0]["data"][0], id=engine.model_id)]}]


# ---- stop sequences -----------------------------------------------------------------------------


def test_stop_ends_the_answer_before_the_stop_text(engine):
    body = {"messages": image_message(data_uri(striped())), "temperature": 0, "max_tokens": 12}
    text = completion(body)["choices"][0]["message"]["content"]
    assert len(text) >= 4, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = text[: text.find(stop)]
    out = completion(dict(body, stop=[stop, "never in this answer"]))
    assert out["choices"][0]["message"]["content"] == expected
    assert out["choices"][0]["finish_reason"] == "stop"
    assert streamed_text(stream_events(dict(body, stop=stop))) == expected


class FakeTicket:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class ScriptedEngine:
    """An engine whose answer is scripted: its deltas (when asked to stream), then the Generation.
    It records each item, whether it was asked to stream, and its ticket."""

    model_id = "scripted-model"
    settings = Settings(stream_interval_ms=0)  # a chunk for every piece

    def __init__(self, pieces: list[str], final: Generation | None = None):
        self.pieces, self.submitted = pieces, []
        self.final = final or Generation(
            "".join(pieces).strip(), "length", prompt_tokens=11, completion_tokens=len(pieces)
        )

    def submit_all(self, items, listeners, stream=False, same_prompt=False):
        return [self.submit(item, listener, stream) for item, listener in zip(items, listeners)]

    def submit(self, item, listener, stream=False):
        ticket = FakeTicket()
        self.submitted.append((item, stream, ticket))
        for count, piece in enumerate(self.pieces if stream else [], 1):
            listener(StreamDelta(piece, count, self.final.prompt_tokens))
        listener(self.final)
        return ticket


def test_a_stop_split_across_deltas_is_never_shown_and_the_item_is_cancelled():
    engine = ScriptedEngine(["Hello wo", "rld EN", "D and", " more"])
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": "END", "stream_options": {"include_usage": True}}
    chunks = stream_events(body, lambda: engine)
    contents = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]]
    assert contents == ["", "Hello wo", "rld ", ""]  # "EN" waited: it could begin the stop
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, None, "stop"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    [(_, streamed, ticket)] = engine.submitted
    assert streamed and ticket.cancelled

    out = completion(dict(body, stream_options=None), lambda: engine)
    assert out["choices"][0]["message"]["content"] == "Hello world "
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 3
    assert engine.submitted[-1][1] and engine.submitted[-1][2].cancelled  # deltas asked for: a stop may come


def test_held_back_text_that_is_no_stop_is_shown_at_the_end():
    engine = ScriptedEngine(["a b E", "N "])
    chunks = stream_events({"messages": [{"role": "user", "content": "Hi"}], "stop": ["END"]}, lambda: engine)
    assert streamed_text(chunks) == "a b EN" == engine.final.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_whole_answer_without_stop_does_not_ask_for_deltas():
    engine = ScriptedEngine(["one", " two"])
    out = completion({"messages": [{"role": "user", "content": "Hi"}]}, lambda: engine)
    assert out["choices"][0]["message"]["content"] == "one two" and engine.submitted[0][1] is False


# ---- the worker's extras ------------------------------------------------------------------------


def test_grounding_returns_the_box_in_the_message_and_in_the_vlm_field():
    """A scripted Qwen answer (a box in Qwen's 0-1000 frame) shows how the box is returned."""
    box_answer = Generation(
        "a stripe(100,200),(500,1000)",
        "stop",
        prompt_tokens=20,
        completion_tokens=9,
        raw_text="<|object_ref_start|>a stripe<|object_ref_end|><|box_start|>(100,200),(500,1000)<|box_end|>",
    )
    engine = ScriptedEngine(["a stripe"], box_answer)
    engine.adapter = QwenVLAdapter()
    body = {
        "messages": image_message(data_uri(striped((200, 100))), ""),
        "vlm": {"task": "grounding", "target": "a stripe"},
    }
    out = completion(body, lambda: engine)
    [(item, _, _)] = engine.submitted
    assert item.task == "grounding" and item.grounding_target == "a stripe"
    assert ChatCompletion.model_validate(out, strict=True).model_extra["vlm"] == out["vlm"]  # as clients see it
    box = {
        "bbox": [20, 20, 100, 100],
        "supports_grounding": True,
        "box_format": "qwen-1000",
        "image_size": [200, 100],
        "boxes": [{"bbox": [20, 20, 100, 100], "label": "a stripe"}],
        "resolution_wh": [200, 100],
        "input_wh": None,  # the stand-in engine's answer has no resized input
    }
    assert out["vlm"] == {"task": "grounding", **box}
    message = json.loads(out["choices"][0]["message"]["content"])
    assert message == {**box, "response": box_answer.text}
    [last] = [c for c in stream_events(body, lambda: engine) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert json.loads(last["choices"][0]["delta"]["content"]) == message and last["vlm"] == out["vlm"]


# ---- errors -------------------------------------------------------------------------------------

TEXT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "body, code, param",
    [
        ({"messages": TEXT, "n": 99}, "invalid_request", "n"),
        ({"messages": TEXT, "tools": [{"type": "function"}]}, "invalid_request", "tools[0]"),
        (
            {"messages": TEXT, "tools": [{"type": "function", "function": {"name": ""}}]},
            "invalid_request",
            "tools[0].function.name",
        ),
        ({"messages": TEXT, "tool_choice": "required"}, "invalid_request", "tool_choice"),
        (
            {"messages": TEXT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "g"},
            "invalid_request",
            "tool_choice",
        ),
        ({"messages": [{"role": "tool", "content": "42"}]}, "invalid_request", "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    *TEXT,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    },
                    *TEXT,
                ]
            },
            "invalid_request",
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": TEXT, "response_format": {"type": "xml"}}, "invalid_request", "response_format.type"),
        ({"messages": TEXT, "logprobs": True, "top_logprobs": 21}, "invalid_request", "top_logprobs"),
        ({"messages": TEXT, "top_logprobs": 2}, "invalid_request", "top_logprobs"),
        ({"messages": TEXT, "presence_penalty": 0.5}, "unsupported_parameter", "presence_penalty"),
        ({"messages": TEXT, "top_k": 5}, "invalid_request", "top_k"),
        ({"messages": TEXT, "temperature": "hot"}, "invalid_request", "temperature"),
        ({"messages": TEXT, "temperature": 3}, "invalid_request", "temperature"),
        ({"messages": TEXT, "max_tokens": 10**6}, "invalid_request", "max_tokens"),
        ({"messages": TEXT, "max_completion_tokens": 0}, "invalid_request", "max_completion_tokens"),
        ({"messages": TEXT, "stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
        ({"messages": TEXT, "stream_options": {"include_usage": True}}, "invalid_request", "stream_options"),
        ({"messages": TEXT, "model": "gpt-4o"}, "model_mismatch", "model"),
        ({"messages": [{"role": "function", "content": "42"}]}, "invalid_request", "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "invalid_request",
            "messages[0].content[0].type",
        ),
        (
            {"messages": image_message("http://127.0.0.1:9/x.png")},
            "blocked_url",
            "messages[0].content[0].image_url.url",
        ),
        ({"messages": [{"role": "user", "content": "x" * 40_000}]}, "text_too_long", "messages"),
        ({"messages": TEXT, "vlm": {"task": "grounding", "target": "a cat"}}, "missing_image", "messages"),
        ({"messages": TEXT, "vlm": {"task": "grounding"}}, "invalid_request", "vlm.target"),
        ({"messages": TEXT, "vlm": {"task": "grounding", "target": "x"}, "stop": "y"}, "invalid_request", "stop"),
        ({"messages": TEXT, "vlm": {"task": "detect"}}, "invalid_request", "vlm.task"),
        ({"model": "x"}, "invalid_request", "messages"),
        ("not an object", "invalid_request", None),
    ],
)
def test_a_refused_body_gets_an_openai_error_naming_the_field(body, code, param, monkeypatch):
    for name in ("VLM_ALLOW_INTERNAL_URLS", "VLM_MAX_TEXT_CHARS", "VLM_MAX_NEW_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    out = completion(body, engine_getter=lambda: pytest.fail("a refused body must not reach the engine"))
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["type"] == "invalid_request_error"
    assert (out["error"]["code"], out["error"]["param"]) == (code, param), out
    assert out["error"]["message"].startswith(f"{param}: " if param else "the request body")


def test_an_unknown_route_is_refused(engine):
    [out] = answers({"openai_route": "/v1/completions", "openai_input": {"prompt": "Hi"}})
    assert out["error"]["param"] == "openai_route" and "/v1/chat/completions" in out["error"]["message"]


def test_a_context_overflow_found_by_the_engine_names_the_openai_field(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "context_length", 40)  # the prompt alone is over 20 tokens
    limit = 30
    out = completion({"messages": TEXT, "max_tokens": limit})
    assert (out["error"]["code"], out["error"]["param"]) == ("context_too_long", "max_tokens")
    chunks = answers(
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": TEXT, "max_tokens": limit, "stream": True},
        }
    )
    assert chunks == [out]  # refused before any event: a plain error, not a stream


def test_every_openai_field_is_known_to_the_route():
    """No field of OpenAI's chat-completions body is refused as unknown: each is honoured, ignored
    or refused with its reason (this fails when a new openai release adds a field)."""
    known = set(ChatCompletionBody.model_fields) | set(OPENAI_UNSUPPORTED) | set(OPENAI_IGNORED)
    assert set(CompletionCreateParamsBase.__annotations__) | {"stream"} <= known


# ---- the local server and the official client ---------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """Base URL of scripts/openai_server.py serving the tiny Qwen2-VL (loopback only). It may fetch
    from loopback (VLM_ALLOW_INTERNAL_URLS=true) for the http image test."""
    log_path = tmp_path_factory.mktemp("openai-server") / "server.log"
    with openai_server(tiny_model("qwen2-vl"), log_path, VLM_ALLOW_INTERNAL_URLS="true") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)


def test_client_lists_the_served_model(client, tiny_model):
    assert [m.id for m in client.models.list()] == [str(tiny_model("qwen2-vl"))]


def test_client_chat_with_a_data_uri_matches_the_route_in_process(client, engine):
    body = {"model": engine.model_id, "messages": image_message(data_uri(striped())), **GREEDY}
    answer = client.chat.completions.create(**body)
    expected = completion(body)
    assert answer.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert answer.usage.prompt_tokens == expected["usage"]["prompt_tokens"] and answer.usage.completion_tokens == 6
    streamed = client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6


def test_client_chat_with_an_http_image_url_streamed_and_not(client, image_server):
    url, requested = image_server.url, image_server.requests
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=image_message(url), **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=image_message(url), stream=True, **GREEDY))
    assert requested == ["/x.png", "/x.png"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason == "length"


def test_client_stop_cuts_the_text(client, engine):
    body = {"model": engine.model_id, "messages": TEXT, "temperature": 0, "max_tokens": 12}
    text = client.chat.completions.create(**body).choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(**body, stop=stop).choices[0]
    assert cut.message.content == text[: text.find(stop)] and cut.finish_reason == "stop"


def test_client_raises_bad_request_with_our_message(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=TEXT)
    assert raised.value.code == "model_mismatch" and raised.value.param == "model"
    assert "cannot switch to 'gpt-4o'" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=image_message("ftp://example.com/x.png"), stream=True
        )
    assert raised.value.code == "invalid_image_url"
    assert raised.value.param == "messages[0].content[0].image_url.url"


def test_the_openai_prefixed_paths_answer_too(server):
    with urllib.request.urlopen(server + "/openai/v1/models", timeout=30) as response:
        assert json.loads(response.read())["data"][0]["object"] == "model"


def test_the_official_client_gets_logprobs(client):
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, messages=TEXT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == entry.top_logprobs[0].logprob <= 0 for entry in content)  # greedy: the likeliest


def test_the_official_client_parses_a_structured_answer(client):
    import pydantic

    class Verdict(pydantic.BaseModel):
        ok: bool
        colour: typing.Literal["red", "green", "blue"]

    model = client.models.list().data[0].id
    parsed = client.chat.completions.parse(
        model=model, messages=TEXT, response_format=Verdict, max_tokens=60, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, Verdict)  # the client validated the answer
