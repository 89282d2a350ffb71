"""The vision-embedding cache on real tiny models (CPU): an image sent again skips the vision encoder, and its
pixels' processing, and gives exactly the tokens of a cold run; the same image in one batch is encoded once."""

from __future__ import annotations

import pytest
import torch

import handler
from runpod_vlm.answers import generate_all
from tools.sample_images import data_uri, striped

PHOTO, OTHER, THIRD = data_uri(striped((64, 48))), data_uri(striped((40, 72))), data_uri(striped((56, 56)))


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


def image_processor_calls(engine, monkeypatch) -> list:
    """The number of images each call of the processor's (real) image processor takes."""
    kind, calls = type(engine.processor.image_processor), []
    whole = kind.__call__

    def counted(self, images, *args, **kwargs):
        calls.append(sum(len(part) if isinstance(part, list) else 1 for part in images))  # one list per item
        return whole(self, images, *args, **kwargs)

    monkeypatch.setattr(kind, "__call__", counted)
    return calls


def chat(turns: int, images=(PHOTO,)) -> dict:
    """A chat that resends its images every turn, as clients do."""
    messages = []
    for turn in range(turns):
        messages.append(
            {
                "role": "user",
                "content": [
                    *({"type": "image_url", "image_url": {"url": url}} for url in images),
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
    calls, processed = encoder_calls(engine, monkeypatch), image_processor_calls(engine, monkeypatch)
    answers = [generate_all(engine, items(engine, [chat(n)]))[0] for n in (1, 2, 3)]
    assert answers == expected
    assert calls == [1]  # turn 1 encodes the image; turns 2 and 3 (two and three copies of it) take it cached
    assert processed == [1]  # and are prepared without processing its pixels
    assert (engine.image_cache.misses, engine.image_cache.hits) == (1, 2)


def test_images_recalled_are_prepared_with_one_row_of_zero_pixels_repeated(tiny_model, serve):
    """Their pixels are never read: one row stands for them all, so nothing is copied whole on the way to the GPU."""
    engine = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="64")
    generate_all(engine, items(engine, [chat(1)]))
    inputs, _, held = engine.intake().prepare(items(engine, [chat(2)])[0])
    pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"]
    assert held and pixels.stride(0) == 0 and not pixels.any()
    assert pixels.shape[0] == int(grids.prod(-1).sum()) and len(grids) == 2  # the image twice, as processed


def test_a_chat_resending_two_images_of_other_sizes_gets_the_tokens_of_a_cold_run(tiny_model, serve, monkeypatch):
    cold = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="0")
    expected = [generate_all(cold, items(cold, [chat(n, (PHOTO, OTHER))]))[0] for n in (1, 2)]
    engine = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="64")
    processed = image_processor_calls(engine, monkeypatch)
    assert [generate_all(engine, items(engine, [chat(n, (PHOTO, OTHER))]))[0] for n in (1, 2)] == expected
    assert processed == [2]  # the first turn's two; the second turn's four, each with its own grid, came from the cache


def test_an_entry_the_cache_let_go_after_its_item_was_prepared_still_answers(tiny_model, serve, monkeypatch):
    cold = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="0")
    expected = generate_all(cold, items(cold, [chat(2)]))[0]
    engine = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="64")
    generate_all(engine, items(engine, [chat(1)]))
    calls = encoder_calls(engine, monkeypatch)
    monkeypatch.setattr(engine.image_cache, "get", lambda key: None)  # gone between the intake's look and the forward
    assert generate_all(engine, items(engine, [chat(2)]))[0] == expected
    assert calls == []  # the entry its item took when prepared: no pixels were there to encode


def test_items_prepared_without_their_pixels_batch_with_items_that_have_them(tiny_model, serve, monkeypatch):
    engine = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="64")
    generate_all(engine, items(engine, [{"task": "caption", "image_url": PHOTO, "max_new_tokens": 6}]))
    jobs = [
        {"task": "caption", "image_url": PHOTO, "max_new_tokens": 6},
        {"task": "vqa", "image_url": THIRD, "question": "What is it?", "max_new_tokens": 6},
        {"messages": chat(2)["messages"], "max_new_tokens": 6},
    ]
    solo = [engine.alone.generate(item) for item in items(engine, jobs)]
    calls, processed = encoder_calls(engine, monkeypatch), image_processor_calls(engine, monkeypatch)
    prefills = engine.timings["prefills"]
    assert generate_all(engine, items(engine, jobs)) == solo
    assert engine.timings["prefills"] == prefills + 1  # together: zero pixels beside THIRD's real ones
    assert calls == [1] and processed == [1]  # THIRD alone is processed and encoded


def test_one_image_in_a_batch_twice_is_encoded_once_and_a_smaller_bound_is_another_image(
    tiny_model, serve, monkeypatch
):
    engine = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="64")
    jobs = [{"task": "caption", "image_url": url, "max_new_tokens": 6} for url in (PHOTO, OTHER, PHOTO, PHOTO)]
    solo = [engine.alone.generate(item) for item in items(engine, jobs)]
    calls = encoder_calls(engine, monkeypatch)
    assert generate_all(engine, items(engine, jobs)) == solo
    assert sum(calls) == 2 and len(engine.image_cache) == 2
    low = {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PHOTO, "detail": "low"}}]}]
    }
    generate_all(engine, items(engine, [low]))
    assert sum(calls) == 3 and len(engine.image_cache) == 3


def test_a_prompt_out_of_memory_at_once_reads_its_cached_images_before_encoding_one_at_a_time(
    tiny_model, serve, monkeypatch
):
    cold = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="0")
    expected = generate_all(cold, items(cold, [chat(2, (PHOTO, OTHER))]))[0]
    engine = serve(tiny_model("qwen2-vl"), VLM_IMAGE_CACHE_MB="64")
    generate_all(engine, items(engine, [chat(1, (PHOTO, OTHER))]))
    decoder, failed = engine.start_decoder(), []
    whole = decoder.prompts.begin_chunks

    def out_of_memory_once(*args, **kwargs):  # the next turn reads its prefix's blocks: it begins in chunks
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return whole(*args, **kwargs)

    monkeypatch.setattr(decoder.prompts, "begin_chunks", out_of_memory_once)
    calls = encoder_calls(engine, monkeypatch)
    assert generate_all(engine, items(engine, [chat(2, (PHOTO, OTHER))]))[0] == expected
    assert failed and calls == []  # its images prepared without pixels: none encoded, one at a time or not
