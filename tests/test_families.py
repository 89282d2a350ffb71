"""Every native family answers as its model card does: the worker's prompt ids and greedy tokens
equal the card's recipe (processor.apply_chat_template with the images inside the messages, then
model.generate with do_sample=False), for a request sent alone and for two different requests
batched. Tiny random-weight models built offline (tools/tiny_models.py), CPU."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import safetensors.torch
import torch

import handler
from runpod_vlm.families import FAMILIES, adapter_for
from runpod_vlm.settings import CURATED_MODELS
from tools.sample_images import data_uri, plain, striped

# Families whose processor has a chat template (PaliGemma, prompted by task prefixes, is below).
CHAT_FAMILIES = ["qwen3-vl", "gemma3", "llava-onevision", "smolvlm", "internvl-hf", "mistral3", "llama4", "glm4v"]
NEW_TOKENS = 5


def ask(payload: dict) -> dict:
    job = {"id": "job-1", "input": payload}
    return asyncio.run(handler.local_test_answer(job))


@pytest.fixture(scope="module", params=CHAT_FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def engine(family, tiny_model, serve):
    return serve(tiny_model(family))


@pytest.fixture
def forward_calls(engine, forward_calls_of):
    return forward_calls_of(engine)


def check_batch_against_card(engine, requests: list[dict], cards: list[tuple[list[int], list[int]]]) -> None:
    """Two or more requests in one call: each row of the adapter's batch inputs (what the engine
    prefills) has the prompt ids of the card's recipe for that request alone, and each answer is
    the card's greedy answer (text and token counts)."""
    items = [handler.read_job_item(request, engine.settings, engine.model_id)[1] for request in requests]
    inputs, _ = engine.adapter.batch_inputs(engine.processor, items, engine.model.device, engine.dtype)
    for row, (prompt, _) in enumerate(cards):
        ids, mask = inputs["input_ids"][row], inputs["attention_mask"][row]
        assert ids[mask.bool()].tolist() == prompt, f"row {row}"
    out = ask({"requests": requests})
    for index, (result, (prompt, generated)) in enumerate(zip(out["results"], cards)):
        assert "error" not in result, result
        kept = generated[: next((k for k, t in enumerate(generated) if t in engine.eos_ids), len(generated))]
        assert result["response"] == engine.tokenizer.decode(kept, skip_special_tokens=True).strip(), index
        assert result["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(kept)}, index


def worker_rows(calls, rows: int) -> list[tuple[list[int], list[int]]]:
    """Per batch row: the prompt ids (padding removed) and the greedy tokens (`forward_calls_of`)."""
    first = calls.prompts[0]
    result = []
    for row in range(rows):
        ids, mask = first["input_ids"][row], first["attention_mask"][row]
        prompt = ids[mask[-len(ids) :].bool()].tolist()
        result.append((prompt, [int(choice[row]) for choice in calls.choices][:NEW_TOKENS]))
    return result


@functools.cache
def reference_model(folder: str):
    """The model through its family's auto class (AutoModelForImageTextToText but for Phi-4-multimodal), with
    Phi-4-multimodal's `vision-lora` adapter loaded and set when the folder has one, as its card does."""
    import transformers

    model_class = adapter_for(transformers.AutoConfig.from_pretrained(folder).model_type).model_class
    model = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32).eval()
    if (Path(folder) / "vision-lora").is_dir():
        # The card passes the repo id with adapter_kwargs={"subfolder": "vision-lora"}; for a local folder,
        # transformers 5.17 ignores that subfolder (it looks for adapter_config.json at the top): name the folder.
        model.load_adapter(str(Path(folder) / "vision-lora"), adapter_name="vision")
        model.set_adapter("vision")
    return model, transformers.AutoProcessor.from_pretrained(folder)


def card_recipe(folder, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The model card: one apply_chat_template call with the images in the messages, then greedy."""
    model, processor = reference_model(str(folder))
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)  # the cards' .to(model.dtype)
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    prompt = inputs["input_ids"][0]
    return prompt.tolist(), output[0, len(prompt) :].tolist()


def text(value: str) -> dict:
    return {"type": "text", "text": value}


FIRST, SECOND, THIRD = striped((100, 50)), plain("green", (40, 60)), striped((64, 64))
# Two different requests: a system prompt and two images in one turn; a single-image question.
TWO_IMAGES = (
    {
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": data_uri(FIRST)},
                    text("Which is green?"),
                    {"type": "image_url", "image_url": data_uri(SECOND)},
                ],
            },
        ],
        "max_new_tokens": NEW_TOKENS,
    },
    [
        {"role": "system", "content": [text("Answer in one word.")]},
        {
            "role": "user",
            "content": [{"type": "image", "image": FIRST}, text("Which is green?"), {"type": "image", "image": SECOND}],
        },
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


def test_two_different_requests_batched_match_the_card(engine, tiny_model, family):
    check_batch_against_card(
        engine,
        [TWO_IMAGES[0], ONE_IMAGE[0]],
        [card_recipe(tiny_model(family), messages) for _, messages in [TWO_IMAGES, ONE_IMAGE]],
    )


# ---- PaliGemma: task prefixes instead of a chat template ----------------------------------------


@pytest.fixture
def paligemma(tiny_model, serve):
    return serve(tiny_model("paligemma"))


def paligemma_card(folder, prefix: str, image) -> tuple[list[int], list[int]]:
    """google/paligemma2-*-mix's card: processor(text=prefix, images=image) then greedy."""
    model, processor = reference_model(str(folder))
    inputs = processor(text=prefix, images=image, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    prompt = inputs["input_ids"][0]
    return prompt.tolist(), output[0, len(prompt) :].tolist()


PALIGEMMA_REQUESTS = [
    ({"task": "caption", "image_url": data_uri(FIRST)}, "caption en", FIRST),
    ({"task": "vqa", "image_url": data_uri(THIRD), "question": "What is shown?"}, "answer en What is shown?", THIRD),
    ({"task": "grounding", "image_url": data_uri(SECOND), "target": "the square"}, "detect the square", SECOND),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": data_uri(THIRD)}, text("ocr")]}]},
        "ocr",
        THIRD,
    ),
]


def test_paligemma_prompts_are_the_cards_task_prefixes_alone_and_batched(paligemma, tiny_model, forward_calls_of):
    for request, prefix, image in PALIGEMMA_REQUESTS[:2]:
        calls = forward_calls_of(paligemma)
        out = ask({**request, "max_new_tokens": NEW_TOKENS})
        assert "error" not in out, out
        assert worker_rows(calls, 1) == [paligemma_card(tiny_model("paligemma"), prefix, image)]
    check_batch_against_card(
        paligemma,
        [{**request, "max_new_tokens": NEW_TOKENS} for request, _, _ in PALIGEMMA_REQUESTS],
        [paligemma_card(tiny_model("paligemma"), prefix, image) for _, prefix, image in PALIGEMMA_REQUESTS],
    )


def test_paligemma_text_only_reads_a_black_image(paligemma, tiny_model):
    from PIL import Image

    check_batch_against_card(
        paligemma,
        [
            {"messages": [{"role": "user", "content": "caption en"}], "max_new_tokens": NEW_TOKENS},
            {**PALIGEMMA_REQUESTS[0][0], "max_new_tokens": NEW_TOKENS},
        ],
        [
            paligemma_card(tiny_model("paligemma"), "caption en", Image.new("RGB", (1, 1))),
            paligemma_card(tiny_model("paligemma"), "caption en", FIRST),
        ],
    )


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [text("caption en")]}],
        [
            {"role": "user", "content": [text("caption en")]},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": [text("answer en why?")]},
        ],
        [{"role": "user", "content": [{"type": "image_url", "image_url": data_uri(SECOND)}, text("caption en")]}],
    ],
)
def test_paligemma_refuses_what_its_card_cannot_express(paligemma, messages):
    messages[-1]["content"].insert(0, {"type": "image_url", "image_url": data_uri(FIRST)})
    out = ask(
        {"requests": [{"messages": messages}, {"task": "caption", "image_url": data_uri(FIRST), "max_new_tokens": 2}]}
    )
    refused, answered = out["results"]
    assert refused["code"] == "invalid_request" and refused["param"] == "requests[0].messages", refused
    assert "error" not in answered  # its neighbour still answers


# ---- grounding on the new families --------------------------------------------------------------


def script_answer(engine, monkeypatch, answer_text: str) -> None:
    """Make the model answer `answer_text` then its end token; decoding and parsing stay the worker's."""
    answer = engine.tokenizer(answer_text, add_special_tokens=False)["input_ids"] + [min(engine.eos_ids)]
    real_forward = engine.model.forward
    step = iter(range(10**6))

    @functools.wraps(real_forward)  # generate() reads the forward's signature
    def scripted_forward(*args, **kwargs):
        output = real_forward(*args, **kwargs)
        logits = torch.full_like(output.logits, -1e4)
        logits[..., answer[min(next(step), len(answer) - 1)]] = 1e4
        output.logits = logits
        return output

    monkeypatch.setattr(engine.model, "forward", scripted_forward)


@pytest.mark.parametrize(
    "family, answer, box_format, labels",
    [
        (
            "qwen3-vl",
            '```json\n[{"bbox_2d": [100, 200, 500, 800], "label": "stripe"},\n'
            ' {"bbox_2d": [0, 0, 1000, 1000], "label": "all"}]\n```',
            "qwen-1000",
            ["stripe", "all"],
        ),
        (
            "paligemma",
            "<loc0205><loc0102><loc0819><loc0512> stripe ; <loc0000><loc0000><loc1024><loc1024> all",
            "paligemma-1024",
            ["stripe", "all"],
        ),
        # GLM-4.1V thinks first; only the boxes of its answer count
        (
            "glm4v",
            "<think>Maybe [1, 2, 3, 4].</think><answer><|begin_of_box|>[[100, 200, 500, 800], [0, 0, 1000, 1000]]"
            "<|end_of_box|></answer>",
            "glm-1000",
            [None, None],
        ),
    ],
)
def test_grounding_returns_every_box_in_image_pixels(
    family, answer, box_format, labels, tiny_model, serve, monkeypatch
):
    engine = serve(tiny_model(family))
    script_answer(engine, monkeypatch, answer)
    out = ask({"task": "grounding", "image_url": data_uri(striped((100, 50))), "target": "a stripe", "annotate": True})
    assert "error" not in out, out
    assert out["boxes"] == [
        {"bbox": [10, 10, 50, 40], "label": labels[0]},
        {"bbox": [0, 0, 100, 50], "label": labels[1]},
    ]
    assert out["bbox"] == [10, 10, 50, 40] and out["box_format"] == box_format and out["image_size"] == [100, 50]
    assert out["annotated_image"].startswith("data:image/png;base64,")


def test_qwen3_vl_takes_the_pixel_limits(tiny_model, serve):
    engine = serve(tiny_model("qwen3-vl"), VLM_MAX_PIXELS=str(64 * 64))
    inputs, sizes = engine.adapter.batch_inputs(
        engine.processor,
        [handler.read_job_item(ONE_IMAGE[0], engine.settings, engine.model_id)[1]],
        "cpu",
        torch.float32,
    )
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]  # 64x64 at most: 4x4 patches of 16
    assert sizes == [(64, 64)]


# ---- quantization keeps the vision side in full precision --------------------------------------

VISION_WORDS = ("vision", "visual", "projector", "connector", "resampler", "merger", "patch_embed")


@pytest.mark.parametrize(
    "family",
    [
        "qwen2-vl",
        "qwen2.5-vl",
        "llava",
        "llava-next",
        "qwen3-vl",
        "gemma3",
        "llava-onevision",
        "paligemma",
        "smolvlm",
        "internvl-hf",
        "mistral3",
        "llama4",
        "glm4v",
    ],
)
def test_quantization_skips_cover_the_vision_side_of_real_module_trees(family, tiny_model):
    model, _ = reference_model(str(tiny_model(family)))
    adapter = adapter_for(model.config.model_type)
    skips = adapter.quantization_skip_modules
    modules = dict(model.named_modules())
    assert all(name in modules for name in skips), skips
    assert modules[skips[-1]] is model.get_output_embeddings()  # the head stays in full precision

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(f"{s}.") for s in skips)

    parameters = [name for name, _ in model.named_parameters()]
    vision = [name for name in parameters if any(word in name for word in VISION_WORDS)]
    language = [
        name
        for name in parameters
        if ("language_model" in name or "text_model" in name) and not name.startswith(f"{skips[-1]}.")
    ]
    assert vision and all(skipped(name) for name in vision)
    assert language and not any(skipped(name) for name in language)


def test_the_generic_adapter_finds_vision_modules_of_any_native_type():
    assert adapter_for("mistral3").quantization_skip_modules == (
        "model.vision_tower",
        "model.multi_modal_projector",
        "lm_head",
    )
    assert adapter_for("glm4v").quantization_skip_modules == ("model.visual", "lm_head")
    assert adapter_for("llama4").quantization_skip_modules == (
        "vision_model",
        "multi_modal_projector",
        "language_model.lm_head",
    )


# ---- remote-code families, against fakes that follow each repository's documented code ----------
# Their real code needs transformers 4.45-4.48 (see README); these fakes mimic what the worker
# relies on: MiniCPM-V-2_6's chat() defaults and inner `llm.generate`, InternVL2's chat() and inner
# `language_model.generate`, Phi-3-vision's loading, each with the eos and ids their code passes.

EOS, END, PAD = 2, 3, 0


class FakeTokenizer:
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(96 + i) for i in ids if not (skip_special_tokens and i in (EOS, END, PAD)))

    def __call__(self, text, add_special_tokens=False):  # re-tokenises decoded text (the old way)
        return {"input_ids": [ord(c) - 96 for c in text]}


class FakeRemoteModel:
    """Loaded through the worker's own path; `answer` is the ids the inner generate() produces."""

    dtype, device = torch.float32, torch.device("cpu")

    def __init__(self, answer: list[int], prompt_tokens: int = 7):
        self.answer, self.prompt_tokens = answer, prompt_tokens
        self.config = type(
            "Config", (), {"get_text_config": lambda self, decoder=True: self, "max_position_embeddings": 4096}
        )()
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": EOS})()
        self.generate_calls: list[dict] = []

    def eval(self):
        return self

    def inner_generate(self, **kwargs):
        self.generate_calls.append(kwargs)
        answer = self.answer[: kwargs["max_new_tokens"]]
        return torch.tensor([answer])  # inputs_embeds in: only the new tokens come back


class FakeMiniCPMV(FakeRemoteModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.llm = type("LLM", (), {"generate": lambda llm, **kw: self.inner_generate(**kw)})()
        self.chat_calls: list[dict] = []

    def chat(
        self, image, msgs, tokenizer, max_new_tokens=2048, min_new_tokens=0, sampling=True, system_prompt="", **kwargs
    ):
        self.chat_calls.append(dict(msgs=msgs, sampling=sampling, system_prompt=system_prompt, kwargs=kwargs))
        for i, msg in enumerate(msgs):  # modeling_minicpmv.py's checks
            assert msg["role"] in ["user", "assistant"]
            if i == 0:
                assert msg["role"] == "user", "The role of first msg should be user"
        if sampling:
            generation_config = {
                "top_p": 0.8,
                "top_k": 100,
                "temperature": 0.7,
                "do_sample": True,
                "repetition_penalty": 1.05,
            }
        else:
            generation_config = {"num_beams": 3, "repetition_penalty": 1.2}
        generation_config.update((k, kwargs[k]) for k in generation_config.keys() & kwargs.keys())
        output = self.llm.generate(
            inputs_embeds=torch.zeros(1, self.prompt_tokens, 4),
            pad_token_id=0,
            eos_token_id=[END, EOS],
            max_new_tokens=max_new_tokens,
            **generation_config,
        )
        return tokenizer.decode(output[0], skip_special_tokens=True)


class FakeInternVL2(FakeRemoteModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.language_model = type("LanguageModel", (), {"generate": lambda lm, **kw: self.inner_generate(**kw)})()
        self.chat_calls: list[dict] = []

    system_message = "the model's default system message"

    def chat(
        self,
        tokenizer,
        pixel_values,
        question,
        generation_config,
        history=None,
        return_history=False,
        num_patches_list=None,
        **kwargs,
    ):
        self.chat_calls.append(
            dict(
                question=question,
                history=history,
                generation_config=generation_config,
                system_message=self.system_message,
            )
        )  # template.system_message
        generation_config["eos_token_id"] = END  # template.sep, <|im_end|>
        output = self.language_model.generate(inputs_embeds=torch.zeros(1, self.prompt_tokens, 4), **generation_config)
        # the card's chat: decode without special tokens, then cut at the separator
        return tokenizer.decode(output[0], skip_special_tokens=True)


@pytest.fixture
def serve_remote(serve, monkeypatch):
    """`serve_remote(model_type, model)`: the worker loads `model` through its own loading path."""
    import transformers

    def start(model_type: str, model, on_load=None, processor=None, **env):
        loads = []

        def load_model(path, **kwargs):
            loads.append(kwargs)
            if on_load:
                on_load()
            return model

        config = type("Config", (), {"model_type": model_type})()
        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda path, **kw: config)
        for auto in ("AutoModel", "AutoModelForCausalLM"):
            monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", load_model)
        for auto in ("AutoTokenizer", "AutoProcessor"):
            monkeypatch.setattr(
                getattr(transformers, auto), "from_pretrained", lambda path, **kw: processor or FakeTokenizer()
            )
        engine = serve(Path(f"/remote/{model_type}"), VLM_MAX_BATCH_SIZE="4", **env)
        return engine, loads

    return start


def chat_request(**extra):
    return {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image_url", "image_url": data_uri(FIRST)}, text("What is it?")]},
        ],
        **extra,
    }


def test_minicpm_v_greedy_is_greedy_and_sampling_is_temperature_and_top_p(serve_remote):
    model = FakeMiniCPMV(answer=[5, 6, 7, EOS])
    serve_remote("minicpmv", model)
    out = ask(chat_request(max_new_tokens=10))
    assert out["response"] == "efg"
    greedy = model.generate_calls[-1]
    assert greedy["num_beams"] == 1 and greedy["repetition_penalty"] == 1.0 and "do_sample" not in greedy
    assert model.chat_calls[-1]["sampling"] is False and model.chat_calls[-1]["system_prompt"] == "Be brief."
    ask(chat_request(max_new_tokens=10, do_sample=True, temperature=0.4, top_p=0.9))
    sampled = model.generate_calls[-1]
    assert sampled["do_sample"] is True and sampled["temperature"] == 0.4 and sampled["top_p"] == 0.9
    assert sampled["top_k"] == 0 and sampled["repetition_penalty"] == 1.0  # not chat()'s 100 and 1.05


@pytest.mark.parametrize("model_type, fake", [("minicpmv", FakeMiniCPMV), ("internvl_chat", FakeInternVL2)])
def test_remote_usage_and_finish_reason_come_from_the_generated_ids(serve_remote, model_type, fake):
    # the limit is hit by ids whose decoded text re-tokenises shorter (END and PAD are skipped)
    model = fake(answer=[5, END, 6, PAD, 7], prompt_tokens=11)
    serve_remote(model_type, model)
    out = ask(chat_request(max_new_tokens=3))
    assert out["finish_reason"] == "stop" and out["usage"] == {"prompt_tokens": 11, "completion_tokens": 1}
    model.answer = [5, 6, 7, 8, 9]
    out = ask(chat_request(max_new_tokens=4))
    assert out["finish_reason"] == "length" and out["usage"] == {"prompt_tokens": 11, "completion_tokens": 4}


def test_internvl2_sampling_is_exactly_temperature_and_top_p(serve_remote):
    model = FakeInternVL2(answer=[5, END])
    serve_remote("internvl_chat", model)
    ask(chat_request(max_new_tokens=5, do_sample=True, temperature=0.3, top_p=0.7))
    config = model.chat_calls[-1]["generation_config"]
    assert config["do_sample"] is True and config["temperature"] == 0.3 and config["top_p"] == 0.7
    assert config["top_k"] == 0


@pytest.mark.parametrize("model_type, fake", [("minicpmv", FakeMiniCPMV), ("internvl_chat", FakeInternVL2)])
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}, {"role": "user", "content": "Hi"}],
    ],
)
def test_remote_code_refuses_turns_its_card_cannot_express(serve_remote, model_type, fake, messages):
    model = fake(answer=[5, EOS])
    serve_remote(model_type, model)
    out = ask({"requests": [{"messages": messages}, {"messages": [{"role": "user", "content": "Hi"}]}]})
    refused, answered = out["results"]
    assert refused["code"] == "invalid_request" and refused["param"] == "requests[0].messages", refused
    assert answered["response"] == "e"
    assert len(model.chat_calls) == 1  # the refused one never reached chat()


def test_minicpm_v_code_that_takes_List_from_torch_functional_loads(serve_remote, monkeypatch):
    import torch.nn.functional

    monkeypatch.delattr(torch.nn.functional, "List", raising=False)
    resampler = "from torch.nn.functional import *\nhint = List[int]\n"  # resampler.py's imports
    with pytest.raises(NameError):
        exec(resampler, {})
    serve_remote("minicpmv", FakeMiniCPMV(answer=[5, EOS]), on_load=lambda: exec(resampler, {}))
    assert ask(chat_request())["response"] == "e"


@pytest.mark.parametrize("flash_attn, expected", [(False, "eager"), (True, None)])
def test_phi3_vision_asks_for_eager_attention_without_flash_attn(serve_remote, monkeypatch, flash_attn, expected):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" and flash_attn else real_find_spec(name, *a),
    )
    _, loads = serve_remote("phi3_v", FakeRemoteModel(answer=[]))
    # Its config.json sets `_attn_implementation`; a kwarg of that name overrides it, `attn_implementation`
    # does not (tests/test_remote_code_real.py loads the real repository code).
    assert loads[-1].get("_attn_implementation") == expected and "attn_implementation" not in loads[-1]
    assert loads[-1]["trust_remote_code"] is True


# ---- the curated list ---------------------------------------------------------------------------


def test_every_curated_native_family_has_a_tiny_builder_and_card_parity_here():
    import tools.tiny_models as tiny_models

    remote_code = {"minicpm-v", "phi3-vision", "internvl"}
    built = {{"glm4v": "glm-4.1v"}.get(name, name) for name in tiny_models.FAMILIES}
    curated = {model.family for model in CURATED_MODELS.values()} - remote_code
    assert curated <= built, curated - built


def test_curated_grounding_matches_the_familys_adapter():
    adapters = {adapter.name: adapter for adapter in map(adapter_for, FAMILIES)}
    for model_id, model in CURATED_MODELS.items():
        assert adapters[model.family].grounding == model.grounding, model_id


TEXT_ONLY = (
    {"messages": [{"role": "user", "content": "Say hello."}], "max_new_tokens": NEW_TOKENS},
    [{"role": "user", "content": [text("Say hello.")]}],
)


def test_a_text_only_request_batched_with_an_image_request_matches_the_card(engine, tiny_model, family):
    check_batch_against_card(
        engine,
        [TEXT_ONLY[0], ONE_IMAGE[0]],
        [card_recipe(tiny_model(family), messages) for _, messages in [TEXT_ONLY, ONE_IMAGE]],
    )


class FakePhi3Processor:
    """Phi-3-vision's processor as its card uses it: the tokenizer's chat template, then
    processor(prompt, images) -> input_ids (images become <|image_N|> placeholders' tokens)."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.tokenizer.apply_chat_template = lambda messages, tokenize, add_generation_prompt: (
            "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"
        )

    def __call__(self, prompt, images=None, return_tensors=None):
        from transformers import BatchFeature

        return BatchFeature({"input_ids": torch.ones(1, len(prompt), dtype=torch.long)})


class FakePhi3(FakeRemoteModel):
    def generate(self, input_ids, **kwargs):
        self.generate_calls.append(kwargs)
        return torch.cat([input_ids, torch.tensor([self.answer[: kwargs["max_new_tokens"]]])], dim=1)


def test_phi3_vision_sampling_is_exactly_temperature_and_top_p(serve_remote):
    model = FakePhi3(answer=[5, 6, EOS])
    serve_remote("phi3_v", model, processor=FakePhi3Processor())
    out = ask(chat_request(max_new_tokens=5, do_sample=True, temperature=0.6, top_p=0.5))
    call = model.generate_calls[-1]
    assert call["do_sample"] is True and call["temperature"] == 0.6 and call["top_p"] == 0.5 and call["top_k"] == 0
    assert out["response"] == "ef" and out["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 2
    ask(chat_request(max_new_tokens=5))
    assert model.generate_calls[-1]["do_sample"] is False and model.generate_calls[-1].get("top_k") in (None, 0)


def test_internvl2_system_prompt_is_its_system_message_for_that_request_only(serve_remote):
    model = FakeInternVL2(answer=[5, END])
    serve_remote("internvl_chat", model)
    ask(chat_request())
    ask({"messages": [{"role": "user", "content": "Hi"}]})
    with_system, without = model.chat_calls
    assert with_system["system_message"] == "Be brief." and "Be brief." not in with_system["question"]
    assert without["system_message"] == "the model's default system message"


# ---- Phi-4-multimodal: its auto class is AutoModelForCausalLM; images only ------------------------


def phi4_card(folder, prompt: str, images: list) -> tuple[list[int], list[int]]:
    """transformers' Phi-4-multimodal recipe: `<|user|><|image|>...<|end|><|assistant|>` written out, then
    processor(prompt, images) and greedy generate."""
    model, processor = reference_model(str(folder))
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    prompt_ids = inputs["input_ids"][0]
    return prompt_ids.tolist(), output[0, len(prompt_ids) :].tolist()


PHI4_CARDS = [
    (
        TWO_IMAGES[0],
        "<|system|>Answer in one word.<|end|><|user|><|image|>Which is green?<|image|><|end|><|assistant|>",
        [FIRST, SECOND],
    ),
    (ONE_IMAGE[0], "<|user|><|image|>What is shown?<|end|><|assistant|>", [THIRD]),
    (TEXT_ONLY[0], "<|user|>Say hello.<|end|><|assistant|>", []),
]


def test_phi4_multimodal_matches_transformers_recipe_alone_and_batched(tiny_model, serve, forward_calls_of, caplog):
    folder = tiny_model("phi4-multimodal")  # no vision-lora folder: served with the base weights, and said so
    handler.reset_engine()
    with caplog.at_level("WARNING", logger="runpod-vlm"):
        engine = serve(folder)
    assert f"{folder} has no vision-lora adapter: Phi-4-multimodal answers with its base weights" in caplog.messages
    assert not getattr(engine.model, "_hf_peft_config_loaded", False)
    assert type(engine.model).__name__ == "Phi4MultimodalForCausalLM"
    # In the batch (its flat config takes the paged attention on the whole model) at any length: a row is prefilled
    # again where it passes LongRoPE's original context (tests/test_paged_engine.py).
    assert engine.continuous and engine.scheduler.recompute_at == 4096
    request, prompt, images = PHI4_CARDS[0]
    calls = forward_calls_of(engine)
    out = ask(request)
    assert "error" not in out, out
    assert worker_rows(calls, 1) == [phi4_card(folder, prompt, images)]
    check_batch_against_card(
        engine,
        [request for request, _, _ in PHI4_CARDS],
        [phi4_card(folder, prompt, images) for _, prompt, images in PHI4_CARDS],
    )


def test_phi4_multimodal_answers_with_its_vision_lora_as_the_card_does(tiny_model, serve, forward_calls_of):
    folder = tiny_model("phi4-multimodal", vision_lora=True)
    engine = serve(folder)
    assert engine.model.active_adapters() == ["vision"]
    # transformers' load report calls these MISSING (their names contain "vision"): they keep their weights
    saved = safetensors.torch.load_file(folder / "model.safetensors")
    kept = {n: p for n, p in engine.model.named_parameters() if "_for_vision_speech" in n}
    assert kept and all(torch.equal(p, saved[n]) for n, p in kept.items())
    request, prompt, images = PHI4_CARDS[0]
    calls = forward_calls_of(engine)
    out = ask(request)
    assert "error" not in out, out
    card = phi4_card(folder, prompt, images)  # the card's recipe: adapter loaded and set
    assert worker_rows(calls, 1) == [card]
    reference, _ = reference_model(str(folder))
    reference.disable_adapters()
    try:
        base = phi4_card(folder, prompt, images)
    finally:
        reference.enable_adapters()
    assert base[0] == card[0] and base[1] != card[1]  # same prompt; the adapter changes the answer
    check_batch_against_card(
        engine,
        [request for request, _, _ in PHI4_CARDS],
        [phi4_card(folder, prompt, images) for _, prompt, images in PHI4_CARDS],
    )


def test_phi4_multimodal_prefills_each_request_alone_and_decodes_them_together(tiny_model, serve, monkeypatch):
    # Batched beside the two-image request, transformers' image embedding gave the one-image request's image tokens
    # other values than alone (512 of its 562 embeddings differed; with the vision LoRA its answer changed).
    folder = tiny_model("phi4-multimodal", vision_lora=True)
    engine = serve(folder, VLM_SYNC_INTERVAL="2")
    decoder, prefills, widths = engine.start_decoder(), [], []
    prefill, launch = decoder.prompts.prefill_launch, decoder.launch
    counted = lambda inputs, rows, *a: prefills.append(len(rows)) or prefill(inputs, rows, *a)  # noqa: E731
    monkeypatch.setattr(decoder.prompts, "prefill_launch", counted)
    monkeypatch.setattr(decoder, "launch", lambda steps: widths.append(engine.view().running) or launch(steps))
    check_batch_against_card(
        engine,
        [request for request, _, _ in PHI4_CARDS],
        [phi4_card(folder, prompt, images) for _, prompt, images in PHI4_CARDS],
    )
    assert prefills == [1, 1, 1] and max(widths) >= 2


def test_phi4_multimodal_vision_lora_wraps_the_quantized_projections(tiny_model, serve):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    engine = serve(tiny_model("phi4-multimodal", vision_lora=True), VLM_QUANTIZE="4bit")
    modules = dict(engine.model.named_modules())
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"):
        assert type(modules[name]).__module__ == "peft.tuners.lora.bnb"  # peft's LoRA over bitsandbytes
        assert type(modules[name].base_layer).__name__ == "Linear4bit"
    assert type(modules["model.embed_tokens_extend.image_embed.img_projection_up"]).__name__ == "Linear"
    out = ask({**PHI4_CARDS[1][0], "max_new_tokens": 2})
    assert "error" not in out, out
    assert out["usage"]["completion_tokens"] == 2


def test_phi4_multimodal_keeps_its_image_embedding_out_of_quantization(tiny_model):
    model, _ = reference_model(str(tiny_model("phi4-multimodal")))
    vision, head = adapter_for("phi4_multimodal").quantization_skip_modules
    modules = dict(model.named_modules())
    assert modules[head] is model.get_output_embeddings()
    assert {"img_processor", "img_projection_up", "img_projection_down"} <= set(dict(modules[vision].named_children()))


# ---- a request's image resolution: max_pixels and OpenAI's detail -------------------------------


def image_tokens(out: dict, text_only: dict) -> int:
    return out["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"]


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_max_pixels_gives_the_visual_tokens_the_processor_gives_that_bound(family, tiny_model, serve):
    from PIL import Image

    engine = serve(tiny_model(family))
    image = Image.new("RGB", (640, 480), "white")
    processor = engine.processor.image_processor
    low, high = processor.size["shortest_edge"], processor.size["longest_edge"]  # the deployment's bounds

    def expected(max_pixels: int) -> int:  # the processor's own count with that bound, within the deployment's
        size = {"shortest_edge": low, "longest_edge": max(min(max_pixels, high), low)}
        grid = processor(images=[image], size=size, return_tensors="pt")["image_grid_thw"][0]
        return int(grid.prod()) // processor.merge_size**2 + 2  # and the template's vision start and end tokens

    def ask_with(**extra) -> dict:
        content = [{"type": "image_url", "image_url": {"url": data_uri(image), **extra.pop("detail", {})}}]
        return ask({"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "?"}]}],
                    "max_new_tokens": 1, **extra})  # fmt: skip

    text_only = ask({"messages": [{"role": "user", "content": [{"type": "text", "text": "?"}]}], "max_new_tokens": 1})
    full = image_tokens(ask_with(), text_only)
    for bound in (5_000, 8_000):  # between the tiny processors' bounds
        assert image_tokens(ask_with(max_pixels=bound), text_only) == expected(bound) < full
    low_detail = image_tokens(ask_with(detail={"detail": "low"}), text_only)
    assert low_detail == expected(512 * 512) <= full
    assert image_tokens(ask_with(detail={"detail": "high"}), text_only) == full
    assert ask_with(detail={"detail": "tiny"})["param"] == "messages[0].content[0].image_url.detail"
