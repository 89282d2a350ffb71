"""runpod-vlm: a RunPod serverless worker that serves one vision-language model.

Sections, top to bottom: settings -> errors -> images -> family adapters -> model -> tasks ->
batching -> entry point. Importing this module is cheap: torch, transformers and runpod are imported
where they are used, and the model loads on the first job (or at boot under `python handler.py`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import logging
import os
import re
import threading
import time
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger("runpod-vlm")

# =================================================================================================
# Settings
# =================================================================================================

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"


@dataclasses.dataclass(frozen=True)
class CuratedModel:
    family: str
    vram_gb: int  # approximate, bf16 weights plus a working margin
    license: str


CURATED_MODELS: dict[str, CuratedModel] = {
    "Qwen/Qwen2-VL-2B-Instruct": CuratedModel("qwen2-vl", 8, "Apache-2.0"),
    "Qwen/Qwen2-VL-7B-Instruct": CuratedModel("qwen2-vl", 20, "Apache-2.0"),
    "llava-hf/llava-1.5-7b-hf": CuratedModel("llava", 16, "Llama 2 Community License"),
    "llava-hf/llava-1.5-13b-hf": CuratedModel("llava", 30, "Llama 2 Community License"),
    "llava-hf/llava-v1.6-mistral-7b-hf": CuratedModel("llava-next", 18, "Apache-2.0"),
    "openbmb/MiniCPM-V-2_6": CuratedModel("minicpm-v", 20, "MiniCPM Model License"),
    "microsoft/Phi-3-vision-128k-instruct": CuratedModel("phi3-vision", 12, "MIT"),
    "OpenGVLab/InternVL2-8B": CuratedModel("internvl", 20, "MIT"),
}

QUANTIZE_CHOICES = ("none", "4bit", "8bit")
DTYPE_CHOICES = ("auto", "fp16", "bf16", "fp32")


def _env_bool(env: dict, name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be true or false, got {raw!r}")


def _env_int(env: dict, name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name} must be at least {minimum}, got {value}")
    return value


def _env_choice(env: dict, name: str, default: str, choices: Iterable[str]) -> str:
    value = (env.get(name) or default).strip().lower()
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


class SettingsError(RuntimeError):
    """A deployment setting is wrong: the operator's mistake, reported at load time."""


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = DEFAULT_MODEL
    quantize: str = "none"
    dtype: str = "auto"
    device_map: str = "auto"
    trust_remote_code: bool = True
    allow_any: bool = False
    max_new_tokens_cap: int = 2048
    default_max_new_tokens: int = 256
    max_batch_size: int = 16  # rows per GPU batch
    max_batch_requests: int = 64  # items in one {"requests": [...]} call
    max_images: int = 16  # per request
    max_total_pixels: int = 64_000_000  # decoded pixels per request, all images together
    max_text_chars: int = 32_000  # all text of a request together
    max_messages: int = 64
    min_pixels: int = 0  # Qwen processors' visual-token bounds; 0 keeps the model's own
    max_pixels: int = 0
    compile: bool = True  # static cache + torch.compile on CUDA (never on CPU or bitsandbytes)
    cache_len: int = 2048  # KV-cache length compiled at warm-up; longer requests grow it once

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> "Settings":
        env = dict(os.environ if env is None else env)
        return cls(
            model=(env.get("VLM_MODEL") or DEFAULT_MODEL).strip(),
            quantize=_env_choice(env, "VLM_QUANTIZE", "none", QUANTIZE_CHOICES),
            dtype=_env_choice(env, "VLM_DTYPE", "auto", DTYPE_CHOICES),
            device_map=(env.get("VLM_DEVICE_MAP") or "auto").strip(),
            trust_remote_code=_env_bool(env, "VLM_TRUST_REMOTE_CODE", True),
            allow_any=_env_bool(env, "VLM_ALLOW_ANY", False),
            max_new_tokens_cap=_env_int(env, "VLM_MAX_NEW_TOKENS", 2048, 1),
            default_max_new_tokens=_env_int(env, "VLM_DEFAULT_MAX_NEW_TOKENS", 256, 1),
            max_batch_size=_env_int(env, "VLM_MAX_BATCH_SIZE", 16, 1),
            max_batch_requests=_env_int(env, "VLM_MAX_BATCH_REQUESTS", 64, 1),
            max_images=_env_int(env, "VLM_MAX_IMAGES", 16, 1),
            max_total_pixels=_env_int(env, "VLM_MAX_TOTAL_PIXELS", 64_000_000, 1),
            max_text_chars=_env_int(env, "VLM_MAX_TEXT_CHARS", 32_000, 1),
            max_messages=_env_int(env, "VLM_MAX_MESSAGES", 64, 1),
            min_pixels=_env_int(env, "VLM_MIN_PIXELS", 0),
            max_pixels=_env_int(env, "VLM_MAX_PIXELS", 0),
            compile=_env_bool(env, "VLM_COMPILE", True),
            cache_len=_env_int(env, "VLM_CACHE_LEN", 2048, 256),
        )


# =================================================================================================
# Errors
# =================================================================================================


class RequestError(Exception):
    """A request the worker refuses. `param` names the field at fault, `code` is stable for clients."""

    def __init__(self, code: str, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def to_dict(self) -> dict:
        text = f"{self.param}: {self.message}" if self.param else self.message
        return {"error": text, "code": self.code, "param": self.param}


def _join(param: Optional[str], child: str) -> str:
    if not param:
        return child
    return f"{param}{child}" if child.startswith("[") else f"{param}.{child}"


# =================================================================================================
# Images
# =================================================================================================


def resolve_image(spec: Any, param: str):
    """Turn one image spec (URL, data URI, raw base64 or {"url": ...}) into an RGB PIL image."""
    from PIL import Image

    if isinstance(spec, dict):
        if "url" not in spec:
            raise RequestError("invalid_image", "an image object needs a 'url' field", param)
        return resolve_image(spec["url"], _join(param, "url"))
    if not isinstance(spec, str) or not spec.strip():
        raise RequestError("invalid_image", "an image must be a URL, a data URI or base64 text", param)
    spec = spec.strip()
    if spec.startswith(("http://", "https://")):
        import urllib.request

        try:
            with urllib.request.urlopen(spec, timeout=20) as response:
                data = response.read(64 * 1024 * 1024 + 1)
        except Exception:
            raise RequestError("fetch_failed", "the image URL could not be fetched", param) from None
    else:
        if spec.startswith("data:"):
            header, _, spec = spec.partition(",")
            if ";base64" not in header:
                raise RequestError("invalid_image", "only base64 data URIs are supported", param)
        try:
            data = base64.b64decode(spec, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("invalid_base64", "the image is not valid base64", param) from None
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except Exception:
        raise RequestError("invalid_image_format", "the image could not be decoded", param) from None


# =================================================================================================
# Family adapters
# =================================================================================================

# A request, once validated, is a list of turns; each turn holds text and PIL images in order.


@dataclasses.dataclass
class Turn:
    role: str
    parts: list  # str or PIL.Image.Image, in order


@dataclasses.dataclass
class GenerationParams:
    max_new_tokens: int
    temperature: float
    top_p: float
    do_sample: bool
    min_new_tokens: int = 0

    @property
    def group_key(self) -> tuple:
        """Items that share this key can run in one padded batch."""
        if not self.do_sample:
            return (False,)
        return (True, self.temperature, self.top_p)


@dataclasses.dataclass
class Prepared:
    """One validated item, ready for the engine."""

    task: str
    turns: list[Turn]
    params: GenerationParams
    grounding_target: Optional[str] = None

    @property
    def images(self) -> list:
        return [p for t in self.turns for p in t.parts if not isinstance(p, str)]


@dataclasses.dataclass
class Generation:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    raw_text: Optional[str] = None  # with special tokens, for box parsing


class FamilyAdapter:
    """How one model family turns turns into prompts, and which prompts it uses for tasks."""

    name = "generic"
    native = True  # loads with AutoProcessor + AutoModelForImageTextToText, no remote code
    grounding: Optional[str] = None  # coordinate system of boxes: "qwen-1000", "qwen-abs-pixels", None
    quantization_skip_modules: tuple[str, ...] = ()
    supports_system_role = True
    static_cache = True

    def grounding_prompt(self, target: str) -> str:
        return f"Locate {target} in the image and give its bounding box as [x1, y1, x2, y2]."

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        """Turns in the format processors' chat templates take: images become {"type": "image"}."""
        messages = []
        pending_system = []
        for turn in turns:
            content = [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in turn.parts
            ]
            if turn.role == "system" and not self.supports_system_role:
                pending_system.extend(content)
                continue
            if pending_system and turn.role == "user":
                content = pending_system + content
                pending_system = []
            messages.append({"role": turn.role, "content": content})
        return messages

    def prompt(self, processor, turns: list[Turn]) -> str:
        return processor.apply_chat_template(
            self.chat_messages(turns), add_generation_prompt=True, tokenize=False
        )

    def processor_kwargs(self, settings: Settings) -> dict:
        return {}


class QwenVLAdapter(FamilyAdapter):
    name = "qwen2-vl"
    grounding = "qwen-1000"
    quantization_skip_modules = ("model.visual", "lm_head")

    def grounding_prompt(self, target: str) -> str:
        return f"Find <|object_ref_start|>{target}<|object_ref_end|>"

    def processor_kwargs(self, settings: Settings) -> dict:
        kwargs = {}
        if settings.min_pixels:
            kwargs["min_pixels"] = settings.min_pixels
        if settings.max_pixels:
            kwargs["max_pixels"] = settings.max_pixels
        return kwargs


class Qwen25VLAdapter(QwenVLAdapter):
    name = "qwen2.5-vl"
    grounding = "qwen-abs-pixels"

    def grounding_prompt(self, target: str) -> str:
        return f"Locate {target} in the image, and output its bbox coordinates in JSON format."


class LlavaAdapter(FamilyAdapter):
    name = "llava"
    quantization_skip_modules = ("model.vision_tower", "model.multi_modal_projector", "lm_head")


class LlavaNextAdapter(LlavaAdapter):
    name = "llava-next"


class RemoteCodeAdapter(FamilyAdapter):
    """Families served through their repository's own code (trust_remote_code), one item at a time."""

    native = False
    static_cache = False

    def load(self, path: str, load_kwargs: dict):
        from transformers import AutoModel, AutoTokenizer

        model = AutoModel.from_pretrained(path, **load_kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        return model, tokenizer

    def run(self, model, processor, item: Prepared, sampling: dict) -> Generation:
        raise NotImplementedError


class MiniCPMVAdapter(RemoteCodeAdapter):
    """openbmb/MiniCPM-V-2_6: `model.chat(image=None, msgs=[...], tokenizer=...)` per its card."""

    name = "minicpm-v"
    quantization_skip_modules = ("vpm", "resampler", "lm_head")

    def run(self, model, tokenizer, item, sampling):
        msgs, system = [], None
        for turn in item.turns:
            if turn.role == "system":
                system = " ".join(p for p in turn.parts if isinstance(p, str))
                continue
            msgs.append({"role": turn.role, "content": list(turn.parts)})
        kwargs = dict(image=None, msgs=msgs, tokenizer=tokenizer, **sampling)
        if system:
            kwargs["system_prompt"] = system
        text = model.chat(**kwargs)
        return _remote_generation(tokenizer, text, item.params.max_new_tokens)


class Phi3VisionAdapter(RemoteCodeAdapter):
    """microsoft/Phi-3-vision-128k-instruct: `<|image_N|>` placeholders + its processor + generate."""

    name = "phi3-vision"
    quantization_skip_modules = ("model.vision_embed_tokens", "lm_head")

    def load(self, path, load_kwargs):
        from transformers import AutoModelForCausalLM, AutoProcessor

        model = AutoModelForCausalLM.from_pretrained(path, **load_kwargs).eval()
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
        return model, processor

    def chat_messages(self, turns):
        messages, index = [], 0
        for turn in turns:
            pieces = []
            for part in turn.parts:
                if isinstance(part, str):
                    pieces.append(part)
                else:
                    index += 1
                    pieces.append(f"<|image_{index}|>")
            messages.append({"role": turn.role, "content": "\n".join(pieces)})
        return messages

    def run(self, model, processor, item, sampling):
        import torch

        prompt = processor.tokenizer.apply_chat_template(
            self.chat_messages(item.turns), tokenize=False, add_generation_prompt=True
        )
        inputs = processor(prompt, item.images or None, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            out = model.generate(
                **inputs, eos_token_id=processor.tokenizer.eos_token_id, **sampling
            )
        new_tokens = out[0, inputs["input_ids"].shape[1]:]
        ids = new_tokens.tolist()
        eos = {processor.tokenizer.eos_token_id}
        text = processor.tokenizer.decode(new_tokens, skip_special_tokens=True)
        return Generation(
            text=text.strip(),
            finish_reason=_finish_reason(ids, eos, item.params.max_new_tokens),
            prompt_tokens=int(inputs["input_ids"].shape[1]),
            completion_tokens=_trimmed_length(ids, eos),
        )


class InternVL2Adapter(RemoteCodeAdapter):
    """OpenGVLab/InternVL2-*: the card's dynamic 448px tiling, then `model.chat(...)`."""

    name = "internvl"
    quantization_skip_modules = ("vision_model", "mlp1", "lm_head")
    image_size = 448
    max_tiles = 12
    mean = (0.485, 0.456, 0.406)
    std = (0.229, 0.224, 0.225)

    def tiles(self, image) -> list:
        """The card's `dynamic_preprocess`: the closest aspect-ratio grid of 448px tiles + a thumbnail."""
        width, height = image.size
        aspect = width / height
        grids = sorted(
            {(i, j) for n in range(1, self.max_tiles + 1) for i in range(1, n + 1)
             for j in range(1, n + 1) if 1 <= i * j <= self.max_tiles},
            key=lambda g: g[0] * g[1],
        )
        best, best_diff, area = (1, 1), float("inf"), width * height
        for cols, rows in grids:
            diff = abs(aspect - cols / rows)
            if diff < best_diff or (
                diff == best_diff and area > 0.5 * self.image_size**2 * cols * rows
            ):
                best, best_diff = (cols, rows), diff
        cols, rows = best
        size = self.image_size
        resized = image.resize((size * cols, size * rows))
        tiles = [
            resized.crop(((k % cols) * size, (k // cols) * size,
                          (k % cols + 1) * size, (k // cols + 1) * size))
            for k in range(cols * rows)
        ]
        if len(tiles) > 1:
            tiles.append(image.resize((size, size)))
        return tiles

    def pixel_values(self, images, dtype, device):
        import torch
        from torchvision.transforms import functional as F

        per_image = []
        for image in images:
            tiles = [
                F.normalize(F.to_tensor(t), self.mean, self.std) for t in self.tiles(image)
            ]
            per_image.append(torch.stack(tiles))
        if not per_image:
            return None, []
        values = torch.cat(per_image).to(dtype=dtype, device=device)
        return values, [len(p) for p in per_image]

    def run(self, model, tokenizer, item, sampling):
        # InternVL2's chat takes one question plus (question, answer) history pairs.
        history, question_parts, pending = [], [], None
        for turn in item.turns:
            text = "\n".join(
                "<image>" if not isinstance(p, str) else p for p in turn.parts
            )
            if turn.role == "assistant" and pending is not None:
                history.append((pending, text))
                pending = None
            elif turn.role in ("user", "system"):
                pending = text if pending is None else f"{pending}\n{text}"
        question_parts = pending or ""
        values, num_patches = self.pixel_values(item.images, model.dtype, model.device)
        generation_config = dict(sampling)
        text = model.chat(
            tokenizer, values, question_parts, generation_config,
            num_patches_list=num_patches or None, history=history or None,
        )
        return _remote_generation(tokenizer, text, item.params.max_new_tokens)


def _remote_generation(tokenizer, text: str, max_new_tokens: int) -> Generation:
    """Remote-code chat() APIs return text only: count its tokens to tell `length` from `stop`."""
    count = len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
    return Generation(
        text=text.strip(),
        finish_reason="length" if count >= max_new_tokens else "stop",
        completion_tokens=count,
    )


ADAPTERS: dict[str, FamilyAdapter] = {
    a.name: a
    for a in (
        QwenVLAdapter(), Qwen25VLAdapter(), LlavaAdapter(), LlavaNextAdapter(),
        MiniCPMVAdapter(), Phi3VisionAdapter(), InternVL2Adapter(),
    )
}
FAMILY_BY_MODEL_TYPE = {
    "qwen2_vl": "qwen2-vl",
    "qwen2_5_vl": "qwen2.5-vl",
    "llava": "llava",
    "llava_next": "llava-next",
    "minicpmv": "minicpm-v",
    "phi3_v": "phi3-vision",
    "internvl_chat": "internvl",
}


def adapter_for(model_type: str) -> FamilyAdapter:
    """The adapter of a config's model_type; other native model types get the generic adapter."""
    family = FAMILY_BY_MODEL_TYPE.get(model_type)
    return ADAPTERS[family] if family else FamilyAdapter()


# =================================================================================================
# Model
# =================================================================================================


def _finish_reason(ids: list[int], eos: set, max_new_tokens: int) -> str:
    return "stop" if any(i in eos for i in ids) else ("length" if len(ids) >= max_new_tokens else "stop")


def _trimmed_length(ids: list[int], eos: set) -> int:
    for n, token in enumerate(ids):
        if token in eos:
            return n
    return len(ids)


class Engine:
    """The loaded model, its processor and family adapter. One per process."""

    def __init__(self, settings: Settings, quantize: Optional[str] = None):
        self.settings = settings
        self.model_id = settings.model
        self.quantize = quantize or settings.quantize
        self.lock = threading.Lock()
        self.load_seconds = 0.0
        self._load()

    # ---- loading ----------------------------------------------------------------------------

    def _check_allowed(self) -> None:
        if self.model_id in CURATED_MODELS or self.settings.allow_any:
            return
        raise SettingsError(
            f"VLM_MODEL={self.model_id!r} is not on the curated list "
            f"({', '.join(CURATED_MODELS)}); set VLM_ALLOW_ANY=true to serve it anyway"
        )

    def _torch_dtype(self):
        import torch

        choice = self.settings.dtype
        if choice == "auto":
            if torch.cuda.is_available():
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return torch.float32
        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[choice]

    def quantization_config(self, dtype):
        """bitsandbytes settings that keep the vision tower and projector in full precision."""
        if self.quantize == "none":
            return None
        from transformers import BitsAndBytesConfig

        skip = list(self.adapter.quantization_skip_modules)
        if self.quantize == "4bit":
            return BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype,
                llm_int8_skip_modules=skip,
            )
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)

    def _load(self) -> None:
        from transformers import AutoConfig

        self._check_allowed()
        started = time.perf_counter()
        trust = self.settings.trust_remote_code
        config = AutoConfig.from_pretrained(self.model_id, trust_remote_code=trust)
        self.model_type = config.model_type
        self.adapter = adapter_for(self.model_type)
        if not self.adapter.native and not trust:
            raise SettingsError(
                f"{self.model_id} ({self.adapter.name}) needs its repository's code: "
                "set VLM_TRUST_REMOTE_CODE=true"
            )
        dtype = self._torch_dtype()
        self.dtype = dtype
        load_kwargs = dict(dtype=dtype, device_map=self.settings.device_map, trust_remote_code=trust)
        quantization = self.quantization_config(dtype)
        if quantization is not None:
            load_kwargs["quantization_config"] = quantization
        if self.adapter.native:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            self.processor = AutoProcessor.from_pretrained(
                self.model_id, trust_remote_code=trust, **self.adapter.processor_kwargs(self.settings)
            )
            self.processor.tokenizer.padding_side = "left"
            self.model = AutoModelForImageTextToText.from_pretrained(
                self.model_id, **load_kwargs
            ).eval()
        else:
            self.model, self.processor = self.adapter.load(self.model_id, load_kwargs)
        self.eos_ids = self._eos_ids()
        self.load_seconds = time.perf_counter() - started
        log.info("loaded %s (%s) in %.1fs", self.model_id, self.adapter.name, self.load_seconds)

    def _eos_ids(self) -> set:
        ids = set()
        config_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (config_eos, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def compiled(self) -> bool:
        import torch

        return (
            self.settings.compile
            and self.quantize == "none"
            and self.adapter.static_cache
            and torch.cuda.is_available()
            and str(self.model.device).startswith("cuda")
        )

    # ---- generation -------------------------------------------------------------------------

    def sampling_kwargs(self, params: GenerationParams) -> dict:
        kwargs: dict = {"max_new_tokens": params.max_new_tokens, "do_sample": params.do_sample}
        if params.do_sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if params.min_new_tokens:
            kwargs["min_new_tokens"] = params.min_new_tokens
        return kwargs

    def generate(self, items: list[Prepared]) -> list[Generation]:
        """Generate for items that share sampling settings, as one left-padded batch."""
        with self.lock:
            if not self.adapter.native:
                return [
                    self.adapter.run(self.model, self.processor, item, self.sampling_kwargs(item.params))
                    for item in items
                ]
            return self._generate_native(items)

    def _generate_native(self, items: list[Prepared]) -> list[Generation]:
        import torch

        rows = len(items)
        # On the compiled path the batch is padded to a fixed size (copies of the last item, whose
        # answers are dropped) so that a new batch size never triggers a recompilation.
        padded = items + [items[-1]] * (self.row_bucket(rows) - rows)
        inputs = self.processor_inputs(padded)
        params = items[0].params
        max_new_tokens = max(item.params.max_new_tokens for item in items)
        min_new_tokens = [item.params.min_new_tokens for item in padded]
        with torch.inference_mode():
            if params.do_sample:
                tokens = self._sample(inputs, params, max_new_tokens, min_new_tokens)
            else:
                tokens = self.greedy_decode(inputs, max_new_tokens, min_new_tokens)
        attention = inputs["attention_mask"]
        results = []
        for row, item in enumerate(items):
            ids = tokens[row][: item.params.max_new_tokens]
            kept = ids[: _trimmed_length(ids, self.eos_ids)]
            results.append(
                Generation(
                    text=self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
                    raw_text=self.tokenizer.decode(kept, skip_special_tokens=False),
                    finish_reason=_finish_reason(ids, self.eos_ids, item.params.max_new_tokens),
                    prompt_tokens=int(attention[row].sum()),
                    completion_tokens=len(kept),
                )
            )
        return results

    def processor_inputs(self, items: list[Prepared]):
        """Chat-templated prompts and pixels for a batch, left-padded, on the model's device."""
        prompts = [self.adapter.prompt(self.processor, item.turns) for item in items]
        images = [item.images for item in items]
        kwargs: dict = {"text": prompts, "padding": True, "return_tensors": "pt"}
        if any(images):
            kwargs["images"] = images if len(items) > 1 else images[0]
        inputs = self.processor(**kwargs).to(self.model.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        return inputs

    # ---- decoding -----------------------------------------------------------------------------

    ROW_BUCKETS = (1, 4, 16, 64)
    CACHE_LEN_STEP = 256

    def row_bucket(self, rows: int) -> int:
        if not self.compiled:
            return rows
        return next((b for b in self.ROW_BUCKETS if b >= rows), rows)

    def cache_length(self, needed: int) -> int:
        """KV-cache length for a batch. Compiled: one length for all batches, grown (once, with a
        recompilation) only by a request longer than any before; eager: exactly what is needed."""
        if not self.compiled:
            return needed
        step = self.CACHE_LEN_STEP
        self._cache_len = max(getattr(self, "_cache_len", 0), self.settings.cache_len, -(-needed // step) * step)
        return self._cache_len

    def static_cache(self, rows: int, length: int):
        from transformers import StaticCache

        caches = getattr(self, "_caches", {})
        cache = caches.get((rows, length))
        if cache is None:
            caches = {key: c for key, c in caches.items() if key[1] == length}
            cache = caches[(rows, length)] = StaticCache(
                config=self.model.config.get_text_config(decoder=True), max_cache_len=length
            )
            self._caches = caches
        else:
            cache.reset()
        return cache

    def decode_step(self):
        """The model's forward for one new token per row; compiled with CUDA graphs when on GPU."""
        if self.compiled:
            if getattr(self, "_compiled_forward", None) is None:
                self._compiled_forward = self.model.get_compiled_call(None)
            return self._compiled_forward
        return self.model

    def greedy_decode(self, inputs, max_new_tokens: int, min_new_tokens: list[int]) -> list[list[int]]:
        """Greedy decoding over a static KV cache, without generate()'s per-step Python.

        Same tokens as `model.generate(do_sample=False)`: positions are continued from the
        prompt's exactly as generate continues them; the model's repetition penalty is applied."""
        import torch
        from transformers import RepetitionPenaltyLogitsProcessor

        model, device = self.model, self.model.device
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        rows, prompt_length = input_ids.shape
        length = self.cache_length(prompt_length + max_new_tokens)
        cache = self.static_cache(rows, length)
        model_inputs = dict(inputs)
        position_ids = model._prepare_position_ids_for_generation(input_ids, model_inputs)
        # A full-length mask of fixed shape: positions not yet written are hidden by causality.
        full_mask = torch.ones((rows, length), dtype=attention_mask.dtype, device=device)
        full_mask[:, :prompt_length] = attention_mask
        output = model(
            **model_inputs,
            position_ids=position_ids,
            past_key_values=cache,
            cache_position=torch.arange(prompt_length, device=device),
            use_cache=True,
            logits_to_keep=1,
        )
        penalty = getattr(model.generation_config, "repetition_penalty", None) or 1.0
        penalize = RepetitionPenaltyLogitsProcessor(penalty) if penalty != 1.0 else None
        history = torch.cat(
            [input_ids, torch.zeros((rows, max_new_tokens), dtype=input_ids.dtype, device=device)], dim=1
        )
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        min_new = torch.tensor(min_new_tokens, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        position = position_ids[..., -1:].clone()
        cache_position = torch.tensor([prompt_length], device=device)
        step_forward = self.decode_step()
        for step in range(max_new_tokens):
            logits = output.logits[:, -1, :].float()
            if penalize is not None:
                logits = penalize(history[:, : prompt_length + step], logits)
            if min_new_tokens and step < max(min_new_tokens) and len(eos):
                blocked = (step < min_new)[:, None] & torch.isin(
                    torch.arange(logits.shape[-1], device=device), eos
                )[None, :]
                logits = logits.masked_fill(blocked, float("-inf"))
            token = logits.argmax(dim=-1)
            history[:, prompt_length + step] = token
            finished |= torch.isin(token, eos)
            # Check for the end only every 16 tokens: each check waits for the GPU.
            if step + 1 == max_new_tokens or ((step + 1) % 16 == 0 and bool(finished.all())):
                break
            position += 1
            output = step_forward(
                input_ids=token[:, None],
                attention_mask=full_mask,
                position_ids=position,
                past_key_values=cache,
                cache_position=cache_position,
                use_cache=True,
                logits_to_keep=1,
            )
            cache_position += 1
        generated = history[:, prompt_length : prompt_length + step + 1]
        return generated.tolist()

    def _sample(self, inputs, params: GenerationParams, max_new_tokens: int, min_new_tokens: list[int]):
        kwargs = self.sampling_kwargs(params)
        kwargs.update(max_new_tokens=max_new_tokens, pad_token_id=self.tokenizer.pad_token_id)
        if self.compiled:
            kwargs.update(cache_implementation="static", max_cache_len=self.cache_length(
                inputs["input_ids"].shape[1] + max_new_tokens))
        if min_new_tokens and max(min_new_tokens):
            kwargs["min_new_tokens"] = max(min_new_tokens)
        output = self.model.generate(**inputs, **kwargs)
        return output[:, inputs["input_ids"].shape[1]:].tolist()

    def warm_up(self) -> float:
        """Compile and record every batch size at boot, so no request pays for it. Returns seconds."""
        if not self.compiled:
            return 0.0
        from PIL import Image

        started = time.perf_counter()
        image = Image.new("RGB", (448, 448), (127, 127, 127))
        params = GenerationParams(max_new_tokens=8, temperature=0.0, top_p=1.0, do_sample=False)
        for rows in self.ROW_BUCKETS:
            if rows > self.settings.max_batch_size:
                break
            item = Prepared("caption", [Turn("user", [image, TASK_PROMPTS["caption"]])], params)
            for _ in range(3):  # CUDA graphs are recorded on the second and third runs
                self.generate([item] * rows)
        self.warm_up_seconds = time.perf_counter() - started
        log.info("warmed up %d batch sizes in %.1fs", len(self.ROW_BUCKETS), self.warm_up_seconds)
        return self.warm_up_seconds


_engine: Optional[Engine] = None
_engine_lock = threading.Lock()


def get_engine(quantize: Optional[str] = None) -> Engine:
    """The process's engine, loaded on first use with `quantize` if the caller asked for one."""
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                _engine = Engine(Settings.from_env(), quantize=quantize)
    return _engine


def reset_engine() -> None:
    """Forget the loaded model (tests, and a worker that must reload)."""
    global _engine
    _engine = None


# =================================================================================================
# Tasks
# =================================================================================================

TASK_PROMPTS = {
    "caption": "Describe this image in one sentence.",
    "caption_long": "Describe this image in detail: the scene, the objects, their colours and any text.",
}
TASKS = ("chat", "caption", "caption_long", "vqa", "grounding")


class RequestModel(BaseModel):
    """The fields of one request; messages and images are checked by hand for precise paths."""

    model_config = ConfigDict(extra="forbid", strict=False)

    task: Optional[str] = None
    messages: Optional[Any] = None
    image_url: Optional[Any] = None
    image_b64: Optional[Any] = None
    images: Optional[Any] = None
    question: Optional[str] = None
    target: Optional[str] = None
    model: Optional[str] = None
    quantize: Optional[str] = None
    max_new_tokens: Optional[int] = Field(default=None, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    do_sample: bool = False
    batch_images: Optional[bool] = None

    @field_validator("task")
    @classmethod
    def _known_task(cls, value):
        if value is not None and value not in TASKS:
            raise ValueError(f"unknown task {value!r}; use one of {', '.join(TASKS)}")
        return value

    @field_validator("quantize")
    @classmethod
    def _known_quantize(cls, value):
        if value is not None and value not in QUANTIZE_CHOICES:
            raise ValueError(f"must be one of {', '.join(QUANTIZE_CHOICES)}")
        return value


def _pydantic_error(error: ValidationError, param: Optional[str]) -> RequestError:
    first = error.errors()[0]
    location = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    return RequestError("invalid_request", message, _join(param, location) if location else param)


def parse_request(raw: Any, settings: Settings, param: Optional[str] = None) -> tuple[RequestModel, Prepared]:
    """Validate one request dict into its fields and a Prepared item (images decoded)."""
    if not isinstance(raw, dict):
        raise RequestError("invalid_request", "must be a JSON object", param or "input")
    try:
        request = RequestModel.model_validate(raw)
    except ValidationError as error:
        raise _pydantic_error(error, param) from None
    task = request.task or ("chat" if request.messages is not None else None)
    if task is None:
        raise RequestError(
            "invalid_request", f"missing; use one of {', '.join(TASKS)} (or send messages)",
            _join(param, "task"),
        )
    max_new_tokens = request.max_new_tokens or settings.default_max_new_tokens
    if max_new_tokens > settings.max_new_tokens_cap:
        raise RequestError(
            "invalid_request",
            f"must be at most {settings.max_new_tokens_cap} on this worker",
            _join(param, "max_new_tokens"),
        )
    if request.do_sample and request.temperature == 0:
        raise RequestError(
            "invalid_request", "must be above 0 when do_sample is true", _join(param, "temperature")
        )
    params = GenerationParams(
        max_new_tokens=max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        do_sample=request.do_sample,
        min_new_tokens=min(request.min_new_tokens, max_new_tokens),
    )
    loose_images = _loose_images(request, settings, param)
    if task == "chat":
        if request.messages is None:
            raise RequestError("invalid_request", "required for the chat task", _join(param, "messages"))
        turns = parse_messages(request.messages, settings, _join(param, "messages"))
        if loose_images:
            first_user = next((t for t in turns if t.role == "user"), None)
            if first_user is None:
                raise RequestError(
                    "invalid_request", "images need a user message to attach to", _join(param, "messages")
                )
            first_user.parts[:0] = loose_images
        prepared = Prepared(task, turns, params)
    else:
        if request.messages is not None:
            raise RequestError(
                "invalid_request", f"not used by the {task} task; send task 'chat' instead",
                _join(param, "messages"),
            )
        if not loose_images:
            raise RequestError(
                "missing_image", f"the {task} task needs an image (image_url, image_b64 or images)",
                _join(param, "image_url"),
            )
        if task == "vqa":
            text = _required_text(request.question, _join(param, "question"), "the vqa task")
        elif task == "grounding":
            target = _required_text(request.target, _join(param, "target"), "the grounding task")
            text = ""  # the family's grounding prompt, filled in by the engine's adapter
        else:
            text = TASK_PROMPTS[task]
        turn = Turn("user", [*loose_images, text])
        prepared = Prepared(task, [turn], params, grounding_target=target if task == "grounding" else None)
    _check_request_limits(prepared, settings, param)
    return request, prepared


def _required_text(value: Optional[str], param: str, what: str) -> str:
    if value is None or not value.strip():
        raise RequestError("invalid_request", f"required for {what}", param)
    return value.strip()


def _loose_images(request: RequestModel, settings: Settings, param: Optional[str]) -> list:
    """Images given beside the prompt: image_url, image_b64 and images[...], in that order."""
    specs: list[tuple[Any, str]] = []
    if request.image_url is not None:
        specs.append((request.image_url, _join(param, "image_url")))
    if request.image_b64 is not None:
        specs.append((request.image_b64, _join(param, "image_b64")))
    if request.images is not None:
        if not isinstance(request.images, list):
            raise RequestError("invalid_request", "must be a list of images", _join(param, "images"))
        specs.extend((spec, _join(param, f"images[{i}]")) for i, spec in enumerate(request.images))
    if len(specs) > settings.max_images:
        raise RequestError(
            "too_many_images", f"at most {settings.max_images} images per request",
            _join(param, "images"),
        )
    return [resolve_image(spec, where) for spec, where in specs]


def parse_messages(messages: Any, settings: Settings, param: str) -> list[Turn]:
    """OpenAI-style messages -> turns. Image blocks of every accepted shape are decoded here."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("invalid_request", "must be a non-empty list of messages", param)
    if len(messages) > settings.max_messages:
        raise RequestError(
            "invalid_request", f"at most {settings.max_messages} messages per request", param
        )
    turns, image_count = [], 0
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise RequestError("invalid_request", "must be an object with role and content", where)
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise RequestError(
                "invalid_request", "must be system, user or assistant", f"{where}.role"
            )
        content = message.get("content")
        if isinstance(content, str):
            parts = [content]
        elif isinstance(content, list) and content:
            parts = []
            for j, block in enumerate(content):
                part = _parse_block(block, f"{where}.content[{j}]")
                if not isinstance(part, str):
                    image_count += 1
                    if image_count > settings.max_images:
                        raise RequestError(
                            "too_many_images", f"at most {settings.max_images} images per request",
                            f"{where}.content[{j}]",
                        )
                parts.append(part)
        else:
            raise RequestError(
                "invalid_request", "must be a string or a non-empty list of blocks", f"{where}.content"
            )
        if role != "user" and any(not isinstance(p, str) for p in parts):
            raise RequestError("invalid_request", "images are allowed in user messages only", f"{where}.content")
        turns.append(Turn(role, parts))
    if turns[-1].role != "user":
        raise RequestError("invalid_request", "the last message must come from the user", f"{param}[{len(turns) - 1}].role")
    return turns


def _parse_block(block: Any, where: str):
    if not isinstance(block, dict):
        raise RequestError("invalid_request", "a content block must be an object with a type", where)
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise RequestError("invalid_request", "a text block needs a string 'text'", f"{where}.text")
        return text
    if kind == "image_url":
        if "image_url" not in block:
            raise RequestError("invalid_request", "an image_url block needs 'image_url'", f"{where}.image_url")
        return resolve_image(block["image_url"], f"{where}.image_url")
    if kind == "image":
        if "image" not in block:
            raise RequestError("invalid_request", "an image block needs 'image'", f"{where}.image")
        return resolve_image(block["image"], f"{where}.image")
    raise RequestError("invalid_request", "type must be text, image_url or image", f"{where}.type")


def _check_request_limits(item: Prepared, settings: Settings, param: Optional[str]) -> None:
    text = sum(len(p) for t in item.turns for p in t.parts if isinstance(p, str))
    if text > settings.max_text_chars:
        raise RequestError(
            "text_too_long", f"the request's text is over {settings.max_text_chars} characters", param or "input"
        )
    pixels = sum(image.width * image.height for image in item.images)
    if pixels > settings.max_total_pixels:
        raise RequestError(
            "image_too_large",
            f"the request's images hold over {settings.max_total_pixels} pixels together",
            param or "input",
        )


# ---- parsing boxes ------------------------------------------------------------------------------

_NUMBER = r"-?\d+(?:\.\d+)?"
_BOX_PATTERNS = (
    # {"bbox": [...]} / {"bbox_2d": [...]}
    re.compile(rf'"bbox(?:_2d)?"\s*:\s*\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]'),
    # (x1,y1),(x2,y2), with or without Qwen's <|box_start|> tokens
    re.compile(rf"\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)\s*,?\s*\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)"),
    # [x1, y1, x2, y2]
    re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]"),
    # a plain quartet of numbers
    re.compile(rf"({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})"),
)


def parse_bbox(text: str) -> Optional[list[float]]:
    """The first box in a model's answer, as [x1, y1, x2, y2] in the model's own coordinates."""
    for pattern in _BOX_PATTERNS:
        match = pattern.search(text or "")
        if match:
            x1, y1, x2, y2 = (float(v) for v in match.groups())
            return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]
    return None


def box_to_pixels(box: list[float], system: Optional[str], size: tuple[int, int],
                  input_size: Optional[tuple[int, int]] = None) -> list[int]:
    """Scale a box from the model's coordinate system to the original image's pixels, clamped."""
    width, height = size
    if system == "qwen-1000":
        sx, sy = width / 1000, height / 1000
    elif system == "qwen-abs-pixels" and input_size:
        sx, sy = width / input_size[0], height / input_size[1]
    elif max(box) <= 1.0:
        sx, sy = width, height
    else:
        sx = sy = 1.0
    x1, y1, x2, y2 = box
    return [
        int(round(min(max(x1 * sx, 0), width))), int(round(min(max(y1 * sy, 0), height))),
        int(round(min(max(x2 * sx, 0), width))), int(round(min(max(y2 * sy, 0), height))),
    ]


def grounding_fields(item: Prepared, generation: Generation, adapter: FamilyAdapter) -> dict:
    fields: dict = {"bbox": None, "supports_grounding": adapter.grounding is not None}
    if adapter.grounding is None:
        fields["bbox_warning"] = f"the {adapter.name} family has no grounding output; see response"
        return fields
    box = parse_bbox(generation.raw_text or generation.text)
    if box is None:
        fields["bbox_warning"] = "no bounding box found in the model's answer"
        return fields
    image = item.images[0]
    fields["bbox"] = box_to_pixels(box, adapter.grounding, image.size, getattr(image, "model_input_size", None))
    return fields


# =================================================================================================
# Batching
# =================================================================================================


def run_prepared(engine: Engine, items: list[Prepared]) -> list[Any]:
    """Run prepared items in batches of matching sampling settings; results in input order.

    A batch that fails is retried item by item, so one bad item never sinks its neighbours."""
    results: list[Any] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    for index, item in enumerate(items):
        if item.task == "grounding":
            item.turns[-1].parts[-1] = engine.adapter.grounding_prompt(item.grounding_target)
        groups.setdefault(item.params.group_key, []).append(index)
    size = engine.settings.max_batch_size
    for indices in groups.values():
        for start in range(0, len(indices), size):
            chunk = indices[start:start + size]
            try:
                generations = engine.generate([items[i] for i in chunk])
            except Exception:
                if len(chunk) == 1:
                    log.exception("generation failed")
                    generations = [RequestError("generation_failed", "the model could not answer this request")]
                else:
                    generations = [_generate_one(engine, items[i]) for i in chunk]
            for i, generation in zip(chunk, generations):
                results[i] = generation
    return results


def _generate_one(engine: Engine, item: Prepared):
    try:
        return engine.generate([item])[0]
    except Exception:
        log.exception("generation failed")
        return RequestError("generation_failed", "the model could not answer this request")


def format_output(engine: Engine, item: Prepared, generation: Generation, request: RequestModel) -> dict:
    output = {
        "response": generation.text,
        "model": engine.model_id,
        "task": item.task,
        "image_count": len(item.images),
        "finish_reason": generation.finish_reason,
        "usage": {
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
        },
    }
    if item.task == "grounding":
        output.update(grounding_fields(item, generation, engine.adapter))
    if request.batch_images is not None:
        output["batch_images"] = request.batch_images
    if request.quantize is not None and request.quantize != engine.quantize:
        output["quantize"] = engine.quantize
        output["quantize_warning"] = (
            f"the model was loaded as {engine.quantize!r}; the requested {request.quantize!r} "
            "applies only when a request loads the model"
        )
    return output


def _check_model(request: RequestModel, model_id: str, param: Optional[str]) -> None:
    if request.model is not None and request.model != model_id:
        raise RequestError(
            "model_mismatch",
            f"this worker serves {model_id}; it cannot switch to {request.model!r}",
            _join(param, "model"),
        )


# =================================================================================================
# Entry point
# =================================================================================================


def handler(job: dict) -> dict:
    """RunPod entry: one request, or {"requests": [...]} answered item by item."""
    try:
        payload = job.get("input") if isinstance(job, dict) else None
        if not isinstance(payload, dict):
            raise RequestError("invalid_request", "the job needs an 'input' object", "input")
        if "requests" in payload:
            return _handle_batch(job, payload)
        return _handle_single(payload)
    except RequestError as error:
        return error.to_dict()
    except SettingsError as error:
        log.error("settings: %s", error)
        return {"error": f"worker misconfigured: {error}", "code": "worker_misconfigured", "param": None}
    except Exception:
        log.exception("unexpected failure")
        return {"error": "internal error while answering this request", "code": "internal_error", "param": None}


def _handle_single(payload: dict) -> dict:
    settings = _engine.settings if _engine is not None else Settings.from_env()
    model_id = _engine.model_id if _engine is not None else settings.model
    request, item = parse_request(payload, settings)
    _check_model(request, model_id, None)
    engine = get_engine(request.quantize)
    result = run_prepared(engine, [item])[0]
    if isinstance(result, RequestError):
        raise result
    return format_output(engine, item, result, request)


def _handle_batch(job: dict, payload: dict) -> dict:
    extra = set(payload) - {"requests"}
    if extra:
        raise RequestError("invalid_request", "unknown field beside 'requests'", sorted(extra)[0])
    raw_items = payload["requests"]
    settings = _engine.settings if _engine is not None else Settings.from_env()
    model_id = _engine.model_id if _engine is not None else settings.model
    if not isinstance(raw_items, list) or not raw_items:
        raise RequestError("invalid_request", "must be a non-empty list of requests", "requests")
    if len(raw_items) > settings.max_batch_requests:
        raise RequestError(
            "too_many_requests", f"at most {settings.max_batch_requests} requests per call", "requests"
        )
    results: list[Any] = [None] * len(raw_items)
    parsed: list[tuple[int, RequestModel, Prepared]] = []
    for index, raw in enumerate(raw_items):
        param = f"requests[{index}]"
        try:
            request, item = parse_request(raw, settings, param)
            _check_model(request, model_id, param)
            parsed.append((index, request, item))
        except RequestError as error:
            results[index] = error.to_dict()
    if parsed:
        quantize = next((r.quantize for _, r, _ in parsed if r.quantize), None)
        engine = get_engine(quantize)
        generations = run_prepared(engine, [item for _, _, item in parsed])
        for (index, request, item), generation in zip(parsed, generations):
            if isinstance(generation, RequestError):
                results[index] = generation.to_dict()
            else:
                results[index] = format_output(engine, item, generation, request)
    return {"model": model_id, "count": len(results), "id": job.get("id"), "results": results}


def main() -> None:
    import runpod

    logging.basicConfig(level=os.environ.get("VLM_LOG_LEVEL", "INFO"))
    get_engine()  # load before taking jobs, so the first user is not charged the load
    runpod.serverless.start({"handler": handler})


if __name__ == "__main__":
    main()
