"""Prefix caching on real tiny models (CPU, fp32): a prompt admitted alone that starts as an earlier one did
reads that prompt's full KV blocks, and every answer is exactly its cold run's (prefix caching off)."""

from __future__ import annotations

import threading

import pytest

import handler
from runpod_vlm.answers import generate_all
from tools.sample_images import data_uri, striped

SYSTEM = "You answer briefly. " + " ".join(f"rule{n}" for n in range(30))  # several blocks before any image
PHOTO, OTHER = data_uri(striped((64, 48))), data_uri(striped((40, 72)))


def items(engine, jobs):
    return [handler.read_job_item(job, engine.settings, engine.model_id)[1] for job in jobs]


def job(image: str, question: str, history: tuple = (), new_tokens: int = 8) -> dict:
    """System prompt, earlier turns (each resending the image, as clients do), then the question."""

    def asking(text):
        return {"role": "user", "content": [{"type": "image_url", "image_url": image}, {"type": "text", "text": text}]}

    messages = [{"role": "system", "content": SYSTEM}]
    for asked, answered in history:
        messages += [asking(asked), {"role": "assistant", "content": answered}]
    messages.append(asking(question))
    return {"messages": messages, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}


def one_by_one(engine, jobs) -> list:
    """Each job admitted alone, after the one before it ended."""
    return [generate_all(engine, items(engine, [j]))[0] for j in jobs]


def cached_tokens(engine) -> int:
    return engine.timings["prefix_cached_tokens"]


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "llava", "llava-next"])
def test_a_chats_next_turn_reads_its_earlier_blocks_and_gets_the_tokens_of_a_cold_run(family, tiny_model, serve):
    turn_1 = job(PHOTO, "What is it?")
    cold = serve(tiny_model(family), VLM_PREFIX_CACHING="false")
    first = one_by_one(cold, [turn_1])[0]
    turns = [turn_1, job(PHOTO, "And its colour?", history=(("What is it?", first.text),))]
    expected = one_by_one(cold, turns)
    assert cached_tokens(cold) == 0
    engine = serve(tiny_model(family), VLM_PREFIX_CACHING="true")
    assert one_by_one(engine, turns) == expected
    prompt_1 = expected[0].prompt_tokens
    block = engine.start_decoder().block_size
    assert cached_tokens(engine) >= (prompt_1 // block - 1) * block  # turn 1's blocks, image included
    pool = engine.start_decoder().pool
    assert pool.free == pool.capacity and pool.cached > 0  # nothing held; turns' blocks kept, as free


@pytest.mark.parametrize("family", ["qwen2-vl", "llava"])
def test_the_same_words_about_another_image_read_only_the_blocks_before_the_image(family, tiny_model, serve):
    jobs = [job(PHOTO, "What is it?"), job(OTHER, "What is it?")]
    cold = serve(tiny_model(family), VLM_PREFIX_CACHING="false")
    expected = one_by_one(cold, jobs)
    assert expected[0].text != expected[1].text  # else this could not tell the images' blocks apart
    engine = serve(tiny_model(family), VLM_PREFIX_CACHING="true")
    assert one_by_one(engine, jobs) == expected
    ids = engine.adapter.batch_inputs(engine.processor, items(engine, jobs[:1]), "cpu", engine.dtype)[0]["input_ids"]
    first_image = next(n for n, i in enumerate(ids[0].tolist()) if i in engine.media_token_ids)
    block = engine.start_decoder().block_size
    assert cached_tokens(engine) == first_image // block * block > 0  # the system prompt's whole blocks alone


def test_jobs_sharing_a_system_prompt_while_one_decodes_share_its_blocks_with_their_solo_tokens(tiny_model, serve):
    questions = ["What is it?", "Where is it?", "Why?"]
    jobs = [job(PHOTO, q, new_tokens=n) for q, n in zip(questions, (60, 20, 20))]
    cold = serve(tiny_model("qwen2-vl"), VLM_PREFIX_CACHING="false")
    expected = one_by_one(cold, jobs)
    engine = serve(tiny_model("qwen2-vl"), VLM_PREFIX_CACHING="true", VLM_SYNC_INTERVAL="2")
    answers, admitted = {}, threading.Event()
    give_row = engine.scheduler.give_row

    def given_then_next(ticket, *args):
        give_row(ticket, *args)
        admitted.set()

    engine.scheduler.give_row = given_then_next
    done = threading.Semaphore(0)
    for n, item in enumerate(items(engine, jobs)):  # each submitted once the one before it has a row
        admitted.clear()
        engine.submit(item, lambda result, n=n: (answers.__setitem__(n, result), done.release()))
        assert admitted.wait(60)
    for _ in jobs:
        assert done.acquire(timeout=60)
    assert [answers[n] for n in range(3)] == expected
    assert cached_tokens(engine) > 0
    pool = engine.start_decoder().pool
    assert pool.free == pool.capacity


def shared_tokens(engine, jobs: list[dict], images: list[str]) -> int:
    """The tokens a burst of `jobs` may read instead of computing: each prompt's whole blocks (not the one of its
    last token) in common with an earlier one, up to the first image where their images differ."""
    ids = [engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)[0]["input_ids"][0].tolist()
           for item in items(engine, jobs)]  # fmt: skip
    block, total = engine.start_decoder().block_size, 0
    for n, prompt in enumerate(ids):
        best = 0
        for m in range(n):
            common = next((k for k, (a, b) in enumerate(zip(prompt, ids[m])) if a != b), min(len(prompt), len(ids[m])))
            if images[m] != images[n]:
                common = min(common, next(k for k, i in enumerate(prompt) if i in engine.media_token_ids))
            best = max(best, common)
        total += min(best, len(prompt) - 1) // block * block
    return total


@pytest.mark.parametrize("family", ["qwen2-vl", "llava"])
def test_a_burst_sharing_a_system_prompt_and_an_image_computes_their_blocks_once_with_each_cold_runs_tokens(
    family, tiny_model, serve, monkeypatch
):
    images = [PHOTO, PHOTO, OTHER, PHOTO]
    jobs = [
        job(image, q, new_tokens=n) for image, q, n in zip(images, ("What?", "Where?", "What?", "Why?"), (12, 8, 8, 20))
    ]
    cold = serve(tiny_model(family), VLM_PREFIX_CACHING="false")
    expected = one_by_one(cold, jobs)
    engine = serve(tiny_model(family), VLM_PREFIX_CACHING="true")
    decoder, computed = engine.start_decoder(), []
    through = decoder.prompts.through_language_model
    monkeypatch.setattr(
        decoder.prompts,
        "through_language_model",
        lambda step, embeds, *a: computed.append(embeds.shape[1]) or through(step, embeds, *a),
    )
    assert generate_all(engine, items(engine, jobs)) == expected
    shared = shared_tokens(engine, jobs, images)
    assert len(computed) == 1 and shared > 3 * engine.start_decoder().block_size  # one prefill of the four
    assert cached_tokens(engine) == shared and computed[0] == sum(a.prompt_tokens for a in expected) - shared
    pool = engine.start_decoder().pool
    assert pool.free == pool.capacity


def test_a_burst_counts_its_prompts_without_the_blocks_they_share_and_fits_one_prefill(tiny_model, serve, monkeypatch):
    jobs = [job(PHOTO, question) for question in ("What?", "Where?", "Why?", "How?")]
    cold = serve(tiny_model("qwen2-vl"), VLM_PREFIX_CACHING="false")
    expected = one_by_one(cold, jobs)
    budget = 2 * expected[0].prompt_tokens  # two whole prompts: four fit only counted without their shared blocks
    engine = serve(tiny_model("qwen2-vl"), VLM_PREFIX_CACHING="true", VLM_MAX_BATCH_TOKENS=str(budget))
    one_by_one(engine, [{"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 2}])  # packs, now known
    decoder, prefills = engine.start_decoder(), []
    through = decoder.prompts.through_language_model
    monkeypatch.setattr(
        decoder.prompts, "through_language_model", lambda step, *a: prefills.append(step) or through(step, *a)
    )
    assert generate_all(engine, items(engine, jobs)) == expected
    assert len(prefills) == 1
