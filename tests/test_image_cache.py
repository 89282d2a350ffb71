"""The vision-embedding cache on real tiny models (CPU): an image sent again skips the vision encoder and
gives exactly the tokens of a cold run; the same image in one batch is encoded once."""

from __future__ import annotations

import pytest

import handler
from runpod_vlm.answers import generate_all
from sample_images import data_uri, striped

PHOTO, OTHER = data_uri(striped((64, 48))), data_uri(striped((40, 72)))


def items(engine, jobs):
    return [handler.read_job_item(job, engine.settings, engine.model_id)[1] for job in jobs]


def encoder_calls(engine, monkeypatch) -> list:
    """The number of images each vision-encoder call of the model takes."""
    language = type(engine.model.model)
    whole, calls = language.get_image_features, []

    def counted(self, pixel_values, image_grid_thw=None, **kwargs):
        calls.append(len(image_grid_thw))
        return whole(self, pixel_values, image_grid_thw, **kwargs)

    monkeypatch.setattr(language, "get_image_features", counted)
    return calls


def chat(turns: int) -> dict:
    """A chat that resends its image every turn, as clients do."""
    messages = []
    for turn in range(turns):
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": PHOTO}},
                    {"type": "text", "text": f"Turn {turn}?"},
                ],
            }
        )
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"Answer {turn}."})
    return {"messages": messages, "max_new_tokens": 8, "min_new_tokens": 8}


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_a_chat_resending_its_image_skips_the_encoder_with_the_tokens_of_a_cold_run(
    family, tiny_model, serve, monkeypatch
):
    cold = serve(tiny_model(family), VLM_IMAGE_CACHE_MB="0")
    expected = [generate_all(cold, items(cold, [chat(n)]))[0] for n in (1, 2, 3)]
    engine = serve(tiny_model(family), VLM_IMAGE_CACHE_MB="64")
    calls = encoder_calls(engine, monkeypatch)
    answers = [generate_all(engine, items(engine, [chat(n)]))[0] for n in (1, 2, 3)]
    assert answers == expected
    assert calls == [1]  # turn 1 encodes the image; turns 2 and 3 (two and three copies of it) take it cached
    assert (engine.image_cache.misses, engine.image_cache.hits) == (1, 2)


def test_one_image_in_a_batch_twice_is_encoded_once_and_a_smaller_bound_is_another_image(
    tiny_model, serve, monkeypatch
):
    engine = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="64")
    jobs = [{"task": "caption", "image_url": url, "max_new_tokens": 6} for url in (PHOTO, OTHER, PHOTO, PHOTO)]
    solo = [engine._generate_with_generate(item) for item in items(engine, jobs)]
    calls = encoder_calls(engine, monkeypatch)
    assert generate_all(engine, items(engine, jobs)) == solo
    assert sum(calls) == 2 and len(engine.image_cache) == 2
    low = {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PHOTO, "detail": "low"}}]}]
    }
    generate_all(engine, items(engine, [low]))
    assert sum(calls) == 3 and len(engine.image_cache) == 3
