"""`n` choices (tiny Qwen2-VL, CPU): each choice is its own seed stream and reproducible alone; the prompt is read
and prefilled once, the other choices reading its blocks from the prefix cache; usage counts the prompt once."""

from __future__ import annotations

import asyncio
import json

import pytest

import handler
from tools.sample_images import data_uri, striped

PROMPT = "Describe the picture, then tell a long story about it, with many details. " * 4


@pytest.fixture
def engine(tiny_model, serve):
    return serve(tiny_model("qwen2-vl"))


def ask(payload: dict) -> dict:
    return asyncio.run(handler.local_test_answer({"id": "choices", "input": payload}))


def sampled(**extra) -> dict:
    image = {"type": "image_url", "image_url": {"url": data_uri(striped((64, 48)))}}
    content = [image, {"type": "text", "text": PROMPT}]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_new_tokens": 8,
        "min_new_tokens": 8,
        "do_sample": True,
        "temperature": 1.5,
        **extra,
    }


def test_n_choices_are_each_their_own_seed_stream_and_the_prompt_is_prefilled_once(engine):
    before = engine.view().timings
    out = ask(sampled(n=3, seed=41))
    after = engine.view().timings
    texts = [choice["response"] for choice in out["choices"]]
    assert [choice["index"] for choice in out["choices"]] == [0, 1, 2] and len(set(texts)) == 3, texts
    assert out["response"] == texts[0]
    alone = [ask(sampled(seed=41 + k)) for k in range(3)]
    assert texts == [answer["response"] for answer in alone]  # choice k draws as a request seeded s + k
    prompt = alone[0]["usage"]["prompt_tokens"]
    assert out["usage"] == {"prompt_tokens": prompt, "completion_tokens": 24}
    # The second and third choices read every full block of the prompt but the last token's from the cache.
    cached = after.get("prefix_cached_tokens", 0) - before.get("prefix_cached_tokens", 0)
    assert cached >= 2 * ((prompt - 1) // 16) * 16, (cached, prompt)
    assert engine.view().kv_blocks_used == 0


def test_the_openai_route_gives_n_choices_streamed_and_not(engine):
    body = {
        "messages": sampled()["messages"],
        "n": 3,
        "seed": 7,
        "max_tokens": 6,
        "temperature": 1.5,
        "stream_options": {"include_usage": True},
    }

    def route(body: dict):
        job = {"id": "n", "input": {"openai_route": "/v1/chat/completions", "openai_input": body}}

        async def collect():
            return [answer async for answer in handler.handler(job)]

        return asyncio.run(collect())

    [whole] = route({k: v for k, v in body.items() if k != "stream_options"})
    contents = [choice["message"]["content"] for choice in whole["choices"]]
    assert [choice["index"] for choice in whole["choices"]] == [0, 1, 2] and len(set(contents)) == 3
    assert whole["usage"]["completion_tokens"] == 18
    events = [
        json.loads(line[6:])
        for text in route(dict(body, stream=True))
        for line in text.split("\n")
        if line.startswith("data: {")
    ]
    streamed = ["", "", ""]
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == contents
    assert events[-1]["usage"] == whole["usage"]
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"n": 9}, "n"),
        ({"n": 2, "stream": True}, "n"),
        ({"n": 0}, "n"),
    ],
    ids=["over VLM_MAX_CHOICES", "native stream", "zero"],
)
def test_n_out_of_bounds_is_refused_naming_it(engine, payload, param):
    refused = ask(sampled(**payload))
    assert refused["code"] == "invalid_request" and refused["param"] == param, refused


def test_a_batch_items_n_is_refused_and_its_neighbours_answered(engine):
    out = ask({"requests": [sampled(n=2), sampled(seed=3)]})
    assert out["results"][0]["param"] == "requests[0].n" and "response" in out["results"][1]
