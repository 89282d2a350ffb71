"""Logprobs: each answer token's log-probability and its most likely alternatives, equal to log_softmax
of the model's own logits (a plain generate() on CPU, fp32), on the batched path and the one-at-a-time
path, in the native and OpenAI shapes (validated by the openai package's types)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import handler
from runpod_vlm.openai_route import openai_answers

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


def ask(payload: dict) -> dict:
    return asyncio.run(handler.local_test_answer({"id": "logprobs", "input": payload}))


def reference(engine, new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """A plain greedy generate() of PROMPT: its new ids and each step's log_softmax of the raw logits."""
    item = handler.read_job_item({"messages": PROMPT}, engine.settings, engine.model_id)[1]
    inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], engine.model.device, engine.dtype)
    with torch.inference_mode():
        out = engine.model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return ids, [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]


def assert_entries_match(engine, entries: list[dict], ids: list[int], logprobs: list[torch.Tensor], top: int):
    decode = engine.tokenizer.decode
    assert len(entries) == len(ids)
    for entry, token, step in zip(entries, ids, logprobs):
        assert entry["token"] == decode([token]) and entry["bytes"] == list(entry["token"].encode())
        assert math.isclose(entry["logprob"], step[token].item(), abs_tol=1e-4)
        values, best = step.topk(top)
        assert [t["token"] for t in entry["top_logprobs"]] == [decode([i]) for i in best.tolist()]
        assert all(math.isclose(t["logprob"], v, abs_tol=1e-4) for t, v in zip(entry["top_logprobs"], values.tolist()))


@pytest.mark.parametrize("continuous", [True, False], ids=["batched", "one at a time"])
def test_native_logprobs_equal_the_models_log_softmax(continuous, tiny_model, serve):
    engine = serve(tiny_model("gemma3"))
    engine.continuous = continuous  # one at a time: generate()'s own path, as for Phi-4-multimodal
    ids, logprobs = reference(engine, 6)
    out = ask({"messages": PROMPT, "max_new_tokens": 6, "min_new_tokens": 6, "logprobs": True, "top_logprobs": 4})
    assert_entries_match(engine, out["logprobs"], ids, logprobs, 4)
    assert "logprobs" not in ask({"messages": PROMPT, "max_new_tokens": 2})


def test_batched_rows_get_their_own_logprobs_beside_rows_without(tiny_model, serve):
    engine = serve(tiny_model("qwen2-vl"))
    ids, logprobs = reference(engine, 5)
    wanted = {"messages": PROMPT, "max_new_tokens": 5, "min_new_tokens": 5, "logprobs": True, "top_logprobs": 2}
    plain = {"messages": [{"role": "user", "content": "Other."}], "max_new_tokens": 9}
    results = ask({"requests": [plain, wanted, {**plain, "do_sample": True, "temperature": 1.0}]})["results"]
    assert "logprobs" not in results[0] and "logprobs" not in results[2]
    assert_entries_match(engine, results[1]["logprobs"], ids, logprobs, 2)


def test_sampled_rows_report_the_distribution_before_temperature(tiny_model, serve):
    serve(tiny_model("qwen2-vl"))
    out = ask({"messages": PROMPT, "max_new_tokens": 8, "do_sample": True, "temperature": 1.7, "seed": 3,
               "logprobs": True, "top_logprobs": 5})  # fmt: skip
    for entry in out["logprobs"]:
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1 + 1e-5
        assert entry["logprob"] <= values[0] + 1e-6


def test_top_logprobs_needs_logprobs_and_stays_within_20(tiny_model, serve):
    serve(tiny_model("qwen2-vl"))
    assert ask({"messages": PROMPT, "top_logprobs": 3})["param"] == "top_logprobs"
    assert ask({"messages": PROMPT, "logprobs": True, "top_logprobs": 21})["param"] == "top_logprobs"


def openai(body: dict) -> list:
    job = {"openai_route": "/v1/chat/completions", "openai_input": body}

    async def collect():
        return [answer async for answer in openai_answers(handler.get_engine, handler.served_model, job)]

    return asyncio.run(collect())


def test_openai_logprobs_streamed_and_not(tiny_model, serve):
    engine = serve(tiny_model("qwen2-vl"))
    ids, logprobs = reference(engine, 6)
    body = {"messages": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    [whole] = openai(body)
    completion = ChatCompletion.model_validate(whole)
    assert_entries_match(engine, whole["choices"][0]["logprobs"]["content"], ids, logprobs, 3)
    assert len(completion.choices[0].logprobs.content) == completion.usage.completion_tokens == 6
    events = [line[6:] for answer in openai({**body, "stream": True}) for line in answer.split("\n\n") if line]
    chunks = [ChatCompletionChunk.model_validate_json(event) for event in events if event != "[DONE]"]
    assert chunks[-1].choices[0].logprobs.content == completion.choices[0].logprobs.content
    [refused] = openai({**body, "stop": ["x"]})
    assert refused["error"]["param"] == "stop"
