"""Every native family answers as its model card does: the worker's prompt ids and greedy tokens
equal the card's recipe (processor.apply_chat_template with the images inside the messages, then
model.generate with do_sample=False), for a request sent alone and for two different requests
batched. Tiny random-weight models built offline (tools/tiny_models.py), CPU."""

from __future__ import annotations

import functools

import pytest
import torch

import handler
from sample_images import data_uri, plain, striped

# Families whose processor has a chat template (PaliGemma, prompted by task prefixes, is below).
CHAT_FAMILIES = ["qwen3-vl", "gemma3", "llava-onevision"]
NEW_TOKENS = 5


def ask(payload: dict) -> dict:
    return handler.handler({"id": "job-1", "input": payload})


@pytest.fixture(scope="module", params=CHAT_FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def engine(family, tiny_model, serve):
    return serve(tiny_model(family))


@pytest.fixture
def forward_calls(engine, monkeypatch):
    """Every forward pass of the worker's model: input ids, attention mask and the greedy choice."""
    calls = []
    real_forward = engine.model.forward

    def recording_forward(*args, **kwargs):
        output = real_forward(*args, **kwargs)
        calls.append({"input_ids": kwargs.get("input_ids"), "attention_mask": kwargs.get("attention_mask"),
                      "choice": output.logits[:, -1].argmax(-1)})
        return output

    monkeypatch.setattr(engine.model, "forward", recording_forward)
    return calls


def worker_rows(calls: list[dict], rows: int) -> list[tuple[list[int], list[int]]]:
    """Per batch row: the prompt ids (padding removed) and the greedy tokens."""
    first = calls[0]
    result = []
    for row in range(rows):
        ids, mask = first["input_ids"][row], first["attention_mask"][row]
        prompt = ids[mask[-len(ids):].bool()].tolist()
        result.append((prompt, [int(call["choice"][row]) for call in calls][:NEW_TOKENS]))
    return result


@functools.lru_cache(maxsize=None)
def reference_model(folder: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(folder)


def card_recipe(folder, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The model card: one apply_chat_template call with the images in the messages, then greedy."""
    model, processor = reference_model(str(folder))
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    prompt = inputs["input_ids"][0]
    return prompt.tolist(), output[0, len(prompt):].tolist()


def text(value: str) -> dict:
    return {"type": "text", "text": value}


FIRST, SECOND, THIRD = striped((100, 50)), plain("green", (40, 60)), striped((64, 64))
# Two different requests: a system prompt and two images in one turn; a single-image question.
TWO_IMAGES = (
    {"messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "image_url", "image_url": data_uri(FIRST)},
                                     text("Which is green?"),
                                     {"type": "image_url", "image_url": data_uri(SECOND)}]},
    ], "max_new_tokens": NEW_TOKENS},
    [
        {"role": "system", "content": [text("Answer in one word.")]},
        {"role": "user", "content": [{"type": "image", "image": FIRST}, text("Which is green?"),
                                     {"type": "image", "image": SECOND}]},
    ],
)
ONE_IMAGE = (
    {"task": "vqa", "image_url": data_uri(THIRD), "question": "What is shown?", "max_new_tokens": NEW_TOKENS},
    [{"role": "user", "content": [{"type": "image", "image": THIRD}, text("What is shown?")]}],
)


def test_a_request_alone_matches_the_card(engine, tiny_model, family, forward_calls):
    request, messages = TWO_IMAGES
    out = ask(request)
    assert "error" not in out, out
    assert out["image_count"] == 2
    ((prompt, generated),) = worker_rows(forward_calls, 1)
    reference_prompt, reference_generated = card_recipe(tiny_model(family), messages)
    assert prompt == reference_prompt
    assert prompt.count(engine.tokenizer.bos_token_id) <= 1
    assert generated == reference_generated
    assert out["usage"]["prompt_tokens"] == len(reference_prompt)


def test_two_different_requests_batched_match_the_card(engine, tiny_model, family, forward_calls):
    out = ask({"requests": [TWO_IMAGES[0], ONE_IMAGE[0]]})
    assert all("error" not in result for result in out["results"]), out
    rows = worker_rows(forward_calls, 2)
    for (prompt, generated), (_, messages) in zip(rows, [TWO_IMAGES, ONE_IMAGE]):
        assert (prompt, generated) == card_recipe(tiny_model(family), messages)
