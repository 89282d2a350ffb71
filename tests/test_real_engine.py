"""The worker on the real engine: tiny random-weight models, real torch + transformers on CPU.

Every call goes through `handler.handler(job)` exactly as RunPod makes it. Parity tests compare the
worker's tokens with the plain transformers recipe (apply_chat_template + processor + generate)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import pytest
import torch

import handler
from runpod_vlm.answers import generate_all, stream_generation
from runpod_vlm.engine.loading import quantization_config
from runpod_vlm.vocabulary import StreamDelta
from tools.sample_images import b64, data_uri, plain, striped

FAMILIES = ["qwen2-vl", "qwen2.5-vl", "llava", "llava-next"]
GROUNDING_FAMILIES = {"qwen2-vl", "qwen2.5-vl"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def engine(family, tiny_model, serve):
    return serve(tiny_model(family))


def ask(payload: dict, job_id: str = "job-1") -> dict:
    return asyncio.run(handler.local_test_answer({"id": job_id, "input": payload}))


@pytest.fixture
def forward_calls(engine, monkeypatch, forward_calls_of):
    # A prompt that starts from cached blocks (every prompt after the first shares its template's opening)
    # goes through the language model alone, not this forward: the recorded prefill must be a whole one.
    monkeypatch.setattr(engine, "prefix_caching", False)
    return forward_calls_of(engine)


@functools.cache
def reference_model(folder: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(folder)


def reference_generate(folder, messages: list[dict], max_new_tokens: int):
    """The model card recipe: images inside the messages, greedy decoding."""
    model, processor = reference_model(str(folder))
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    prompt_ids = inputs["input_ids"][0]
    return prompt_ids, output[0, len(prompt_ids) :]


def worker_tokens(calls, row: int = 0, max_new_tokens: int | None = None):
    """The prompt (padding removed) and greedy tokens of one row, from recorded forward passes."""
    prompt_ids, mask = calls.prompts[0]["input_ids"][row], calls.prompts[0]["attention_mask"][row]
    generated = [int(choice[row]) for choice in calls.choices][:max_new_tokens]
    return prompt_ids[mask[: len(prompt_ids)].bool()], generated


def text_block(text):
    return {"type": "text", "text": text}


# ---- every task, every family -------------------------------------------------------------------


TASK_INPUTS = {
    "caption": {},
    "caption_long": {},
    "vqa": {"question": "What colour is the square?"},
    "grounding": {"target": "the red square"},
}


@pytest.mark.parametrize("task", sorted(TASK_INPUTS))
def test_each_image_task_answers(engine, family, task):
    out = ask({"task": task, "image_url": data_uri(striped()), "max_new_tokens": 3, **TASK_INPUTS[task]})
    assert "error" not in out, out
    assert out["task"] == task and out["image_count"] == 1
    assert out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 3 and out["usage"]["prompt_tokens"] > 0
    assert isinstance(out["response"], str)
    if task == "grounding":
        assert out["supports_grounding"] == (family in GROUNDING_FAMILIES)
        assert "bbox" in out


def test_caption_tasks_use_different_prompts(engine):
    short = ask({"task": "caption", "image_b64": b64(plain("red")), "max_new_tokens": 1})
    long = ask({"task": "caption_long", "image_b64": b64(plain("red")), "max_new_tokens": 1})
    assert long["usage"]["prompt_tokens"] > short["usage"]["prompt_tokens"]


def test_text_only_chat_answers(engine):
    out = ask({"messages": [{"role": "user", "content": "Say hello."}], "max_new_tokens": 2})
    assert "error" not in out, out
    assert out["task"] == "chat" and out["image_count"] == 0
    assert out["usage"]["completion_tokens"] == 2


def test_every_image_of_a_request_reaches_the_prompt(engine):
    one = ask({"task": "vqa", "images": [data_uri(striped())], "question": "Same?", "max_new_tokens": 1})
    two = ask(
        {
            "task": "vqa",
            "images": [data_uri(striped()), data_uri(plain("blue"))],
            "question": "Same?",
            "max_new_tokens": 1,
        }
    )
    assert two["image_count"] == 2
    assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]


# ---- parity with the plain transformers recipe --------------------------------------------------


def test_vqa_matches_the_reference_recipe(engine, tiny_model, family, forward_calls):
    picture = striped((56, 84))
    out = ask({"task": "vqa", "image_url": data_uri(picture), "question": "What is shown?", "max_new_tokens": 6})
    assert "error" not in out, out
    prompt, generated = worker_tokens(forward_calls, max_new_tokens=6)
    reference_prompt, reference_generated = reference_generate(
        tiny_model(family),
        [{"role": "user", "content": [{"type": "image", "image": picture}, text_block("What is shown?")]}],
        max_new_tokens=6,
    )
    assert prompt.tolist() == reference_prompt.tolist()
    assert generated == reference_generated.tolist()
    assert out["response"] == engine.tokenizer.decode(reference_generated, skip_special_tokens=True).strip()


def test_multi_image_multi_turn_chat_matches_the_reference_recipe(engine, tiny_model, family, forward_calls):
    first, second = striped(), plain("green", (84, 56))
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(first)}},
                {"type": "image_url", "image_url": data_uri(second)},
                text_block("Which image is green?"),
            ],
        },
        {"role": "assistant", "content": "The second."},
        {"role": "user", "content": [text_block("And the first?")]},
    ]
    out = ask({"messages": messages, "max_new_tokens": 5})
    assert "error" not in out, out
    assert out["image_count"] == 2
    prompt, generated = worker_tokens(forward_calls, max_new_tokens=5)
    reference_prompt, reference_generated = reference_generate(
        tiny_model(family),
        [
            {"role": "system", "content": [text_block("You answer in one word.")]},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": first},
                    {"type": "image", "image": second},
                    text_block("Which image is green?"),
                ],
            },
            {"role": "assistant", "content": [text_block("The second.")]},
            {"role": "user", "content": [text_block("And the first?")]},
        ],
        max_new_tokens=5,
    )
    assert prompt.tolist() == reference_prompt.tolist()
    assert generated == reference_generated.tolist()
    assert out["response"] == engine.tokenizer.decode(reference_generated, skip_special_tokens=True).strip()


def test_system_prompt_reaches_the_model(engine):
    user = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": data_uri(striped())}, text_block("Describe.")],
    }
    plain_chat = ask({"messages": [user], "max_new_tokens": 1})
    with_system = ask(
        {"messages": [{"role": "system", "content": "A long system prompt " * 5}, user], "max_new_tokens": 1}
    )
    assert with_system["usage"]["prompt_tokens"] > plain_chat["usage"]["prompt_tokens"]


# ---- batches ------------------------------------------------------------------------------------


def batch_items():
    return [
        {"task": "vqa", "image_url": data_uri(striped()), "question": "What is it?", "max_new_tokens": 4},
        {"task": "caption", "image_b64": "this is not base64!"},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": data_uri(plain("red", (84, 56)))},
                        {"type": "image_url", "image_url": data_uri(striped((56, 84)))},
                        text_block("Compare them."),
                    ],
                },
                {"role": "assistant", "content": "They differ."},
                {"role": "user", "content": "How?"},
            ],
            "max_new_tokens": 6,
        },
        {"task": "caption_long", "image_url": data_uri(plain("blue", (70, 56))), "max_new_tokens": 5},
        {"task": "grounding", "image_url": data_uri(striped()), "target": "a stripe", "max_new_tokens": 3},
    ]


def test_batch_answers_in_order_and_isolates_a_bad_item(engine):
    out = ask({"requests": batch_items()}, job_id="batch-7")
    assert out["id"] == "batch-7" and out["count"] == 5
    results = out["results"]
    assert "error" in results[1] and results[1]["param"] == "requests[1].image_b64"
    assert [r.get("task") for r in results] == ["vqa", None, "chat", "caption_long", "grounding"]
    assert [r.get("image_count") for r in results] == [1, None, 2, 1, 1]


def test_prompt_plus_max_new_tokens_beyond_the_context_is_refused_alone(family, tiny_model, serve, monkeypatch):
    engine = serve(tiny_model(family), VLM_MAX_NEW_TOKENS="1000000")
    context = engine.model.config.get_text_config(decoder=True).max_position_embeddings
    good = {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 3}
    too_long = dict(good, max_new_tokens=context)
    alone = ask(too_long)
    assert alone["code"] == "context_too_long" and alone["param"] == "max_new_tokens"
    assert str(context) in alone["error"]
    prefills = []  # the prompt rows of each forward pass that reads a prompt
    real_forward = engine.model.forward

    def recording_forward(*args, **kwargs):
        input_ids = kwargs.get("input_ids")
        if input_ids is not None and input_ids.shape[1] > 1:
            prefills.append(input_ids.shape[0])
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", recording_forward)
    first, second = ask({"requests": [good, too_long]})["results"]
    assert second["code"] == "context_too_long" and second["param"] == "requests[1].max_new_tokens"
    assert sum(prefills) == 1  # only the good item's prompt reached the model, and only once
    assert first == ask(good)  # its neighbour's refusal changes nothing in its answer


def test_a_grounding_target_counts_toward_the_text_limit(engine):
    answer = ask({"task": "grounding", "image_url": data_uri(striped()), "target": "x" * 40_000})
    assert answer["code"] == "text_too_long" and "32000" in answer["error"]


def test_each_batch_item_equals_its_solo_run(engine):
    items = batch_items()
    batched = ask({"requests": items})["results"]
    for index, item in enumerate(items):
        if index == 1:
            continue
        assert batched[index] == ask(item), f"requests[{index}]"


def test_batch_mixing_text_only_and_image_items_equals_solo_runs(engine):
    items = [
        {"messages": [{"role": "user", "content": "No image here."}], "max_new_tokens": 3},
        {"task": "vqa", "image_url": data_uri(striped()), "question": "And here?", "max_new_tokens": 3},
    ]
    batched = ask({"requests": items})["results"]
    assert batched == [ask(item) for item in items]


# ---- finish reasons -----------------------------------------------------------------------------


def test_finish_reason_is_length_when_max_new_tokens_is_hit(engine):
    out = ask({"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 2})
    assert out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 2


def test_finish_reason_is_stop_when_the_model_ends(family, tiny_model, serve):
    serve(tiny_model(family, eos_bias=True))
    at_once = ask({"task": "vqa", "image_url": data_uri(striped()), "question": "Hi?", "max_new_tokens": 8})
    assert at_once["finish_reason"] == "stop"
    assert at_once["response"] == "" and at_once["usage"]["completion_tokens"] == 0
    held = ask(
        {"task": "vqa", "image_url": data_uri(striped()), "question": "Hi?", "max_new_tokens": 8, "min_new_tokens": 2}
    )
    assert held["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.7}], ids=["greedy", "sampled"])
def test_batch_items_keep_their_own_min_new_tokens(family, tiny_model, serve, sampling):
    serve(tiny_model(family, eos_bias=True))
    items = [
        {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 8, **sampling},
        {"task": "caption", "image_url": data_uri(plain("red")), "max_new_tokens": 8, "min_new_tokens": 3, **sampling},
    ]
    batched = ask({"requests": items})["results"]
    assert [r["usage"]["completion_tokens"] for r in batched] == [0, 3]
    assert [r["finish_reason"] for r in batched] == ["stop", "stop"]
    if not sampling:
        assert batched == [ask(item) for item in items]


# ---- grounding boxes through the real decoding path ---------------------------------------------


@pytest.fixture
def scripted_answer(engine, monkeypatch):
    """Make the model answer `text` then its end token, by overriding the logits of each forward
    pass; tokenizing, decoding and box parsing stay the worker's own."""

    def script(text: str):
        answer = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        answer.append(min(engine.eos_ids))
        real_forward = engine.model.forward
        step = iter(range(10**6))

        def scripted_forward(*args, **kwargs):
            output = real_forward(*args, **kwargs)
            token = answer[min(next(step), len(answer) - 1)]
            logits = torch.full_like(output.logits, -1e4)
            logits[..., token] = 1e4
            output.logits = logits
            return output

        monkeypatch.setattr(engine.model, "forward", scripted_forward)

    return script


def test_grounding_box_is_scaled_to_original_pixels(engine, family, scripted_answer):
    if family not in GROUNDING_FAMILIES:
        pytest.skip(f"{family} has no grounding output")
    picture = striped((100, 50))
    if family == "qwen2-vl":  # boxes relative to 1000
        scripted_answer("<|object_ref_start|>a stripe<|object_ref_end|><|box_start|>(100,200),(500,800)<|box_end|>")
        expected = [10, 10, 50, 40]
    else:  # absolute pixels of the resized input: 100x50 becomes 112x56 (multiples of 28)
        scripted_answer('```json\n[{"bbox_2d": [56, 28, 112, 56], "label": "a stripe"}]\n```')
        expected = [50, 25, 100, 50]
    out = ask({"task": "grounding", "image_url": data_uri(picture), "target": "a stripe"})
    assert "error" not in out, out
    assert out["finish_reason"] == "stop"
    assert out["bbox"] == expected


# ---- quantization -------------------------------------------------------------------------------


def module_prefix_exists(names: set[str], prefix: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for name in names)


@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_quantization_skips_name_real_modules(engine, mode):
    from transformers import BitsAndBytesConfig

    config = quantization_config(mode, engine.adapter, torch.bfloat16)
    assert isinstance(config, BitsAndBytesConfig)
    names = {name for name, _ in engine.model.named_modules()}
    skips = config.llm_int8_skip_modules
    assert "lm_head" in skips
    assert all(module_prefix_exists(names, skip) for skip in skips), (skips, sorted(names)[:20])
    vision = [n for n in names if "visual" in n or "vision_tower" in n or "multi_modal_projector" in n]
    assert vision and all(any(n == s or n.startswith(s + ".") for s in skips) for n in vision)
    assert BitsAndBytesConfig.from_dict(config.to_dict()).llm_int8_skip_modules == skips


def test_4bit_load_quantizes_only_the_language_model(family, tiny_model, serve):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    engine = serve(tiny_model(family), VLM_QUANTIZE="4bit")
    kinds = {name: type(module).__name__ for name, module in engine.model.named_modules()}
    quantized = {name for name, kind in kinds.items() if kind == "Linear4bit"}
    assert quantized and all(".language_model." in name for name in quantized)
    assert kinds["lm_head"] == "Linear"
    out = ask({"task": "vqa", "image_url": data_uri(striped()), "question": "What?", "max_new_tokens": 2})
    assert "error" not in out, out
    assert out["usage"]["completion_tokens"] == 2


def test_concurrent_jobs_each_get_their_solo_tokens(family, tiny_model, serve):
    """Separate jobs of different lengths and images run at once through few rows and a short
    cache: they join and leave the running batch, wait for rows, and shift the cache, and each
    answer is exactly its solo run's."""
    serve(tiny_model(family), VLM_MAX_BATCH_SIZE="3", VLM_KV_CACHE_TOKENS="512", VLM_SYNC_INTERVAL="3")
    jobs = [
        {
            "task": "vqa",
            "image_url": data_uri(striped((48 + 8 * n, 40))),
            "question": f"What is {n}?",
            "max_new_tokens": 4 + 5 * n,
            "min_new_tokens": 4 + 3 * n,
        }
        for n in range(5)
    ] + [{"messages": [{"role": "user", "content": "No image, just text."}], "max_new_tokens": 20}]
    solo = [ask(job) for job in jobs]

    async def together():
        return await asyncio.gather(
            *(handler.local_test_answer({"id": str(n), "input": job}) for n, job in enumerate(jobs))
        )

    assert asyncio.run(together()) == solo
    streamed = asyncio.run(handler.local_test_answer({"input": dict(jobs[4], stream=True)}))
    assert "".join(chunk["text"] for chunk in streamed) == solo[4]["response"]


def test_a_cancelled_job_frees_its_row_for_the_next(tiny_model, serve, monkeypatch):
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_SIZE="1", VLM_SYNC_INTERVAL="2")
    long_job = {"messages": [{"role": "user", "content": "Talk."}], "max_new_tokens": 200, "min_new_tokens": 200}
    short_job = {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 3}

    async def cancel_one_then_ask_another():
        settings, model_id = handler.served_model()
        _, item = handler.read_job_item(long_job, settings, model_id, None)
        stream = stream_generation(engine, item)
        first = await anext(stream)  # the long item holds the only row
        await stream.aclose()  # as when RunPod cancels the job's task
        return first, await handler.generate_one(engine, handler.read_job_item(short_job, settings, model_id, None)[1])

    steps = []
    real_launch = engine.start_decoder().launch
    monkeypatch.setattr(engine.start_decoder(), "launch", lambda n: steps.append(n) or real_launch(n))
    first, short = asyncio.run(cancel_one_then_ask_another())
    assert isinstance(first, StreamDelta)
    assert short.completion_tokens == 3 and short.finish_reason == "length"
    assert sum(steps) < 20  # the short job did not wait for the long one's 200 tokens


def test_a_cancelled_batch_job_gives_up_its_rows_at_the_next_step(tiny_model, serve):
    """RunPod cancels a job's asyncio task; a `{"requests": [...]}` job's items decode on a thread the task waits for,
    and its rows stop as a single job's do (read through the engine's public view)."""
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_NEW_TOKENS="4000", VLM_SYNC_INTERVAL="2")
    talk = {"messages": [{"role": "user", "content": "Talk."}], "max_new_tokens": 4000, "min_new_tokens": 4000}

    async def cancel_while_decoding():
        job = asyncio.create_task(handler.local_test_answer({"id": "batch", "input": {"requests": [talk] * 4}}))
        deadline = time.monotonic() + 60
        while engine.view().running < 4:
            assert time.monotonic() < deadline and not job.done()
            await asyncio.sleep(0.01)
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job
        cancelled_at = engine.view().timings.get("decode_steps", 0)
        while engine.view().running:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return engine.view().timings.get("decode_steps", 0) - cancelled_at

    steps_after = asyncio.run(cancel_while_decoding())
    assert steps_after < 40, steps_after  # not the 4,000 tokens the rows had left
    view = engine.view()
    assert view.queued == 0 and view.kv_blocks_free == view.kv_blocks, view


def test_an_item_whose_caller_is_gone_is_dropped_and_its_neighbours_answered(tiny_model, serve):
    # A listener that raises (its job's event loop closed) failed the whole step, and raising again while the
    # engine failed the step's items, it ended the engine thread: every later job waited for ever.
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_SIZE="4", VLM_SYNC_INTERVAL="2")
    settings, model_id = handler.served_model()
    items = [
        handler.read_job_item(
            {"messages": [{"role": "user", "content": f"Say {n}."}], "max_new_tokens": 6, "min_new_tokens": 6},
            settings,
            model_id,
            None,
        )[1]
        for n in range(3)
    ]
    alone = generate_all(engine, items)
    answered, results = threading.Semaphore(0), {}

    def gone(event):
        raise RuntimeError("Event loop is closed")

    def keep(index, event):
        if not isinstance(event, StreamDelta):
            results[index] = event
            answered.release()

    tickets = engine.submit_all(items, [gone, functools.partial(keep, 1), functools.partial(keep, 2)], stream=True)
    assert answered.acquire(timeout=60) and answered.acquire(timeout=60)
    assert [results[1], results[2]] == alone[1:] and tickets[0].cancelled
    assert generate_all(engine, items[:1]) == alone[:1]  # the engine serves on


def test_a_decoder_that_cannot_be_built_fails_the_waiting_job_instead_of_looping(tiny_model, serve, monkeypatch):
    # Building the decoder (at the first job) raised before any item had a row: the engine once failed "the items in
    # flight", none, and tried again at once, for as long as the failure lasted, the job waiting.
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="2")
    job = {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 3}
    alone = ask(job)
    real_new_decoder, attempts, failing = engine.new_decoder, [], [True]

    def new_decoder():
        attempts.append(1)
        if failing:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_new_decoder()

    monkeypatch.setattr(engine, "new_decoder", new_decoder)
    engine.decoder = None
    answered, results = threading.Event(), []
    engine.submit(
        handler.read_job_item(job, *handler.served_model(), None)[1],
        lambda event: results.append(event) or answered.set(),
    )
    try:
        assert answered.wait(30) and results[0].code == "generation_failed" and len(attempts) == 1
    finally:
        failing.clear()
    assert ask(job) == alone  # the next job builds the decoder and is answered


def failing_prefills(engine, monkeypatch, error, when):
    """Make the model raise `error` (a real torch exception) on prompt passes of `when(rows)`."""
    real_forward = engine.model.forward
    prefill_rows = []

    @functools.wraps(real_forward)
    def forward(*args, **kwargs):
        input_ids = kwargs.get("input_ids")
        if input_ids is not None and input_ids.shape[1] > 1:
            prefill_rows.append(input_ids.shape[0])
            if when(input_ids.shape[0]):
                raise error
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward)
    return prefill_rows


def test_a_prefill_out_of_memory_is_retried_in_halves(tiny_model, serve, monkeypatch):
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_SIZE="4")
    items = [
        {"task": "vqa", "image_url": data_uri(striped()), "question": f"Item {n}?", "max_new_tokens": 3}
        for n in range(4)
    ]
    solo = [ask(item) for item in items]
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    prefill_rows = failing_prefills(engine, monkeypatch, oom, lambda rows: rows > 2)
    assert ask({"requests": items})["results"] == solo
    assert prefill_rows == [4, 2, 2]  # the whole batch, then its halves
    failing_prefills(engine, monkeypatch, oom, lambda rows: True)
    out = ask(items[0])
    assert out["code"] == "out_of_memory" and out["param"] is None and "prompt tokens" in out["error"]
    monkeypatch.undo()
    assert ask(items[0]) == solo[0]  # memory released, the worker goes on


def test_a_fatal_cuda_error_fails_requests_and_asks_for_a_new_worker(tiny_model, serve, monkeypatch):
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_SIZE="2")
    monkeypatch.setattr(handler, "_RUNPOD_CONFIG", {})
    fatal = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    failing_prefills(engine, monkeypatch, fatal, lambda rows: True)
    out = ask({"messages": [{"role": "user", "content": "Hello?"}], "max_new_tokens": 3})
    assert out["code"] == "gpu_failure" and handler._RUNPOD_CONFIG["refresh_worker"] is True
    assert ask({"messages": [{"role": "user", "content": "Again?"}]})["code"] == "gpu_failure"


def test_a_batch_too_long_for_the_pool_together_is_answered_as_each_alone(tiny_model, serve):
    # A 320-token pool: each item fits alone, the two together do not; one waits or is preempted, never failed.
    engine = serve(tiny_model("qwen2-vl"), VLM_KV_CACHE_TOKENS="320", VLM_MAX_NEW_TOKENS="400")
    items = [
        {
            "task": "vqa",
            "image_url": data_uri(striped((336, 336))),
            "question": "Long prompt?",
            "max_new_tokens": 20,
            "min_new_tokens": 20,
        },
        {"messages": [{"role": "user", "content": "Short."}], "max_new_tokens": 200, "min_new_tokens": 200},
    ]
    solo = [ask(item) for item in items]
    assert solo[0]["usage"]["prompt_tokens"] + 20 + solo[1]["usage"]["prompt_tokens"] + 200 > 320
    assert ask({"requests": items})["results"] == solo
    assert engine.start_decoder().pool.free == engine.start_decoder().pool.capacity


@pytest.mark.parametrize("cached", ["false", "true"])  # a whole prefill, or the rest of a cached prefix's
def test_a_prefill_cut_off_midway_by_a_torch_fx_trace_runs_again_from_an_empty_cache(
    cached, tiny_model, serve, monkeypatch
):
    # A trace that starts while a prompt is halfway through the model cuts it off after some layers stored their
    # keys; run again into the same cache, those layers held the prompt twice and the job failed.
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="2", VLM_PREFIX_CACHING=cached)
    job = {"task": "vqa", "image_url": data_uri(striped((48, 40))), "question": "What is it?", "max_new_tokens": 6}
    alone = ask(job)
    second_layer = engine.model.get_decoder().layers[1]
    real_forward, cut = second_layer.forward, []

    def cut_off_once(hidden_states, *args, **kwargs):
        if hidden_states.shape[1] > 1 and not cut:
            cut.append(True)
            raise NameError("module is not installed as a submodule")
        return real_forward(hidden_states, *args, **kwargs)

    monkeypatch.setattr(second_layer, "forward", cut_off_once)
    assert ask(job) == alone and cut


def test_a_decode_step_cut_off_midway_by_a_torch_fx_trace_runs_again_at_the_same_slot(tiny_model, serve, monkeypatch):
    # With the static cache each layer counted its own writes: run again after being cut off, the layers before the
    # cut wrote one slot further on (the CPU background-compile test failed about one run in five). A paged step
    # writes the slots of its row lengths, moved only once the step has run.
    engine = serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="4", VLM_COMPILE="false")
    job = {
        "task": "vqa",
        "image_url": data_uri(striped((48, 40))),
        "question": "What is it?",
        "max_new_tokens": 12,
        "min_new_tokens": 12,
    }
    alone = ask(job)
    second_layer = engine.model.get_decoder().layers[1]
    real_forward, steps = second_layer.forward, []

    def cut_off_at_the_second_step(hidden_states, *args, **kwargs):  # midway through an interval of 4
        if hidden_states.shape[1] == 1:
            steps.append(True)
            if len(steps) == 2:
                raise NameError("module is not installed as a submodule")
        return real_forward(hidden_states, *args, **kwargs)

    monkeypatch.setattr(second_layer, "forward", cut_off_at_the_second_step)
    assert ask(job) == alone and len(steps) > 3


@pytest.mark.parametrize("cached", ["false", "true"])
def test_a_job_sent_while_another_thread_traces_with_torch_fx_is_answered_as_without(cached, tiny_model, serve):
    # On the H200 a cold worker's step failed with all its jobs: inductor, compiling in the background, traced
    # with torch.fx, which patches nn.Module.__call__ for the whole process while it traces. A real trace is
    # held open here in another thread while the job runs.
    serve(tiny_model("qwen2-vl"), VLM_SYNC_INTERVAL="2", VLM_PREFIX_CACHING=cached)
    job = {"task": "vqa", "image_url": data_uri(striped((48, 40))), "question": "What is it?", "max_new_tokens": 6}
    alone = ask(job)
    tracing, release = threading.Event(), threading.Event()

    def held_open(x):
        tracing.set()
        release.wait(30)
        return x

    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(held_open,))
    tracer.start()
    assert tracing.wait(30) and torch.nn.Module.__call__ is not torch.nn.Module._wrapped_call_impl
    threading.Timer(2, release.set).start()  # the job reaches the model well within this
    try:
        assert ask(job) == alone
    finally:
        release.set()
        tracer.join()
