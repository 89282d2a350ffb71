"""The paged KV cache on real tiny models (CPU, fp32): blocks follow the tokens, long prompts enter in
chunks, a full pool preempts and resumes, and every answer is exactly its solo `generate()` run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import shutil
import threading
import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import handler
from runpod_vlm.answers import generate_all
from runpod_vlm.engine import prefill_graphs, varlen
from runpod_vlm.engine import scheduler as scheduler_module
from runpod_vlm.engine.ticket import generation
from runpod_vlm.vocabulary import StreamDelta
from test_vision_compile import block_diagonal_varlen, wait_for
from tools.sample_images import data_uri, striped
from tools.tiny_models import FAMILIES

LONG_TEXT = " ".join(f"word{n}" for n in range(40))  # about 300 tokens: more than one chunk at a 256 budget


def items_of(engine, jobs: list[dict]) -> list:
    return [handler.read_job_item(job, engine.settings, engine.model_id, None)[1] for job in jobs]


def solo_generate(engine, items) -> list:
    """Each item alone through plain transformers `generate()` (the engine's one-at-a-time path)."""
    return [engine.alone.generate(item) for item in items]


def spy(monkeypatch, owner, name: str, events: list, label: str):
    real = getattr(owner, name)

    def recorded(*args, **kwargs):
        events.append(label)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)


def mixed_jobs(count: int) -> list[dict]:
    jobs = []
    for n in range(count):
        question = f"What is {n}?" + (f" {LONG_TEXT}" if n % 3 == 0 else "")
        jobs.append(
            {
                "task": "vqa",
                "image_url": data_uri(striped((48 + 8 * n, 40))),
                "question": question,
                "max_new_tokens": (6, 150, 90, 40)[n % 4],
                "min_new_tokens": (6, 150, 90, 40)[n % 4],
            }
        )
    return jobs


# Not Phi-4-multimodal: its tiny model generates its image token in these answers, and generate() (the reference)
# then fails in its image embedding, which finds no image.
PREEMPTED = [f for f in FAMILIES if f != "phi4-multimodal"]


@pytest.mark.parametrize("family", PREEMPTED)
def test_jobs_beyond_the_pool_preempt_and_resume_with_their_solo_tokens(family, tiny_model, serve, monkeypatch):
    """Eight jobs of very different prompt and answer lengths, sent at once, through a pool that holds
    about two of them: rows are preempted when blocks run out and resumed later, runs cross many block
    boundaries, and every answer equals its solo generate(); no block is left held at the end. (PaliGemma's
    resumed rows once answered otherwise: their generated tokens re-entered as its prefix, seen both ways;
    LLaVA-NeXT's and InternVL's failed: a generated image placeholder was taken for the image's.)"""
    engine = serve(tiny_model(family), VLM_KV_CACHE_TOKENS="512", VLM_SYNC_INTERVAL="3", VLM_MAX_BATCH_TOKENS="1024")
    items = items_of(engine, mixed_jobs(8))
    solo = solo_generate(engine, items)
    events: list = []
    spy(monkeypatch, engine.scheduler, "preempt", events, "preempt")
    assert generate_all(engine, items) == solo
    assert "preempt" in events  # the pool was too small for all of them at once
    pool = engine.start_decoder().pool
    assert pool.free == pool.capacity and not engine.view().running


@pytest.mark.parametrize("family", ["qwen2-vl", "llava"])
def test_a_resumed_row_can_enter_in_chunks_its_tokens_following_as_text(family, tiny_model, serve, monkeypatch):
    # The path of a row that had generated an image placeholder, taken here by every resumed row.
    engine = serve(tiny_model(family), VLM_KV_CACHE_TOKENS="512", VLM_SYNC_INTERVAL="3", VLM_MAX_BATCH_TOKENS="1024")
    items = items_of(engine, mixed_jobs(8))
    solo = solo_generate(engine, items)
    events: list = []
    monkeypatch.setattr(engine.scheduler, "resumes_in_chunks", lambda ticket: bool(ticket.ids))
    spy(monkeypatch, engine.start_decoder().prompts, "follow_with", events, "follow")
    assert generate_all(engine, items) == solo
    assert "follow" in events


def short_jobs(count: int) -> list[dict]:
    return [dict(job, max_new_tokens=n, min_new_tokens=n) for job, n in zip(mixed_jobs(count), [8, 20, 12, 16] * count)]


@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_requests_past_a_sliding_window_or_an_attention_chunk_decode_in_the_batch_with_their_solo_tokens(
    family, tiny_model, serve, monkeypatch
):
    """Gemma 3's sliding-window layers and Llama 4's chunked ones (64 tokens in the tiny models) read only their
    window or chunk of each row's blocks: prompts before, across and past it, with images (Gemma 3's attend both
    ways at prefill), decode side by side, none alone; every answer its solo generate()'s, each token's logprob
    too (the tiny models' greedy tokens hardly depend on the far keys; their logprobs do); the pool is full again."""
    engine = serve(tiny_model(family), VLM_SYNC_INTERVAL="2")
    assert engine.continuous
    jobs = [
        {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 70, "min_new_tokens": 70},
        {"messages": [{"role": "user", "content": "word " * 40}], "max_new_tokens": 30, "min_new_tokens": 30},
        {"messages": [{"role": "user", "content": "word " * 90}], "max_new_tokens": 12, "min_new_tokens": 12},
        {"task": "vqa", "image_url": data_uri(striped((48, 40))), "question": "What is it?", "max_new_tokens": 40},
        {"task": "vqa", "image_url": data_uri(striped((40, 56))), "question": LONG_TEXT, "max_new_tokens": 9},
    ]
    items = items_of(engine, [dict(job, logprobs=True) for job in jobs])
    solo = solo_generate(engine, items)
    assert max(a.prompt_tokens for a in solo) > 64 and min(a.prompt_tokens for a in solo) < 64
    widths, alone = [], []
    real_launch = engine.start_decoder().launch
    monkeypatch.setattr(
        engine.start_decoder(), "launch", lambda n: widths.append(engine.view().running) or real_launch(n)
    )
    spy(monkeypatch, engine.alone, "run", alone, "alone")
    batched = generate_all(engine, items)
    assert_same_answers(batched, solo)
    assert not alone and max(widths) >= 4
    view = engine.view()
    assert view.kv_blocks_free == view.kv_blocks and not view.running


def phi4_with_original_context(tiny_model, folder, tokens: int):
    """The tiny Phi-4-multimodal with LongRoPE's original context cut to `tokens`."""
    shutil.copytree(tiny_model("phi4-multimodal"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["original_max_position_embeddings"] = config["rope_parameters"]["original_max_position_embeddings"] = tokens
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@contextlib.contextmanager
def transformers_rotary(engine):
    """The engine's model with transformers' own rotary (one choice of factors a forward), for the solo runs."""
    text = engine.model.get_decoder()
    by_row = text.rotary_emb
    text.rotary_emb = by_row.whole
    try:
        yield
    finally:
        text.rotary_emb = by_row


def uncached_greedy(engine, item):
    """`item`'s greedy answer with each token from the model's forward over the whole sequence so far, no cache:
    LongRoPE's factors then follow the whole sequence's length at every step, as Phi-4's generate() means them to
    (it recomputes its cache where a sequence passes the original context; transformers 5.17's drops it there and
    goes on with none, each new token attending to itself only)."""
    inputs, sizes = engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)
    ids, mask, params = inputs["input_ids"], inputs["attention_mask"], item.params
    tokens, logprobs = [], []
    with torch.inference_mode(), transformers_rotary(engine):
        while len(tokens) < params.max_new_tokens and not set(tokens[-1:]) & engine.eos_ids:
            logits = engine.model(**{**inputs, "input_ids": ids, "attention_mask": mask}, use_cache=False).logits
            step = torch.log_softmax(logits[0, -1].float(), dim=-1)
            allowed = step.clone()
            if len(tokens) < params.min_new_tokens:
                allowed[sorted(engine.eos_ids)] = -float("inf")
            token = int(allowed.argmax())
            top, top_ids = step.topk(20)
            tokens.append(token)
            logprobs.append((step[token].item(), top_ids.tolist(), top.tolist()))
            ids, mask = (
                torch.cat([ids, torch.tensor([[token]])], 1),
                torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], 1),
            )
    prompt = int(inputs["attention_mask"].sum())
    return generation(engine.tokenizer, engine.eos_ids, item, tokens, prompt, sizes[0], logprobs)


PHI4_ACROSS = [  # LongRoPE's original context cut to 64 tokens
    {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 70, "min_new_tokens": 70},  # crosses it
    {"messages": [{"role": "user", "content": "Hello"}], "max_new_tokens": 20, "min_new_tokens": 20},  # within
    {"messages": [{"role": "user", "content": "word " * 30}], "max_new_tokens": 12, "min_new_tokens": 12},  # past
    {"messages": [{"role": "user", "content": "word " * 9}], "max_new_tokens": 30, "min_new_tokens": 30},  # crosses
    {"task": "vqa", "image_url": data_uri(striped((48, 40))), "question": "What is it?", "max_new_tokens": 9},
]


def test_phi4_rows_within_across_and_past_longrope_s_original_context_decode_in_the_batch(
    tiny_model, serve, monkeypatch, tmp_path
):
    """transformers takes LongRoPE's long factors for a whole forward once its highest position passes the original
    context; in the batch each row takes them by its own length, and a row reaching it is prefilled again with
    them. Rows within, across and past it decode side by side, none alone: each answer and logprob is the model's
    whole-sequence forward's, and generate()'s for the rows that never cross."""
    engine = serve(phi4_with_original_context(tiny_model, tmp_path / "phi4", 64), VLM_SYNC_INTERVAL="2")
    assert engine.continuous and engine.scheduler.recompute_at == 64
    # its placeholder known (its vision config's): a row that generated one is not prefilled again (test_scheduler.py)
    assert engine.model.config.vision_config.image_token_id in engine.scheduler.media_token_ids
    items = items_of(engine, [dict(job, logprobs=True) for job in PHI4_ACROSS])
    reference = [uncached_greedy(engine, item) for item in items]
    prompts = [a.prompt_tokens for a in reference]
    assert prompts[1] + 20 < 64 < prompts[0] + 70 and prompts[2] > 64 and prompts[3] < 64 < prompts[3] + 30
    with transformers_rotary(engine):
        card = solo_generate(engine, [items[n] for n in (1, 2, 4)])
    assert [without_logprobs(a) for a in card] == [without_logprobs(reference[n]) for n in (1, 2, 4)]
    widths, alone, recomputed = [], [], []
    real_launch = engine.start_decoder().launch
    monkeypatch.setattr(
        engine.start_decoder(), "launch", lambda n: widths.append(engine.view().running) or real_launch(n)
    )
    spy(monkeypatch, engine.alone, "run", alone, "alone")
    spy(monkeypatch, engine.scheduler, "recompute", recomputed, "recompute")
    batched = generate_all(engine, items)
    assert_same_answers(batched, reference)
    assert not alone and max(widths) >= 4 and len(recomputed) >= 1
    view = engine.view()
    assert view.kv_blocks_free == view.kv_blocks and not view.running


def without_logprobs(answer):
    return dataclasses.replace(answer, logprobs=None)


def assert_same_answers(answers: list, references: list) -> None:
    """Equal answers (text, tokens, counts), each token's logprob within float error."""
    assert [without_logprobs(a) for a in answers] == [without_logprobs(a) for a in references]
    for answer, reference in zip(answers, references):
        assert [e["logprob"] for e in answer.logprobs] == pytest.approx(
            [e["logprob"] for e in reference.logprobs], abs=1e-4
        )


class HostCopies(TorchDispatchMode):
    """Records each copy into a tensor: on the GPU, one from a host tensor made without `non_blocking` waits for
    everything queued before it."""

    def __init__(self):
        super().__init__()
        self.copies: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies.append(tuple(arg.shape for arg in args[:2]))
        return func(*args, **(kwargs or {}))


def test_handing_out_an_interval_copies_nothing_into_the_decoders_tensors(tiny_model, serve, monkeypatch):
    """Tokens are handed out, and ended rows released, while the next interval runs: a copy there (a number assigned
    to one element of the decoder's state is one) would wait for that interval, and the GPU for the host again."""
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="2")
    items = items_of(engine, short_jobs(3))
    solo = solo_generate(engine, items)
    recorder, handed_out, released = HostCopies(), [], []
    decoder = engine.start_decoder()
    real_hand_out, real_release = engine.runner.hand_out, decoder.release

    def hand_out(*args):
        handed_out.append(args)
        with recorder:
            return real_hand_out(*args)

    monkeypatch.setattr(engine.runner, "hand_out", hand_out)
    monkeypatch.setattr(decoder, "release", lambda row: released.append(row) or real_release(row))
    assert generate_all(engine, items) == solo
    assert len(handed_out) >= 4 and len(released) == 3 and recorder.copies == []


def test_a_decode_graphs_recording_that_fails_midway_leaves_the_rows_where_they_were(tiny_model, serve, monkeypatch):
    """A step's graph is recorded after two eager steps, whose advance is then put back. One that failed in the
    second (out of memory in the sampler's sort, as a 256-row step's did capped to 24 GB) put nothing back: the
    rows went on a step ahead. Here CUDA's streams are stand-ins and every recording fails after its steps; a step
    runs eagerly without its graph."""
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="4")
    items = items_of(engine, mixed_jobs(2))
    solo = solo_generate(engine, items)
    decoder = engine.start_decoder()
    decoder.step_graphs.enabled = True
    calls, real_advance = [], decoder.advance

    def advance(bucket, span):
        calls.append(bucket)
        if len(calls) == 2:  # the first recording's second step
            raise torch.OutOfMemoryError("a stand-in")
        return real_advance(bucket, span)

    class Stream:
        def wait_stream(self, other):
            pass

    class CUDAGraph:
        def capture_begin(self, *args, **kwargs):
            raise RuntimeError("no CUDA graph on the CPU")

    monkeypatch.setattr(decoder, "advance", advance)
    monkeypatch.setattr(decoder.step_graphs, "memory", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(prefill_graphs, "_capture_stream", None)  # made from the stand-ins, not kept
    monkeypatch.setattr(prefill_graphs, "voided_recordings", [])
    assert generate_all(engine, items) == solo
    # The step that ran out of memory is not recorded again; the others fail apart.
    assert len(decoder.step_graphs.unrecorded) == 1


def out_of_memory_above(monkeypatch, decoder, rows: int) -> list:
    """Decode steps of more than `rows` rows run out of memory (after the first of them has run); the buckets met."""
    met, real_advance = [], decoder.advance

    def advance(bucket, span):
        met.append(bucket)
        if bucket > rows and met.count(bucket) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return real_advance(bucket, span)

    monkeypatch.setattr(decoder, "advance", advance)
    return met


def test_a_decode_step_out_of_memory_preempts_the_rows_past_a_smaller_bucket(tiny_model, serve, monkeypatch):
    """A step's memory follows its bucket of rows: out of memory at 16, the rows from the 9th on go back to the
    queue, at most 8 are given until the engine is idle, and every job gets its solo tokens."""
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_SIZE="16", VLM_SYNC_INTERVAL="4")
    items = items_of(engine, short_jobs(12))
    solo = solo_generate(engine, items)
    decoder = engine.start_decoder()
    met = out_of_memory_above(monkeypatch, decoder, 8)
    preempted = []
    real_preempt = engine.scheduler.preempt
    monkeypatch.setattr(
        engine.scheduler, "preempt", lambda row, release: preempted.append(row) or real_preempt(row, release)
    )
    assert generate_all(engine, items) == solo
    assert met.count(16) == 2 and sorted(preempted) == list(range(8, 12))  # one step ran, the next ran out
    assert decoder.pool.free == decoder.pool.capacity
    generate_all(engine, items[:1])
    assert engine.view().row_cap is None  # lifted once the engine was idle


def test_under_unbroken_load_the_rows_come_back_after_a_while(tiny_model, serve, monkeypatch):
    """The row cap after a decode step ran out of memory lifts after ROW_CAP_S (here at once), not only when idle:
    the preempted rows are given again while the others still decode."""
    monkeypatch.setattr(scheduler_module, "ROW_CAP_S", 0.0)
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_SIZE="16", VLM_SYNC_INTERVAL="4")
    items = items_of(engine, short_jobs(12))
    solo = solo_generate(engine, items)
    decoder = engine.start_decoder()
    met, real_advance = [], decoder.advance

    def advance(bucket, span):  # the second 16-row step runs out of memory, once
        met.append(bucket)
        if bucket == 16 and met.count(16) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return real_advance(bucket, span)

    monkeypatch.setattr(decoder, "advance", advance)
    assert generate_all(engine, items) == solo
    after = met[[n for n, bucket in enumerate(met) if bucket == 16][1] + 1 :]
    assert 16 in after  # the four preempted rows came back before the others ended
    assert decoder.pool.free == decoder.pool.capacity


def test_a_decode_step_of_the_fewest_rows_out_of_memory_fails_its_items_and_the_engine_goes_on(
    tiny_model, serve, monkeypatch
):
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="4")
    items = items_of(engine, short_jobs(2))
    solo = solo_generate(engine, items)
    decoder = engine.start_decoder()
    real_advance = decoder.advance
    out_of_memory_above(monkeypatch, decoder, 0)
    failed = generate_all(engine, items)
    assert [getattr(outcome, "code", None) for outcome in failed] == ["out_of_memory"] * 2
    monkeypatch.setattr(decoder, "advance", real_advance)  # steps fit again
    assert generate_all(engine, items) == solo and decoder.pool.free == decoder.pool.capacity


def long_among_short(tiny_model, serve):
    """An engine with a 256-token budget, three short text jobs and, last, a prompt of more than two budgets; the
    items and their solo answers."""
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="256", VLM_SYNC_INTERVAL="2")
    long_job = {"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": LONG_TEXT + " " + LONG_TEXT}
    short_jobs = [
        {"messages": [{"role": "user", "content": f"Count to {n}."}], "max_new_tokens": 40, "min_new_tokens": 40}
        for n in range(3)
    ]
    items = items_of(engine, [*short_jobs, dict(long_job, max_new_tokens=12, min_new_tokens=12)])
    return engine, items, solo_generate(engine, items)


def test_a_long_prompt_enters_in_chunks_while_the_others_decode(tiny_model, serve, monkeypatch):
    engine, items, solo = long_among_short(tiny_model, serve)
    assert solo[-1].prompt_tokens > 2 * 256  # three chunks at least
    decoder = engine.start_decoder()
    events: list = []
    spy(monkeypatch, decoder.prompts, "prefill_chunk", events, "chunk")
    spy(monkeypatch, decoder, "launch", events, "step")
    assert generate_all(engine, items) == solo
    chunks = [n for n, event in enumerate(events) if event == "chunk"]
    assert len(chunks) >= 3
    assert all("step" in events[a:b] for a, b in zip(chunks, chunks[1:]))  # the short rows decoded in between
    assert decoder.pool.free == decoder.pool.capacity


def test_a_chunked_prompts_first_token_is_read_after_the_next_launch(tiny_model, serve, monkeypatch):
    """A prompt's last chunk hands out its first token as a prefill does: the engine launches the next decode
    interval before it reads that token, so it does not wait for the GPU there (under open load most prompts,
    starting with a cached system prompt, enter through chunks)."""
    engine, items, solo = long_among_short(tiny_model, serve)
    decoder = engine.start_decoder()
    events: list = []
    real_chunk, real_read = decoder.prompts.prefill_chunk, decoder.read

    def chunk(chunked, *args, **kwargs):
        launched = real_chunk(chunked, *args, **kwargs)
        events.append(("chunk", chunked.row))
        return launched

    monkeypatch.setattr(decoder.prompts, "prefill_chunk", chunk)
    monkeypatch.setattr(decoder, "read", lambda launched: events.append(("read", launched.rows)) or real_read(launched))
    spy(monkeypatch, decoder, "launch", events, ("step", None))
    assert generate_all(engine, items) == solo
    last = max(n for n, (event, _) in enumerate(events) if event == "chunk")
    row = events[last][1]
    reads = [n for n, event in enumerate(events) if event == ("read", (row,))]
    assert reads and reads[0] > last  # the chunk did not wait for its token
    assert ("step", None) in events[last : reads[0]]


# Prefilled whole: Qwen3-VL (deepstack features), PaliGemma (its prefix attends both ways: in causal chunks
# its answer differed from generate()'s), Gemma 3 and Llama 4 (layers of limited attention, through their own masks),
# Phi-4-multimodal (its decoder embeds the images itself: it takes the pixels, not embeddings).
WHOLE = {"qwen3-vl", "paligemma", "gemma3", "llama4", "phi4-multimodal"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_over_the_token_budget_gets_its_solo_tokens_in_chunks_where_its_family_allows(
    family, tiny_model, serve, monkeypatch
):
    engine = serve(tiny_model(family), VLM_MAX_BATCH_TOKENS="256")
    job = {"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": LONG_TEXT + " " + LONG_TEXT}
    items = items_of(engine, [dict(job, max_new_tokens=12, min_new_tokens=12)])
    solo = solo_generate(engine, items)
    assert solo[0].prompt_tokens > 2 * 256
    events: list = []
    if engine.continuous:
        spy(monkeypatch, engine.start_decoder().prompts, "prefill_chunk", events, "chunk")
    assert generate_all(engine, items) == solo
    assert bool(events) == (family not in WHOLE)


@pytest.mark.parametrize("family, chunkable", [("paligemma", False), ("llava", True)])
def test_a_family_that_hands_its_language_model_masks_of_its_own_is_not_chunked(family, chunkable, tiny_model, serve):
    # PaliGemma builds one mask per layer kind, its prefix attending both ways.
    engine = serve(tiny_model(family))
    item = items_of(engine, [{"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": "What?"}])[0]
    inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)
    with torch.inference_mode():
        chunked = engine.start_decoder().prompts.begin_chunks(inputs, 0, item.params)
    assert (chunked is not None) == chunkable


def packed_prefill_jobs() -> list[dict]:
    """Prompts of very different lengths: padded to the longest, more than a 1,024-token budget; packed, within it."""
    long = {"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": LONG_TEXT}
    short = [{"messages": [{"role": "user", "content": f"Count to {n}."}]} for n in range(2)]
    image = {"task": "vqa", "image_url": data_uri(striped((40, 56))), "question": "What is it?"}
    return [dict(job, max_new_tokens=n, min_new_tokens=n) for job, n in zip([long, *short, image], (5, 30, 12, 20))]


def language_model_inputs(monkeypatch, engine) -> list:
    """The shapes of the embeddings handed to the language model, per call of its forward."""
    shapes = []
    language_model = engine.model.get_decoder()
    real = language_model.forward

    def recorded(*args, **kwargs):
        embeds = kwargs.get("inputs_embeds")
        shapes.append(None if embeds is None else tuple(embeds.shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(language_model, "forward", recorded)
    return shapes


# Families whose language model takes only embeddings and positions: the rest (WHOLE, and Phi-4's remote code)
# prefill padded through the whole model.
PACKED = [f for f in FAMILIES if f not in WHOLE and f != "phi4-multimodal"]


@pytest.mark.parametrize("family", PACKED)
def test_prompts_prefilled_together_go_through_the_language_model_packed_with_their_solo_tokens(
    family, tiny_model, serve, monkeypatch
):
    """Four prompts of very different lengths within the token budget packed (not padded): one prefill of all
    four, their tokens only, in one sequence through the language model; each answer its solo generate()'s."""
    engine = serve(tiny_model(family), VLM_MAX_BATCH_TOKENS="1024", VLM_PREFIX_CACHING="false")
    items = items_of(engine, packed_prefill_jobs())
    solo = solo_generate(engine, items)
    prompts = [outcome.prompt_tokens for outcome in solo]
    assert sum(prompts) <= 1024 < len(prompts) * max(prompts)  # one prefill packed, two or more padded
    decoder = engine.start_decoder()
    prefills: list = []
    spy(monkeypatch, decoder.prompts, "prefill_launch", prefills, "prefill")
    shapes = language_model_inputs(monkeypatch, engine)
    decoder.prompts.packs = True  # as after a first prefill
    assert generate_all(engine, items) == solo
    assert decoder.prompts.packs and prefills == ["prefill"]
    assert shapes[0][:2] == (1, sum(prompts))  # then the decode steps
    assert decoder.pool.free == decoder.pool.capacity


def test_the_gpu_path_hands_varlen_the_packed_prompts_causal_in_their_own_spans(tiny_model, serve, monkeypatch):
    # The prompts' own attention through varlen's layout (a tensor-ops stand-in for the kernel on the CPU).
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="1024", VLM_PREFIX_CACHING="false")
    items = items_of(engine, packed_prefill_jobs())
    solo = solo_generate(engine, items)
    causal: list = []  # the tokens of each causal call (the vision tower's are not)

    @functools.wraps(block_diagonal_varlen)  # its signature: the options the engine hands it
    def kernel(q, *args, **kwargs):
        if kwargs.get("window_size") == (-1, 0):
            causal.append(q.shape[0])
        return block_diagonal_varlen(q, *args, **kwargs)

    monkeypatch.setattr(varlen, "takes", lambda query: True)
    monkeypatch.setattr(varlen, "kernel", lambda: kernel)
    engine.start_decoder().prompts.packs = True
    assert generate_all(engine, items) == solo
    layers = engine.model.config.get_text_config(decoder=True).num_hidden_layers
    assert causal == [sum(outcome.prompt_tokens for outcome in solo)] * layers


def test_a_family_whose_language_model_takes_more_prefills_padded_with_its_solo_tokens(tiny_model, serve, monkeypatch):
    engine = serve(tiny_model("qwen3-vl"), VLM_MAX_BATCH_TOKENS="1024", VLM_PREFIX_CACHING="false")
    items = items_of(engine, packed_prefill_jobs())
    solo = solo_generate(engine, items)
    shapes = language_model_inputs(monkeypatch, engine)
    assert generate_all(engine, items) == solo
    assert engine.start_decoder().prompts.packs is False
    assert shapes[0][0] > 1  # the padded batch, its deepstack features beside it


def test_a_row_frees_its_blocks_at_its_own_end(tiny_model, serve):
    """Room for two rows' tokens: a queued short job starts and finishes while a long one still runs."""
    engine = serve(tiny_model("qwen2-vl"), VLM_KV_CACHE_TOKENS="480", VLM_SYNC_INTERVAL="2")
    long_job = {"messages": [{"role": "user", "content": "Talk."}], "max_new_tokens": 300, "min_new_tokens": 300}
    short = {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 4, "min_new_tokens": 4}
    long_item, *short_items = items_of(engine, [long_job, short, short, short])
    finished: list = []

    async def run():
        from runpod_vlm.answers import generate_one

        async def one(name, item):
            result = await generate_one(engine, item)
            finished.append(name)
            return result

        return await asyncio.gather(one("long", long_item), *(one(f"short{n}", i) for n, i in enumerate(short_items)))

    results = asyncio.run(run())
    assert finished[-1] == "long" and all(r.completion_tokens for r in results)
    assert results[1:] == solo_generate(engine, short_items)


def test_a_finished_items_ticket_and_prepared_pixels_go_without_the_cycle_collector(tiny_model, serve):
    """Nothing of an answered item outlives it until a garbage collection: on the GPU its page-locked pixels go back
    to the host's cache for the next burst, where waiting for the collector made every burst allocate new ones."""
    engine = serve(tiny_model("qwen2-vl"))
    image = {"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": "What?", "max_new_tokens": 3}
    (item,) = items_of(engine, [image])
    done = threading.Event()
    gc.collect()
    gc.disable()
    try:
        ticket = engine.submit(item, lambda event: isinstance(event, StreamDelta) or done.set())
        assert done.wait(60)
        pixels = ticket.prepared.result()[0]["pixel_values"]
        gone = [weakref.ref(ticket), weakref.ref(pixels)]
        del ticket, pixels
        assert wait_for(lambda: all(ref() is None for ref in gone))
    finally:
        gc.enable()


def test_a_request_the_whole_pool_cannot_hold_fails_alone_with_out_of_memory(tiny_model, serve):
    engine = serve(tiny_model("qwen2-vl"), VLM_KV_CACHE_TOKENS="256", VLM_MAX_NEW_TOKENS="400")
    short = {"messages": [{"role": "user", "content": "Short."}], "max_new_tokens": 3}
    huge = {"messages": [{"role": "user", "content": "Long."}], "max_new_tokens": 300}
    out = asyncio.run(handler.local_test_answer({"id": "j", "input": {"requests": [short, huge, short]}}))
    first, failed, last = out["results"]
    assert failed["code"] == "out_of_memory" and "the KV cache, which holds 256 tokens" in failed["error"]
    assert failed["param"] == "requests[1]"
    assert first == last and "error" not in first
    pool = engine.start_decoder().pool
    assert pool.free == pool.capacity


# The families whose processors batch images by concatenation; two mixed sizes in Pixtral's (mistral3) do not stack.
STACKING = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava", "llava-next", "gemma3", "llava-onevision"]
STACKING += ["internvl-hf", "glm4v", "llama4"]


@pytest.mark.parametrize("family", [*STACKING, "mistral3", "smolvlm"])
def test_items_prepared_alone_stack_into_the_processors_own_batch(family, tiny_model, serve):
    """The intake prepares each item alone; their stack must be what the processor makes of them together,
    or None (the group is then prepared together): Pixtral pads images of other sizes, Idefics3 lays them
    out per item."""
    engine = serve(tiny_model(family))
    jobs = [
        {"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": "What is it?"},
        {"messages": [{"role": "user", "content": "Only text, and a longer one than the others."}]},
        {"task": "caption", "image_url": data_uri(striped((40, 72)))},
    ]
    items = items_of(engine, jobs)
    alone = [engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)[0] for item in items]
    together, _ = engine.adapter.batch_inputs(engine.processor, items, "cpu", engine.dtype)
    stacked = engine.adapter.collate(engine.processor, alone)
    if stacked is None:
        assert family not in STACKING
        return
    assert sorted(stacked.keys()) == sorted(together.keys())
    for name in together:
        assert torch.equal(stacked[name], together[name]), name


def test_running_out_of_memory_in_a_long_prompts_vision_pass_fails_it_alone(tiny_model, serve, monkeypatch):
    # On the H200 capped to 24 GB, the vision pass of a 16-image request (the first step of its chunked
    # prefill) ran out of memory outside the out-of-memory path: generation_failed. Its neighbours go on.
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="256")
    decoder = engine.start_decoder()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 208.00 MiB")

    monkeypatch.setattr(decoder.prompts, "begin_chunks", out_of_memory)
    long_job = {"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": LONG_TEXT, "max_new_tokens": 4}
    short = {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 4}
    out = asyncio.run(handler.local_test_answer({"id": "j", "input": {"requests": [long_job, short]}}))
    failed, answered = out["results"]
    assert failed["code"] == "out_of_memory" and failed["param"] == "requests[0]"
    assert "error" not in answered and decoder.pool.free == decoder.pool.capacity


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_a_long_prompt_whose_images_run_out_of_memory_at_once_is_encoded_one_image_at_a_time(
    family, tiny_model, serve, monkeypatch
):
    # At a 24 GB cap the KV pool leaves less room than the vision pass of 16 large images at once needs.
    engine = serve(tiny_model(family), VLM_MAX_BATCH_TOKENS="256")
    job = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_uri(striped((64, 48)))}},
                    {"type": "image_url", "image_url": {"url": data_uri(striped((40, 72)))}},
                    {"type": "text", "text": LONG_TEXT},
                ],
            }
        ],
        "max_new_tokens": 8,
        "min_new_tokens": 8,
    }
    solo = solo_generate(engine, items_of(engine, [job]))
    language = type(engine.model.model)
    whole, passes = language.get_image_features, []

    def at_most_one_image(self, pixel_values, image_grid_thw=None, **kwargs):
        passes.append(len(image_grid_thw))
        if len(image_grid_thw) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        return whole(self, pixel_values, image_grid_thw, **kwargs)

    monkeypatch.setattr(language, "get_image_features", at_most_one_image)
    assert generate_all(engine, items_of(engine, [job])) == solo
    assert passes == [2, 1, 1] and "get_image_features" not in vars(engine.model.model)


def test_running_out_of_memory_while_pixels_move_to_the_gpu_splits_then_fails_the_item_alone(
    tiny_model, serve, monkeypatch
):
    # A 7B worker at a 48 GB cap answered a 16-image request with generation_failed: the OOM was raised while
    # the batch's pixel values moved to the GPU, outside the out-of-memory path.
    from runpod_vlm.engine import runner

    serve(tiny_model("qwen2-vl"))
    real_on_device = runner.on_device

    def on_device(inputs, *args, **kwargs):  # the image's pixels, in a batch or alone
        if "pixel_values" in inputs:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_on_device(inputs, *args, **kwargs)

    monkeypatch.setattr(runner, "on_device", on_device)
    image = {"task": "vqa", "image_url": data_uri(striped((64, 48))), "question": "What?", "max_new_tokens": 3}
    short = {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 3}
    out = asyncio.run(handler.local_test_answer({"id": "j", "input": {"requests": [image, short]}}))
    failed, answered = out["results"]
    assert failed["code"] == "out_of_memory" and failed["param"] == "requests[0]", failed
    assert "error" not in answered


def test_no_cuda_graph_is_recorded_while_a_shape_compiles(tiny_model, serve, monkeypatch):
    """The background compile's synchronizing benchmarks void a capture running beside them (and the
    capture the compile): while the compile holds the lock, steps run without recording; after, they record."""
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="2")
    from runpod_vlm.engine.decoder_graphs import StepGraphs

    recorded: list = []
    monkeypatch.setattr(StepGraphs, "_capture", lambda self, bucket, span: recorded.append(bucket))
    engine.start_decoder().step_graphs.enabled = True
    job = {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 6, "min_new_tokens": 6}
    with engine.compiler.capture_lock:
        held = generate_all(engine, items_of(engine, [job]))
    assert not recorded
    assert generate_all(engine, items_of(engine, [job])) == held
    assert recorded


def test_a_step_whose_graph_the_compile_kept_from_recording_is_recorded_before_the_compiles_next_shape(
    tiny_model, serve, monkeypatch
):
    """While the background compile holds the GPU for a shape, a step that needs its graph runs eagerly (125-190
    tokens/s for 16 jobs on the H200): before the compile takes the GPU for its next shape, the engine thread records
    it. With no rows decoding, nothing is waited for."""
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="2")
    from runpod_vlm.engine.decoder_graphs import StepGraphs

    recorded: list = []
    monkeypatch.setattr(StepGraphs, "_capture", lambda self, bucket, span: recorded.append(bucket))
    monkeypatch.setattr(StepGraphs, "capture_pass", lambda self: None)  # the prefills' graphs: not here
    decoder = engine.start_decoder()
    decoder.step_graphs.enabled = True
    job = {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 1000, "min_new_tokens": 1000}
    (item,) = items_of(engine, [job])
    with engine.compiler.capture_lock:  # a shape compiling
        ticket = engine.submit(item, lambda event: None)
        assert wait_for(lambda: decoder.step_graphs.recording_wanted)
    assert not recorded
    with engine.compiler.holding_the_gpu():  # the next shape
        assert recorded and engine.view().running
    ticket.cancel()
    assert wait_for(lambda: not engine.view().running)
    decoder.step_graphs.recording_wanted = True  # as a step left it before its rows ended
    started = time.monotonic()
    with engine.compiler.holding_the_gpu():
        assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("family", ["qwen2-vl", "llava"])
def test_an_idle_worker_records_its_decode_graphs_before_any_request(family, tiny_model, serve, monkeypatch):
    """The KV pool and the rows' positions (M-RoPE's three axes for Qwen2-VL) are made with the decoder, not at the
    first prefill: a worker idle after its compile records its decode steps' graphs ahead, and its first burst meets
    none (0.49 s of 1.82 s for 32 jobs at 24 GB, bench/README.md). The first prefill writes into that same pool."""
    engine = serve(tiny_model(family))
    from runpod_vlm.engine.decoder_graphs import StepGraphs

    recorded: list = []
    monkeypatch.setattr(StepGraphs, "_capture", lambda self, bucket, span: recorded.append(bucket))
    decoder = engine.start_decoder()
    decoder.step_graphs.enabled = decoder.decode_kernel = True  # as on a GPU
    decoder.step_graphs.ask_ahead(decoder.buckets[0])
    engine.start_thread()
    assert wait_for(lambda: recorded == [decoder.buckets[0]] * 2)  # its greedy and sampled steps
    decoder.step_graphs.enabled = decoder.decode_kernel = False
    keys, position = decoder.keys[0], decoder.position
    assert position.shape[-2:] == (decoder.rows, 1) and position.dim() == (3 if family == "qwen2-vl" else 2)
    job = {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 6, "min_new_tokens": 6}
    items = items_of(engine, [job])
    assert generate_all(engine, items) == solo_generate(engine, items)
    assert decoder.keys[0] is keys and decoder.position is position and keys.abs().sum() > 0


def test_the_engine_thread_ends_before_the_interpreter_tears_down(tiny_model, serve, monkeypatch):
    """A daemon engine thread still recording a CUDA graph while the interpreter tore down aborted the process: the
    engine is closed at exit, its thread joined, once its step (or recording) is done."""
    import atexit

    at_exit: list = []
    monkeypatch.setattr(atexit, "register", lambda function, *args: at_exit.append((function, args)))
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="8")  # an engine of its own, not kept: it ends closed
    items = items_of(engine, [{"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 4}])
    assert generate_all(engine, items)[0].text is not None
    ours = [(function, args) for function, args in at_exit if function.__module__ == "runpod_vlm.engine.engine"]
    assert engine.view().thread_alive and len(ours) == 1
    function, args = ours[0]
    function(*args)
    assert not engine.view().thread_alive
    late = []
    engine.submit(items[0], late.append)
    assert late[0].code == "worker_stopping"  # closed: nothing more runs here


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_image_placeholders_are_counted_on_the_host(family, tiny_model, serve):
    """The model's own count of placeholder tokens against features reads the GPU back (a wait for the prefill
    before): it is skipped, the same masks made, and the prefill counts them on the host from the grid instead."""
    engine = serve(tiny_model(family))
    (item,) = items_of(engine, packed_prefill_jobs()[:1])
    inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)
    decoder = engine.start_decoder()
    assert decoder.prompts.vision_graphs_unit
    decoder.prompts.check_placeholders(inputs)
    inner, ids, embeds = engine.model.model, inputs["input_ids"], torch.zeros((*inputs["input_ids"].shape, 4))
    with pytest.raises(ValueError):  # the model's own check, on features of one token
        type(inner).get_placeholder_mask(inner, ids, embeds, image_features=torch.zeros(1, 4))
    masks = inner.get_placeholder_mask(ids, embeds, image_features=torch.zeros(1, 4))
    assert all(torch.equal(a, b) for a, b in zip(masks, type(inner).get_placeholder_mask(inner, ids, embeds)))
    image = engine.model.config.image_token_id
    first = int((inputs["input_ids"][0] == image).nonzero()[0])
    inputs["input_ids"][0, first] = inputs["input_ids"][0, first - 1]  # one placeholder fewer
    with pytest.raises(ValueError, match="image_grid_thw"):
        decoder.prompts.check_placeholders(inputs)
    with pytest.raises(ValueError, match="image_grid_thw"):  # the prefill itself checks, before the GPU
        decoder.prompts.prefill(inputs, decoder.free_rows()[:1], [item.params])


def image_device_intake(engine, monkeypatch, image_bytes: int, fail=None):
    """An intake that processes images on an image device (the CPU standing in for the GPU) while under
    `image_bytes`, and the image devices its `batch_inputs` calls were given; `fail(image_device)` may raise."""
    from runpod_vlm.engine.intake import Intake

    calls = []
    real = engine.adapter.batch_inputs

    def batch_inputs(processor, items, device, dtype, image_device=None):
        calls.append(image_device)
        if fail is not None:
            fail(image_device)
        return real(processor, items, device, dtype, image_device=image_device)

    monkeypatch.setattr(engine.adapter, "batch_inputs", batch_inputs)
    intake = Intake(
        engine.adapter, engine.processor, engine.dtype, engine.timings, image_device="cpu", image_bytes=image_bytes
    )
    return intake, calls


def test_the_intake_processes_images_on_the_device_while_their_pixels_waiting_there_stay_under_a_budget(
    tiny_model, serve, monkeypatch
):
    """Pixels prepared on the GPU hold its memory until admitted: past the budget an item is prepared on the host,
    and once the waiting pixels are dropped there is room again. Either way the inputs are the same."""
    engine = serve(tiny_model("qwen2-vl"))
    (item,) = items_of(engine, packed_prefill_jobs()[:1])
    intake, calls = image_device_intake(engine, monkeypatch, image_bytes=1)
    on_device, _, _ = intake.prepare(item)
    assert calls == ["cpu"] and intake.held_on_device > 0
    on_host, _, _ = intake.prepare(item)  # the first item's pixels still wait: no room
    assert calls == ["cpu", None]
    assert on_device.keys() == on_host.keys()
    assert all(torch.equal(on_device[name], on_host[name]) for name in on_device)
    del on_device
    assert intake.held_on_device == 0
    intake.prepare(item)
    assert calls == ["cpu", None, "cpu"]


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_images_for_a_gpu_are_resized_on_the_host_as_the_processor_resizes_them(tiny_model, serve, monkeypatch, family):
    """A GPU's resize rounds differently from the host's. So an item for the
    GPU gets its images already at the size the processor gives them, resized by the processor's own steps on the
    host: there it only rescales, normalizes and cuts patches, and its inputs are the host's."""
    engine = serve(tiny_model(family))
    images = [striped((200, 130)), striped((61, 333)), striped((40, 56))]
    content = [{"type": "image_url", "image_url": {"url": data_uri(image)}} for image in images]
    job = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "Compare them."}]}]}
    (item,) = items_of(engine, [job])
    adapter, processor = engine.adapter, engine.processor
    on_host, _ = adapter.batch_inputs(processor, [item], "cpu", engine.dtype)
    resized, resizes = [], []  # what host_resized gave; the processor's resizes (in, out) after it
    spy_on, resize = adapter.host_resized, processor.image_processor.resize

    def host_resized(*args):
        resized.append(spy_on(*args))
        resizes.clear()
        return resized[-1]

    def resized_by_the_processor(images, *args, **kwargs):
        out = resize(images, *args, **kwargs)
        resizes.append((tuple(images.shape[-2:]), tuple(out.shape[-2:])))
        return out

    monkeypatch.setattr(adapter, "host_resized", host_resized)
    monkeypatch.setattr(processor.image_processor, "resize", resized_by_the_processor)
    for_device, _ = adapter.batch_inputs(processor, [item], "cpu", engine.dtype, image_device="cpu")
    assert on_host.keys() == for_device.keys()
    assert all(torch.equal(on_host[name], for_device[name]) for name in on_host)
    assert resizes and all(before == after for before, after in resizes)  # on the device its resize does nothing
    patch = processor.image_processor.patch_size
    assert len(resized) == len(item.images)
    for image, tensor, (_, rows, columns) in zip(item.images, resized, on_host["image_grid_thw"].tolist()):
        assert image.size != (columns * patch, rows * patch)  # the processor resizes each of them
        assert tensor.dtype == torch.uint8 and tuple(tensor.shape) == (3, rows * patch, columns * patch)


def test_an_item_whose_images_run_out_of_device_memory_is_prepared_on_the_host(tiny_model, serve, monkeypatch):
    def fail(image_device):
        if image_device is not None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine = serve(tiny_model("qwen2-vl"))
    (item,) = items_of(engine, packed_prefill_jobs()[:1])
    intake, calls = image_device_intake(engine, monkeypatch, image_bytes=1 << 30, fail=fail)
    inputs, _, _ = intake.prepare(item)
    assert calls == ["cpu", None] and intake.held_on_device == 0
    expected, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])

    def broken(image_device):
        if image_device is not None:
            raise ValueError("not a memory error")

    intake, calls = image_device_intake(engine, monkeypatch, image_bytes=1 << 30, fail=broken)
    with pytest.raises(ValueError):  # any other error is the item's, not tried again on the host
        intake.prepare(item)
    assert calls == ["cpu"]


def test_the_intake_puts_pixels_for_a_gpu_in_page_locked_memory(tiny_model, serve, monkeypatch):
    """A copy to the GPU from pageable memory waits for the GPU's earlier work (a prefill launched ahead): pixels
    bound for a GPU are page-locked on the intake thread, a cached image's repeated row as one row, small tensors
    left as they are."""
    from runpod_vlm.engine.host_copies import STAGED_BYTES, page_locked

    locked = []

    def pin_memory(tensor):  # the CPU has no page-locked memory to give: the copy is recorded instead
        locked.append(tuple(tensor.shape))
        return tensor.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    engine = serve(tiny_model("qwen2-vl"))
    intake = engine.intake()
    assert not intake.pin  # the model is on the CPU
    (item,) = items_of(engine, packed_prefill_jobs()[:1])
    intake.prepare(item)
    assert locked == []
    monkeypatch.setattr(intake, "pin", True)  # undone after: the next test may serve this same engine
    inputs, _, _ = intake.prepare(item)
    pixels = inputs["pixel_values"]
    assert pixels.nelement() * pixels.element_size() > STAGED_BYTES
    assert locked == [tuple(pixels.shape)]
    locked.clear()
    cached = page_locked(torch.ones(1, STAGED_BYTES // 2).expand(6, -1))  # a cached image's zero pixels
    assert locked == [(1, STAGED_BYTES // 2)]
    assert cached.shape == (6, STAGED_BYTES // 2) and cached.stride(0) == 0
    small = torch.ones(STAGED_BYTES // 8, dtype=torch.long)
    assert page_locked(small) is small and len(locked) == 1
