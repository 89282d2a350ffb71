"""Families served through their repository's own code (trust_remote_code), one item at a time."""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

from runpod_vlm.families.base import FamilyAdapter, end_tokens, text_of, token_ids
from runpod_vlm.vocabulary import (
    Generation,
    GenerationRequest,
    RequestError,
    Turn,
    join_param,
)


class RemoteCodeAdapter(FamilyAdapter):
    """Families served through their repository's own code (trust_remote_code), one item at a time."""

    native = False
    model_class, processor_class = "AutoModel", "AutoTokenizer"  # names in transformers
    inner_language_model: Optional[str] = None  # the attribute whose generate() the card's chat() calls

    def load(self, path: str, load_kwargs: dict):
        import transformers

        model = getattr(transformers, self.model_class).from_pretrained(path, **load_kwargs).eval()
        return model, getattr(transformers, self.processor_class).from_pretrained(path, trust_remote_code=True)

    def card_sampling(self, sampling: dict) -> dict:
        """The request's decoding exactly; top_k=0 turns off generate()'s default top-k 50 when sampling."""
        return {**sampling, "top_k": 0} if sampling.get("do_sample") else dict(sampling)

    def run(self, model, tokenizer, item: GenerationRequest, sampling: dict) -> Generation:
        system, turns = _leading_system_prompt(self.request_turns(item), self.name, item.param)
        with self.recorded_generation(model) as record:
            text = self.chat(model, tokenizer, system, turns, item.images, self.card_sampling(sampling))
        return self.generation(text, record, item.params.max_new_tokens)

    @contextlib.contextmanager
    def recorded_generation(self, model):
        """Records the prompt length, ids and end tokens of the inner model's generate(), which chat() hides."""
        from unittest import mock

        record: dict = {}
        inner = getattr(model, self.inner_language_model)
        real_generate = inner.generate

        def generate(*args, **kwargs):
            output = real_generate(*args, **kwargs)
            prompt = kwargs.get("inputs_embeds", kwargs.get("input_ids"))
            eos = kwargs.get("eos_token_id") or inner.generation_config.eos_token_id  # what stopped it
            record.update(
                prompt_tokens=int(prompt.shape[1]) if prompt is not None else 0,
                ids=output[0].tolist(),
                eos=set(token_ids(eos)),
            )
            return output

        with mock.patch.object(inner, "generate", generate):
            yield record

    def generation(self, text: str, record: dict, max_new_tokens: int) -> Generation:
        """Usage and finish_reason from the generated ids and the end tokens generate() stopped at."""
        return Generation.from_ids(
            text.strip(), record["ids"], record["eos"], max_new_tokens, prompt_tokens=record["prompt_tokens"]
        )


def _leading_system_prompt(turns: list[Turn], family: str, param: Optional[str]) -> tuple[Optional[str], list[Turn]]:
    """The leading system turns' text and the turns after them, which must open with a user turn."""
    opening = next((k for k, turn in enumerate(turns) if turn.role != "system"), len(turns))
    system, rest = turns[:opening], turns[opening:]
    if any(turn.role == "system" for turn in rest):
        raise RequestError(
            "invalid_request",
            f"the {family} family takes system messages only at the start",
            join_param(param, "messages"),
        )
    if rest and rest[0].role != "user":
        raise RequestError(
            "invalid_request",
            f"the {family} family needs the conversation to open with a user message (after any system message)",
            join_param(param, "messages"),
        )
    return ("\n".join(text_of(t) for t in system) or None), rest


class MiniCPMVAdapter(RemoteCodeAdapter):
    """openbmb/MiniCPM-V-2_6: `model.chat(image=None, msgs=[...], tokenizer=...)` per its card."""

    name, skip_modules, inner_language_model = "minicpm-v", ("vpm", "resampler", "lm_head"), "llm"

    def load(self, path: str, load_kwargs: dict):
        # Its resampler.py takes `List` from `from torch.nn.functional import *`, which torch no
        # longer provides (torch >= 2.7); give that module the name back instead of editing the repo.
        import typing

        import torch  # noqa: F401  (loads torch.nn.functional)

        functional = sys.modules.get("torch.nn.functional")
        if functional is not None and not hasattr(functional, "List"):
            functional.List = typing.List  # noqa: UP006  (the name resampler.py looks up)
        return super().load(path, load_kwargs)

    def card_sampling(self, sampling: dict) -> dict:
        """Overrides chat()'s defaults (top_k 100 or num_beams 3, repetition_penalty 1.05 or 1.2)."""
        greedy = not sampling.get("do_sample")
        return {
            **super().card_sampling(sampling),
            "sampling": not greedy,
            "repetition_penalty": 1.0,
            **({"num_beams": 1} if greedy else {}),
        }

    def chat(self, model, tokenizer, system, turns, images, sampling) -> str:
        msgs = [{"role": turn.role, "content": list(turn.parts)} for turn in turns]
        return model.chat(
            image=None, msgs=msgs, tokenizer=tokenizer, **sampling, **({"system_prompt": system} if system else {})
        )


class InternVL2Adapter(RemoteCodeAdapter):
    """OpenGVLab/InternVL2-*: the card's dynamic 448px tiling, then `model.chat(...)`."""

    name, skip_modules, inner_language_model = "internvl", ("vision_model", "mlp1", "lm_head"), "language_model"
    image_size, max_tiles = 448, 12
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

    def tiles(self, image) -> list:
        """The card's `dynamic_preprocess`: the closest aspect-ratio grid of 448px tiles + a thumbnail."""
        (width, height), size, sides = image.size, self.image_size, range(1, self.max_tiles + 1)
        grids = sorted({(i, j) for i in sides for j in sides if i * j <= self.max_tiles}, key=lambda g: g[0] * g[1])
        best, best_diff = (1, 1), float("inf")
        for cols, rows in grids:
            diff = abs(width / height - cols / rows)
            if diff < best_diff or (diff == best_diff and width * height > 0.5 * size**2 * cols * rows):
                best, best_diff = (cols, rows), diff
        cols, rows = best
        resized = image.resize((size * cols, size * rows))
        tiles = [
            resized.crop((x * size, y * size, (x + 1) * size, (y + 1) * size)) for y in range(rows) for x in range(cols)
        ]
        return [*tiles, image.resize((size, size))] if len(tiles) > 1 else tiles

    def pixel_values(self, images, dtype, device):
        """The images' normalised tiles, stacked, and each image's tile count."""
        import torch
        from torchvision.transforms import functional as F

        per_image = [
            torch.stack([F.normalize(F.to_tensor(t), self.mean, self.std) for t in self.tiles(image)])
            for image in images
        ]
        if not per_image:
            return None, []
        return torch.cat(per_image).to(dtype=dtype, device=device), [len(p) for p in per_image]

    def chat(self, model, tokenizer, system, turns, images, sampling) -> str:
        from unittest import mock

        # Its chat() takes one question plus (question, answer) history pairs; a system prompt
        # replaces `model.system_message` for this request, as its card does.
        history, pending = [], None
        for turn in turns:
            text = "\n".join(p if isinstance(p, str) else "<image>" for p in turn.parts)
            if turn.role == "assistant" and pending is not None:
                history.append((pending, text))
                pending = None
            elif turn.role == "user":
                pending = text if pending is None else f"{pending}\n{text}"
        values, num_patches = self.pixel_values(images, model.dtype, model.device)
        with mock.patch.object(model, "system_message", system, create=True) if system else contextlib.nullcontext():
            return model.chat(
                tokenizer,
                values,
                pending or "",
                sampling,
                num_patches_list=num_patches or None,
                history=history or None,
            )


class Phi3VisionAdapter(RemoteCodeAdapter):
    """microsoft/Phi-3-vision-128k-instruct: `<|image_N|>` placeholders + its processor + generate."""

    name, skip_modules = "phi3-vision", ("model.vision_embed_tokens", "lm_head")
    model_class, processor_class = "AutoModelForCausalLM", "AutoProcessor"

    def load(self, path: str, load_kwargs: dict):
        import importlib.util

        # Its config.json asks for flash_attention_2; the card says to pass eager without flash-attn,
        # spelt `_attn_implementation`: that key overrides config.json's (`attn_implementation` does not).
        if importlib.util.find_spec("flash_attn") is None:
            load_kwargs = {**load_kwargs, "_attn_implementation": "eager"}
        return super().load(path, load_kwargs)

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        import itertools

        numbers = itertools.count(1)
        return [
            {
                "role": turn.role,
                "content": "\n".join(p if isinstance(p, str) else f"<|image_{next(numbers)}|>" for p in turn.parts),
            }
            for turn in turns
        ]

    def run(self, model, processor, item: GenerationRequest, sampling: dict) -> Generation:
        import torch

        messages = self.chat_messages(self.request_turns(item))
        prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(prompt, item.images or None, return_tensors="pt").to(model.device)
        # The card passes only the tokenizer's end token; end_tokens adds the config's eos_token_id (2, </s>),
        # as for every family.
        eos = end_tokens(model, processor.tokenizer)
        with torch.inference_mode():
            out = model.generate(**inputs, eos_token_id=sorted(eos), **self.card_sampling(sampling))
        prompt_tokens = int(inputs["input_ids"].shape[1])
        new_tokens = out[0, prompt_tokens:]
        record = {"ids": new_tokens.tolist(), "prompt_tokens": prompt_tokens, "eos": eos}
        text = processor.tokenizer.decode(new_tokens, skip_special_tokens=True)
        return self.generation(text, record, item.params.max_new_tokens)
