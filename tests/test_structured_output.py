"""Structured output: a tiny random-weight model constrained token by token to a JSON schema (llguidance)
always answers JSON that validates; rows without a schema in the same batch keep their own tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

import handler
from runpod_vlm.openai_route import openai_answers
from sample_images import data_uri, striped

# Bounded schemas (no free whitespace, capped strings and arrays): a random model must close them in time.
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "item": {
                "type": "object",
                "properties": {
                    "colour": {"enum": ["red", "green", "blue"]},
                    "count": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["colour", "count"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "price": {"type": "integer", "minimum": 0, "maximum": 10},  # a number's decimals have no bound
        },
        "required": ["item", "tags", "price"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
}


def validate(text: str, schema: dict) -> None:
    import jsonschema  # here, not at the top: bench/structured.py imports SCHEMAS where it is not installed

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
