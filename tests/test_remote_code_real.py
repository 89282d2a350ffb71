"""The remote-code families on their repositories' own code: the worker answers as each model card
does. Tiny random-weight models (tools/legacy_models.py) keep the repository's Python files,
tokenizer, chat template, processor and config; only the layers shrink. CPU.

Runs on the legacy line only (transformers 4.45-4.48, where that code runs) and only when
VLM_LEGACY_CODE_DIR points at a copy of the repositories' files (scripts/legacy_check.sh sets this
up): CI has no model hub, and this project does not carry third-party code.

Per family, against its card's recipe run on the same loaded model:
- MiniCPM-V 2.6: `model.chat(image=None, msgs=[...], tokenizer=tokenizer)` with the images inside the
  messages, `system_prompt=` for a system prompt, and `sampling=False, num_beams=1,
  repetition_penalty=1.0` for greedy (chat()'s own defaults are beam search or top-k 100 sampling);
- InternVL2: the card's `load_image` tiling, then `model.chat(tokenizer, pixel_values, question,
  generation_config)`, with `history` for earlier turns and `model.system_message` for a system prompt;
- Phi-3-vision: `processor.tokenizer.apply_chat_template`, `processor(prompt, images)`, then
  `model.generate(..., eos_token_id=processor.tokenizer.eos_token_id)`.
The worker's prompt ids and pixels equal the card's, so do its greedy tokens and text; usage and
finish_reason come from the generated ids; sampling is exactly temperature and top-p.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

import handler
from tools.sample_images import data_uri, plain, striped

CODE_DIR = os.environ.get("VLM_LEGACY_CODE_DIR", "")
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _legacy_transformers() -> str:
    """Why these tests cannot run here, or "" when they can."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if (major, minor) < (4, 45) or (major, minor) > (4, 48):
        return f"the remote-code families run on transformers 4.45-4.48 (installed: {transformers.__version__})"
    return ""


pytestmark = [
    pytest.mark.skipif(
        not CODE_DIR,
        reason="VLM_LEGACY_CODE_DIR is not set: it must point at a copy of the "
        "remote-code repositories' files (scripts/legacy_check.sh), which CI cannot download",
    ),
    pytest.mark.skipif(bool(CODE_DIR) and bool(_legacy_transformers()), reason=_legacy_transformers()),
]

NEW_TOKENS = 6
FIRST, SECOND = striped((100, 50)), plain("green", (40, 60))


def ask(payload: dict) -> dict:
    return asyncio.run(handler.local_test_answer({"id": "job-1", "input": payload}))


def text(value: str) -> dict:
    return {"type": "text", "text": value}


@pytest.fixture(scope="session")
def legacy_model(tmp_path_factory):
    """`legacy_model(family, eos_bias=False)` -> folder of a tiny model on the family's real code.
    Built in a child process: building imports the repository code (with MiniCPM-V's `List` fix),
    which must not be loaded already when the worker loads it here."""
    import tools.legacy_models as legacy_models

    built: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("legacy-models")

    def get(family: str, eos_bias: bool = False) -> Path:
        folder = Path(CODE_DIR) / legacy_models.FAMILIES[family]
        if not (folder / legacy_models.MODELING_FILES[family]).is_file():
            pytest.skip(f"no copy of the {family} repository's files in {folder}")
        key = (family, eos_bias)
        if key not in built:
            out = root / f"{family}{'-eos' if eos_bias else ''}"
            command = [sys.executable, "-m", "tools.legacy_models", family, CODE_DIR, str(out)]
            done = subprocess.run(
                command + (["--eos-bias"] if eos_bias else []), cwd=TOOLS.parent, capture_output=True, text=True
            )
            if done.returncode:
                pytest.fail(f"building the tiny {family} model failed:\n{done.stderr[-3000:]}")
            built[key] = out
        return built[key]

    return get


def spy(monkeypatch, owner, calls: list) -> None:
    """Record each `owner.generate` call: its keyword arguments and its output."""
    real = owner.generate

    def generate(*args, **kwargs):
        output = real(*args, **kwargs)
        calls.append({**kwargs, "output": output})
        return output

    monkeypatch.setattr(owner, "generate", generate)


def effective_sampling(model, kwargs: dict) -> dict:
    """The decoding generate() really ran with: its generation config merged with the call's kwargs."""
    config, _ = model._prepare_generation_config(
        kwargs.get("generation_config"),
        **{
            k: v
            for k, v in kwargs.items()
            if k
            not in (
                "generation_config",
                "output",
                "inputs_embeds",
                "input_ids",
                "attention_mask",
                "pixel_values",
                "image_sizes",
            )
        },
    )
    return {
        name: getattr(config, name)
        for name in ("do_sample", "temperature", "top_p", "top_k", "num_beams", "repetition_penalty")
    }


def kept(ids: list[int], eos: set) -> list[int]:
    return ids[: next((k for k, token in enumerate(ids) if token in eos), len(ids))]


# ---- InternVL2 ---------------------------------------------------------------------------------


def internvl_card_pixels(image):
    """The card's `load_image(image, max_num=12)`: the aspect-ratio grid of 448px tiles closest to the
    image (ties to the larger grid when the image is large enough), a thumbnail when there is more than
    one tile, each tile resized to 448 (bicubic), scaled and normalised with ImageNet's mean and std."""
    import torch
    import torchvision.transforms as T
    from torchvision.transforms.functional import InterpolationMode

    size, most = 448, 12
    width, height = image.size
    grids = sorted(
        {(i, j) for n in range(1, most + 1) for i in range(1, n + 1) for j in range(1, n + 1) if 1 <= i * j <= most},
        key=lambda grid: grid[0] * grid[1],
    )
    best, best_diff = (1, 1), float("inf")
    for grid in grids:
        diff = abs(width / height - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and width * height > 0.5 * size * size * grid[0] * grid[1]:
            best = grid
    resized = image.resize((size * best[0], size * best[1]))
    tiles = [
        resized.crop((k % best[0] * size, k // best[0] * size, (k % best[0] + 1) * size, (k // best[0] + 1) * size))
        for k in range(best[0] * best[1])
    ]
    if len(tiles) != 1:
        tiles.append(image.resize((size, size)))
    transform = T.Compose(
        [
            T.Lambda(lambda tile: tile.convert("RGB")),
            T.Resize((size, size), interpolation=InterpolationMode.BICUBIC),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    return torch.stack([transform(tile) for tile in tiles])


def internvl_card(engine, monkeypatch, images, question, history=None, system=None, max_new_tokens=NEW_TOKENS):
    """The card's recipe on the engine's model: the prompt ids and pixels it generated from, its
    greedy tokens and its answer."""
    import torch

    model, tokenizer = engine.model, engine.processor
    outer, inner = [], []
    with monkeypatch.context() as patch:
        spy(patch, model, outer)
        spy(patch, model.language_model, inner)
        if system is not None:
            patch.setattr(model, "system_message", system)
        tiles = [internvl_card_pixels(image) for image in images]
        pixel_values = torch.cat(tiles) if tiles else None
        response = model.chat(
            tokenizer,
            pixel_values,
            question,
            dict(max_new_tokens=max_new_tokens, do_sample=False),
            history=history,
            num_patches_list=[len(t) for t in tiles] if tiles else None,
        )
    return outer[0], inner[0]["output"][0].tolist(), response


def worker_calls(engine, monkeypatch, payload: dict):
    outer, inner = [], []
    with monkeypatch.context() as patch:
        spy(patch, engine.model, outer)
        spy(patch, engine.model.language_model, inner)
        out = ask(payload)
    return out, outer, inner


INTERNVL_CASES = {
    "one image": (
        {"task": "vqa", "image_url": data_uri(FIRST), "question": "What is shown?", "max_new_tokens": NEW_TOKENS},
        dict(images=[FIRST], question="<image>\nWhat is shown?"),
    ),
    "system, two images, earlier turns": (
        {
            "messages": [
                {"role": "system", "content": "Answer in one word."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": data_uri(FIRST)},
                        text("Compare"),
                        {"type": "image_url", "image_url": data_uri(SECOND)},
                    ],
                },
                {"role": "assistant", "content": "Stripes."},
                {"role": "user", "content": "Which is larger?"},
            ],
            "max_new_tokens": NEW_TOKENS,
        },
        dict(
            images=[FIRST, SECOND],
            question="Which is larger?",
            history=[("<image>\nCompare\n<image>", "Stripes.")],
            system="Answer in one word.",
        ),
    ),
    "text only": (
        {"messages": [{"role": "user", "content": "Say something."}], "max_new_tokens": NEW_TOKENS},
        dict(images=[], question="Say something."),
    ),
}


@pytest.fixture
def internvl(legacy_model, serve):
    return serve(legacy_model("internvl2"), VLM_TRUST_REMOTE_CODE="true")


@pytest.mark.parametrize("case", list(INTERNVL_CASES))
def test_internvl2_answers_as_its_card(internvl, monkeypatch, case):
    payload, card = INTERNVL_CASES[case]
    default_system = internvl.model.system_message
    card_call, card_ids, card_text = internvl_card(internvl, monkeypatch, **card)
    out, outer, inner = worker_calls(internvl, monkeypatch, payload)

    assert "error" not in out, out
    assert internvl.model.system_message == default_system  # a request's system prompt does not stay
    assert outer[0]["input_ids"].tolist() == card_call["input_ids"].tolist()
    if card["images"]:
        assert outer[0]["pixel_values"].equal(card_call["pixel_values"])
    else:
        assert outer[0]["pixel_values"] is None and card_call["pixel_values"] is None
    ids = inner[0]["output"][0].tolist()
    assert ids == card_ids
    assert out["response"] == card_text
    end = {internvl.processor.convert_tokens_to_ids("<|im_end|>")}  # the template's separator, as chat() stops
    assert out["usage"] == {"prompt_tokens": card_call["input_ids"].shape[1], "completion_tokens": len(kept(ids, end))}
    assert out["finish_reason"] == ("stop" if len(kept(ids, end)) < len(ids) else "length")


def test_internvl2_sampling_is_exactly_temperature_and_top_p(internvl, monkeypatch):
    payload = {
        "task": "vqa",
        "image_url": data_uri(FIRST),
        "question": "What?",
        "max_new_tokens": 3,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    out, _, inner = worker_calls(internvl, monkeypatch, payload)
    assert "error" not in out, out
    assert effective_sampling(internvl.model.language_model, inner[0]) == {
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "num_beams": 1,
        "repetition_penalty": 1.0,
    }


def test_internvl2_stops_where_its_chat_stops(legacy_model, serve):
    serve(legacy_model("internvl2", eos_bias=True), VLM_TRUST_REMOTE_CODE="true")
    out = ask({"task": "vqa", "image_url": data_uri(FIRST), "question": "What?", "max_new_tokens": NEW_TOKENS})
    assert (out["finish_reason"], out["usage"]["completion_tokens"], out["response"]) == ("stop", 0, "")
    assert out["usage"]["prompt_tokens"] > 256  # 256 image tokens per 448px tile, then the text


# What chat() cannot express: its conversation opens with a user turn, a system prompt comes first.
UNSAYABLE = {
    "leading assistant turn": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi?"}],
    "system turn later": [
        {"role": "user", "content": "Hi?"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hm?"},
    ],
}


@pytest.mark.parametrize("messages", list(UNSAYABLE.values()), ids=list(UNSAYABLE))
def test_internvl2_refuses_what_its_chat_cannot_express(internvl, messages):
    out = ask({"messages": messages, "max_new_tokens": NEW_TOKENS})
    assert (out.get("code"), out.get("param")) == ("invalid_request", "messages"), out


# ---- Phi-3-vision ------------------------------------------------------------------------------


@pytest.fixture
def phi3(legacy_model, serve):
    return serve(legacy_model("phi3-vision"), VLM_TRUST_REMOTE_CODE="true")


def phi3_card(engine, messages: list[dict], images: list, max_new_tokens=NEW_TOKENS):
    """The card: the tokenizer's chat template, `processor(prompt, images)`, greedy generate that stops
    at the tokenizer's end token."""
    import torch

    model, processor = engine.model, engine.processor
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(prompt, images or None, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(
            **inputs, eos_token_id=processor.tokenizer.eos_token_id, max_new_tokens=max_new_tokens, do_sample=False
        )
    generated = output[0, inputs["input_ids"].shape[1] :]
    answer = processor.batch_decode(generated[None], skip_special_tokens=True, clean_up_tokenization_spaces=False)[0]
    return inputs, generated.tolist(), answer


PHI3_CASES = {
    "one image": (
        {"task": "vqa", "image_url": data_uri(FIRST), "question": "What is shown?", "max_new_tokens": NEW_TOKENS},
        [{"role": "user", "content": "<|image_1|>\nWhat is shown?"}],
        [FIRST],
    ),
    "system, leading assistant, two images, earlier turns": (
        {
            "messages": [
                {"role": "system", "content": "Answer in one word."},
                {"role": "assistant", "content": "Ask me about images."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": data_uri(FIRST)},
                        text("Compare"),
                        {"type": "image_url", "image_url": data_uri(SECOND)},
                    ],
                },
                {"role": "assistant", "content": "Stripes."},
                {"role": "user", "content": "Which is larger?"},
            ],
            "max_new_tokens": NEW_TOKENS,
        },
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "assistant", "content": "Ask me about images."},
            {"role": "user", "content": "<|image_1|>\nCompare\n<|image_2|>"},
            {"role": "assistant", "content": "Stripes."},
            {"role": "user", "content": "Which is larger?"},
        ],
        [FIRST, SECOND],
    ),
    "text only": (
        {"messages": [{"role": "user", "content": "Say something."}], "max_new_tokens": NEW_TOKENS},
        [{"role": "user", "content": "Say something."}],
        [],
    ),
}


def test_phi3_vision_loads_with_an_installed_attention(phi3):
    import importlib.util

    # config.json asks for flash_attention_2; without flash-attn the card's eager is used.
    assert importlib.util.find_spec("flash_attn") is not None or phi3.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("case", list(PHI3_CASES))
def test_phi3_vision_answers_as_its_card(phi3, monkeypatch, case):
    payload, messages, images = PHI3_CASES[case]
    inputs, card_ids, card_text = phi3_card(phi3, messages, images)
    calls: list = []
    with monkeypatch.context() as patch:
        spy(patch, phi3.model, calls)
        out = ask(payload)

    assert "error" not in out, out
    assert calls[0]["input_ids"].tolist() == inputs["input_ids"].tolist()
    if images:
        assert calls[0]["pixel_values"].equal(inputs["pixel_values"])
        assert calls[0]["image_sizes"].tolist() == inputs["image_sizes"].tolist()
    else:
        assert "pixel_values" not in calls[0]
    prompt_length = inputs["input_ids"].shape[1]
    ids = calls[0]["output"][0, prompt_length:].tolist()
    assert ids == card_ids
    assert out["response"] == card_text.strip()
    end = set(calls[0]["eos_token_id"])
    assert phi3.processor.tokenizer.eos_token_id in end
    assert out["usage"] == {"prompt_tokens": prompt_length, "completion_tokens": len(kept(ids, end))}
    assert out["finish_reason"] == ("stop" if len(kept(ids, end)) < len(ids) else "length")


def test_phi3_vision_sampling_is_exactly_temperature_and_top_p(phi3, monkeypatch):
    calls: list = []
    with monkeypatch.context() as patch:
        spy(patch, phi3.model, calls)
        out = ask(
            {
                "messages": [{"role": "user", "content": "Hi?"}],
                "max_new_tokens": 3,
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.9,
            }
        )
    assert "error" not in out, out
    assert effective_sampling(phi3.model, calls[0]) == {
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "num_beams": 1,
        "repetition_penalty": 1.0,
    }


def test_phi3_vision_stops_at_its_end_token(legacy_model, serve):
    serve(legacy_model("phi3-vision", eos_bias=True), VLM_TRUST_REMOTE_CODE="true")
    out = ask({"messages": [{"role": "user", "content": "Hi?"}], "max_new_tokens": NEW_TOKENS})
    assert (out["finish_reason"], out["usage"]["completion_tokens"], out["response"]) == ("stop", 0, "")


# ---- MiniCPM-V 2.6 -----------------------------------------------------------------------------


@pytest.fixture
def minicpm(legacy_model, serve):
    return serve(legacy_model("minicpm-v"), VLM_TRUST_REMOTE_CODE="true")


def minicpm_calls(engine, monkeypatch, run):
    outer, inner = [], []
    with monkeypatch.context() as patch:
        spy(patch, engine.model, outer)
        spy(patch, engine.model.llm, inner)
        answer = run()
    return answer, outer, inner


MINICPM_CASES = {
    "one image": (
        {"task": "vqa", "image_url": data_uri(FIRST), "question": "What is shown?", "max_new_tokens": NEW_TOKENS},
        dict(msgs=[{"role": "user", "content": [FIRST, "What is shown?"]}]),
    ),
    "system, two images, earlier turns": (
        {
            "messages": [
                {"role": "system", "content": "Answer in one word."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": data_uri(FIRST)},
                        text("Compare"),
                        {"type": "image_url", "image_url": data_uri(SECOND)},
                    ],
                },
                {"role": "assistant", "content": "Stripes."},
                {"role": "user", "content": "Which is larger?"},
            ],
            "max_new_tokens": NEW_TOKENS,
        },
        dict(
            msgs=[
                {"role": "user", "content": [FIRST, "Compare", SECOND]},
                {"role": "assistant", "content": ["Stripes."]},
                {"role": "user", "content": ["Which is larger?"]},
            ],
            system_prompt="Answer in one word.",
        ),
    ),
    "text only": (
        {"messages": [{"role": "user", "content": "Say something."}], "max_new_tokens": NEW_TOKENS},
        dict(msgs=[{"role": "user", "content": ["Say something."]}]),
    ),
}


def same_nested(a, b) -> bool:
    """Equal nested lists of tensors (MiniCPM-V's pixel_values, tgt_sizes, image_bound)."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.equal(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("case", list(MINICPM_CASES))
def test_minicpm_v_answers_as_its_card(minicpm, monkeypatch, case):
    payload, card = MINICPM_CASES[case]
    model, tokenizer = minicpm.model, minicpm.processor
    card_text, card_outer, card_inner = minicpm_calls(
        minicpm,
        monkeypatch,
        lambda: model.chat(
            image=None,
            tokenizer=tokenizer,
            max_new_tokens=NEW_TOKENS,
            sampling=False,
            num_beams=1,
            repetition_penalty=1.0,
            **card,
        ),
    )
    out, outer, inner = minicpm_calls(minicpm, monkeypatch, lambda: ask(payload))

    assert "error" not in out, out
    for name in ("input_ids", "attention_mask", "pixel_values", "tgt_sizes", "image_bound"):
        assert same_nested(outer[0][name], card_outer[0][name]), name
    ids = inner[0]["output"][0].tolist()
    assert ids == card_inner[0]["output"][0].tolist()
    assert out["response"] == card_text
    # Greedy, not chat()'s default beam search with a repetition penalty.
    sampling = effective_sampling(model.llm, inner[0])
    assert (sampling["do_sample"], sampling["num_beams"], sampling["repetition_penalty"]) == (False, 1, 1.0)
    end = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}  # chat()'s terminators
    assert out["usage"] == {"prompt_tokens": outer[0]["input_ids"].shape[1], "completion_tokens": len(kept(ids, end))}
    assert out["finish_reason"] == ("stop" if len(kept(ids, end)) < len(ids) else "length")


def test_minicpm_v_sampling_is_exactly_temperature_and_top_p(minicpm, monkeypatch):
    payload = {
        "task": "vqa",
        "image_url": data_uri(FIRST),
        "question": "What?",
        "max_new_tokens": 3,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    out, _, inner = minicpm_calls(minicpm, monkeypatch, lambda: ask(payload))
    assert "error" not in out, out
    assert effective_sampling(minicpm.model.llm, inner[0]) == {
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "num_beams": 1,
        "repetition_penalty": 1.0,
    }


def test_minicpm_v_stops_at_its_end_token(legacy_model, serve):
    serve(legacy_model("minicpm-v", eos_bias=True), VLM_TRUST_REMOTE_CODE="true")
    out = ask({"task": "vqa", "image_url": data_uri(FIRST), "question": "What?", "max_new_tokens": NEW_TOKENS})
    assert (out["finish_reason"], out["usage"]["completion_tokens"], out["response"]) == ("stop", 0, "")


@pytest.mark.parametrize("messages", list(UNSAYABLE.values()), ids=list(UNSAYABLE))
def test_minicpm_v_refuses_what_its_chat_cannot_express(minicpm, messages):
    out = ask({"messages": messages, "max_new_tokens": NEW_TOKENS})
    assert (out.get("code"), out.get("param")) == ("invalid_request", "messages"), out


# ---- every family ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, cases", [("internvl2", INTERNVL_CASES), ("minicpm-v", MINICPM_CASES), ("phi3-vision", PHI3_CASES)]
)
def test_a_batch_answers_each_request_as_it_is_answered_alone(legacy_model, serve, family, cases):
    serve(legacy_model(family), VLM_TRUST_REMOTE_CODE="true")
    payloads = [cases["one image"][0], cases["text only"][0]]
    alone = [ask(payload) for payload in payloads]
    batched = ask({"requests": payloads})["results"]
    assert all("error" not in out for out in alone), alone
    assert [(r["response"], r["usage"], r["finish_reason"]) for r in batched] == [
        (r["response"], r["usage"], r["finish_reason"]) for r in alone
    ]
