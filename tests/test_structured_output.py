"""Structured output: a tiny random-weight model constrained token by token to a JSON schema (llguidance)
always answers JSON that validates; rows without a schema in the same batch keep their own tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

import handler
from runpod_vlm.openai_route import openai_answers
from tools.sample_images import data_uri, striped
from tools.sample_schemas import SCHEMAS

# Bounded schemas (no free whitespace, capped strings and arrays): a random model must close them in time.


def validate(text: str, schema: dict) -> None:
    import jsonschema

    jsonschema.validate(json.loads(text), schema)


def ask(payload: dict) -> dict:
    return asyncio.run(handler.local_test_answer({"id": "structured", "input": payload}))


def constrained(schema: dict, **extra) -> dict:
    return {
        "task": "vqa",
        "image_url": data_uri(striped()),
        "question": "Describe it as JSON.",
        "max_new_tokens": 300,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        **extra,
    }


@pytest.fixture
def engine(tiny_model, serve):
    return serve(tiny_model("qwen2-vl"))


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize(
    "sampling", [{}, {"do_sample": True, "temperature": 1.3, "seed": 4}], ids=["greedy", "sampled"]
)
def test_answers_always_parse_and_validate(engine, name, sampling):
    out = ask(constrained(SCHEMAS[name], **sampling))
    assert out["finish_reason"] == "stop", out
    validate(out["response"], SCHEMAS[name])


def test_a_batch_mixing_constrained_and_free_rows_keeps_the_free_rows_tokens(engine):
    free = [
        {"messages": [{"role": "user", "content": "Say something."}], "max_new_tokens": 20, "min_new_tokens": 20},
        {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 12},
    ]
    alone = [ask(item)["response"] for item in free]
    results = ask({"requests": [free[0], constrained(SCHEMAS["nested"]), free[1], constrained(SCHEMAS["flat"])]})
    assert [results["results"][0]["response"], results["results"][2]["response"]] == alone
    for index, name in ((1, "nested"), (3, "flat")):
        validate(results["results"][index]["response"], SCHEMAS[name])


def test_json_object_and_refusals_name_the_field(engine):
    out = ask(constrained({}, response_format={"type": "json_object"}, max_new_tokens=60))
    assert out["response"].startswith("{")
    refused = ask(constrained({}, response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert refused["code"] == "invalid_request" and refused["param"] == "response_format.json_schema.schema"
    assert ask(constrained(SCHEMAS["flat"], min_new_tokens=3))["param"] == "min_new_tokens"
    unsupported = {"type": "object", "properties": {"a": {"type": "string", "format": "hostname-x"}}}
    refused = ask(constrained(unsupported))
    assert refused["code"] == "invalid_request" and refused["param"] == "response_format", refused
    assert "not supported" in json.loads(refused["error"])["error_message"]


def test_the_openai_route_takes_response_format(engine):
    schema = SCHEMAS["nested"]
    body = {
        "messages": [{"role": "user", "content": "JSON, please."}],
        "max_tokens": 300,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}},
    }

    async def completion():
        job = {"openai_route": "/v1/chat/completions", "openai_input": body}
        return [answer async for answer in openai_answers(handler.get_engine, handler.served_model, job)][0]

    answer = asyncio.run(completion())
    validate(answer["choices"][0]["message"]["content"], schema)


# ---- hostile schemas: built off the engine thread, bounded, and never a `stop` on broken JSON -----------------


def optional_integers(count: int) -> dict:
    """An object of `count` optional integer properties: llguidance's parser fails on one of ~500 and more."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


def largest_gap_beside(job_input: dict, beside: dict) -> tuple[float, float, dict]:
    """The longest wait between a stream's chunks while `beside` is answered next to it, how long `beside` took,
    and its answer."""

    async def run():
        stream = handler.handler({"id": "stream", "input": job_input})
        await anext(stream)  # rows decoding already
        arrivals: list[float] = []

        async def read():
            async for _ in stream:
                arrivals.append(time.monotonic())

        reader = asyncio.create_task(read())
        started = time.monotonic()
        answered = [out async for out in handler.handler({"id": "beside", "input": beside})][-1]
        ended = time.monotonic()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await stream.aclose()
        during = [started, *(t for t in arrivals if started <= t <= ended), ended]
        return max(b - a for a, b in zip(during, during[1:])), ended - started, answered

    return asyncio.run(run())


def test_a_huge_schema_never_stalls_a_stream_beside_it_and_its_refusal_is_remembered(tiny_model, serve):
    serve(tiny_model("qwen2-vl"), VLM_MAX_SCHEMA_BYTES="1000000")
    talk = {"messages": [{"role": "user", "content": "Talk."}], "stream": True}
    talk.update(max_new_tokens=2000, min_new_tokens=2000)
    huge = constrained(optional_integers(5000), max_new_tokens=20)  # seconds to build (a 145 KiB schema)
    gap, building, refused = largest_gap_beside(talk, huge)
    # Built in the stream's way, the grammar would hold it for all of its build (seconds). On 2 busy cores the stream's
    # own chunks wait up to ~0.6 s, so the bound grows with the build, which a busy machine slows too.
    assert building > 1, f"the schema took {building:.2f}s: too quick to tell a stall"
    assert gap < max(0.5, building / 4), f"a stream waited {gap:.2f}s of the grammar's {building:.2f}s build"
    assert refused["code"] == "invalid_request" and refused["param"] == "response_format", refused
    assert "max is 2000" in json.loads(refused["error"])["error_message"]  # llguidance's own words, on one line
    started = time.monotonic()
    assert ask(huge)["code"] == "invalid_request"
    assert time.monotonic() - started < 0.5  # the failure was kept: not built again


def test_a_grammar_past_its_deadline_is_refused_and_then_served_once_built(tiny_model, serve):
    serve(tiny_model("qwen2-vl"), VLM_MAX_SCHEMA_BYTES="1000000", VLM_SCHEMA_TIMEOUT_S="0.02")
    names = [f"k{i}" for i in range(3000)]
    slow = {  # valid and bounded, but a few hundred ms to build
        "type": "object",
        "properties": {name: {"type": "integer", "minimum": 0, "maximum": 9} for name in names},
        "required": names,
        "additionalProperties": False,
    }
    refused = ask(constrained(slow, max_new_tokens=20))
    assert refused["code"] == "schema_too_complex" and refused["param"] == "response_format", refused
    deadline = time.monotonic() + 60
    while "code" in (out := ask(constrained(slow, max_new_tokens=20))):
        assert out["code"] == "schema_too_complex" and time.monotonic() < deadline, out
        time.sleep(0.2)
    assert out["finish_reason"] == "length"  # cut by its 20 tokens: not `stop`, which would promise whole JSON


@pytest.mark.parametrize("size", [600, 2000])
def test_a_schema_past_the_parsers_limits_is_refused_up_front(engine, size):
    refused = ask(constrained(optional_integers(size)))
    assert refused["code"] == "invalid_request" and refused["param"] == "response_format", refused


def test_an_answer_whose_grammar_fails_midway_ends_with_an_error_never_stop(engine, monkeypatch):
    """The parser's failure met while decoding (the check up front switched off to meet it): a coded error, not
    `stop` with the `{` the mask left."""
    from runpod_vlm.engine import grammar

    monkeypatch.setattr(grammar, "forced_start_error", lambda template: None)
    for stream in (False, True):
        out = ask(constrained(optional_integers(700 + stream), stream=stream))  # not cached yet
        final = out[-1] if isinstance(out, list) else out
        assert final.get("code") == "structured_output_failed" and final["param"] == "response_format", final
        assert "max is 2000" in json.loads(final["error"])["error_message"]


@pytest.mark.parametrize(
    "schema, code, words",
    [
        ({"type": "string", "enum": [f"v{i}" for i in range(1001)]}, "schema_too_complex", "1001 enum values"),
        ({"type": "object", "properties": {f"p{i}": {} for i in range(5001)}}, "schema_too_complex", "5001 prop"),
        ({"type": "string", "description": "x" * 70_000}, "schema_too_complex", "over 65536 bytes"),
    ],
    ids=["enum", "properties", "bytes"],
)
def test_schemas_past_the_documented_limits_are_refused_before_the_engine(schema, code, words, monkeypatch):
    monkeypatch.setattr(handler, "get_engine", lambda *a: pytest.fail("a refused schema reached the engine"))
    refused = ask(constrained(schema))
    assert refused["code"] == code and refused["param"] == "response_format.json_schema.schema", refused
    assert words in json.loads(refused["error"])["error_message"]


def test_the_answer_keeps_the_schemas_key_order(engine):
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string", "maxLength": 6}, "answer": {"type": "integer", "maximum": 9}},
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }
    out = ask(constrained(schema))
    assert list(json.loads(out["response"])) == ["reasoning", "answer"], out


def test_a_schema_whose_answer_cannot_fit_max_new_tokens_is_refused_naming_it(engine):
    schema = {
        "type": "object",
        "properties": {"a_rather_long_property_name_every_answer_must_write": {"type": "integer"}},
        "required": ["a_rather_long_property_name_every_answer_must_write"],
        "additionalProperties": False,
    }
    refused = ask(constrained(schema, max_new_tokens=5))
    assert refused["code"] == "invalid_request" and refused["param"] == "max_new_tokens", refused
    assert ask(constrained(schema, max_new_tokens=200)).get("finish_reason") in ("stop", "length")
