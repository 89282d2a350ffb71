"""The deployment's settings: VLM_* environment variables, read once at boot."""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated, Literal, Optional

import pydantic.dataclasses
from pydantic import Field, ValidationError

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"


@dataclasses.dataclass(frozen=True)
class CuratedModel:
    family: str
    vram_gb: int  # approximate, bf16 weights plus a working margin
    license: str
    grounding: Optional[str] = None  # the box_format of its grounding answers; None: no boxes


CURATED_MODELS: dict[str, CuratedModel] = {
    "Qwen/Qwen2-VL-2B-Instruct": CuratedModel("qwen2-vl", 8, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen2-VL-7B-Instruct": CuratedModel("qwen2-vl", 20, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen2.5-VL-3B-Instruct": CuratedModel("qwen2.5-vl", 10, "Qwen Research License", "qwen-abs-pixels"),
    "Qwen/Qwen2.5-VL-7B-Instruct": CuratedModel("qwen2.5-vl", 20, "Apache-2.0", "qwen-abs-pixels"),
    "Qwen/Qwen3-VL-2B-Instruct": CuratedModel("qwen3-vl", 8, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen3-VL-4B-Instruct": CuratedModel("qwen3-vl", 12, "Apache-2.0", "qwen-1000"),
    "Qwen/Qwen3-VL-8B-Instruct": CuratedModel("qwen3-vl", 22, "Apache-2.0", "qwen-1000"),
    "google/gemma-3-4b-it": CuratedModel("gemma3", 12, "Gemma Terms of Use"),
    "google/gemma-3-12b-it": CuratedModel("gemma3", 30, "Gemma Terms of Use"),
    "google/paligemma2-3b-mix-448": CuratedModel("paligemma", 10, "Gemma Terms of Use", "paligemma-1024"),
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": CuratedModel("smolvlm", 3, "Apache-2.0"),
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": CuratedModel("smolvlm", 8, "Apache-2.0"),
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": CuratedModel("llava-onevision", 4, "Apache-2.0"),
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": CuratedModel("llava-onevision", 20, "Apache-2.0"),
    "OpenGVLab/InternVL3-2B-hf": CuratedModel("internvl-hf", 8, "MIT"),
    "OpenGVLab/InternVL3-8B-hf": CuratedModel("internvl-hf", 22, "MIT"),
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": CuratedModel("mistral3", 60, "Apache-2.0"),
    "zai-org/GLM-4.1V-9B-Thinking": CuratedModel("glm-4.1v", 24, "MIT", "glm-1000"),
    "microsoft/Phi-4-multimodal-instruct": CuratedModel("phi4-multimodal", 14, "MIT"),  # revision refs/pr/70
    "llava-hf/llava-1.5-7b-hf": CuratedModel("llava", 16, "Llama 2 Community License"),
    "llava-hf/llava-1.5-13b-hf": CuratedModel("llava", 30, "Llama 2 Community License"),
    "llava-hf/llava-v1.6-mistral-7b-hf": CuratedModel("llava-next", 18, "Apache-2.0"),
    "openbmb/MiniCPM-V-2_6": CuratedModel("minicpm-v", 20, "MiniCPM Model License"),
    "microsoft/Phi-3-vision-128k-instruct": CuratedModel("phi3-vision", 12, "MIT"),
    "OpenGVLab/InternVL2-8B": CuratedModel("internvl", 20, "MIT"),
}

QUANTIZE_CHOICES = ("none", "4bit", "8bit", "fp8")
DTYPE_CHOICES = ("auto", "fp16", "bf16", "fp32")


class SettingsError(RuntimeError):
    """A deployment setting is wrong: the operator's mistake, reported at load time."""


# Settings are pydantic dataclasses: the environment's text is parsed and bounded by their types.


def _from_env(cls, env: dict, names: dict[str, str]):
    """`cls` from the variables `names` maps its fields to (blank: the default); errors name the variable."""
    values = {field: env[name].strip() for field, name in names.items() if (env.get(name) or "").strip()}
    try:
        return cls(**values)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        name = names[first["loc"][0]]
        raise SettingsError(f"{name}={env[name]!r}: {first['msg']}") from None


_Lower = pydantic.BeforeValidator(lambda value: value.lower() if isinstance(value, str) else value)
_Seconds = Annotated[float, Field(gt=0, le=600)]

_Domains = pydantic.BeforeValidator(
    lambda value: (
        tuple(d.strip().strip(".").lower() for d in value.split(",") if d.strip().strip("."))
        if isinstance(value, str)
        else value
    )
)


@pydantic.dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """How images may reach the worker (README "Security"); part of Settings, read once at boot."""

    allow_internal: bool = False  # VLM_ALLOW_INTERNAL_URLS: http:// and internal addresses too
    allow_http: bool = False  # plain http:// alone (code only)
    allowed_domains: Annotated[tuple[str, ...], _Domains] = ()  # VLM_URL_ALLOWED_DOMAINS: suffix match
    trust_env_proxy: bool = False  # use HTTP(S)_PROXY / NO_PROXY
    fetch_timeout: _Seconds = 20.0  # a whole fetch, all hops
    fetch_deadline: _Seconds = 30.0  # all the fetches of one request
    max_image_bytes: pydantic.PositiveInt = 64 * 1024 * 1024  # downloaded or local file bytes
    max_base64_bytes: pydantic.PositiveInt = 16 * 1024 * 1024  # encoded length of base64 text
    max_image_pixels: pydantic.PositiveInt = 40_000_000  # width*height, from the header
    min_image_side: pydantic.PositiveInt = 8  # pixels, both sides
    media_dir: Optional[str] = None  # local files only from inside this folder

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> MediaPolicy:
        names = {f.name: f"VLM_{f.name.upper()}" for f in dataclasses.fields(cls) if f.name != "allow_http"}
        names.update(allow_internal="VLM_ALLOW_INTERNAL_URLS", allowed_domains="VLM_URL_ALLOWED_DOMAINS")
        return _from_env(cls, dict(os.environ if env is None else env), names)


@pydantic.dataclasses.dataclass(frozen=True)
class Settings:
    model: str = DEFAULT_MODEL
    quantize: Annotated[Literal[QUANTIZE_CHOICES], _Lower] = "none"
    dtype: Annotated[Literal[DTYPE_CHOICES], _Lower] = "auto"
    device_map: str = "auto"
    trust_remote_code: bool = True
    allow_any: bool = False
    max_new_tokens: pydantic.PositiveInt = 2048  # the most a request may ask for; every field is VLM_<NAME>
    default_max_new_tokens: pydantic.PositiveInt = 256
    max_batch_size: pydantic.PositiveInt = 256  # rows decoding together (continuous batching), as the KV pool allows
    max_concurrency: pydantic.PositiveInt = 256  # jobs this worker takes at once (RunPod concurrency_modifier)
    sync_interval: pydantic.PositiveInt = 8  # decode steps between looks at the tokens (admission, stops, streaming)
    stream_interval_ms: pydantic.NonNegativeInt = 50  # streamed jobs post at most this often
    load_at_boot: bool = True  # load and warm up before taking jobs; off: the first request loads
    shutdown_grace: pydantic.NonNegativeInt = 10  # seconds jobs in flight may still run after SIGTERM
    max_batch_requests: pydantic.PositiveInt = 64  # items in one {"requests": [...]} call
    max_images: pydantic.PositiveInt = 16  # per request
    max_total_pixels: pydantic.PositiveInt = 64_000_000  # decoded pixels per request, all images together
    max_videos: pydantic.PositiveInt = 2  # per request (the families that take video: README)
    max_video_seconds: Annotated[float, Field(gt=0)] = 120.0
    max_video_frames: Annotated[int, Field(ge=2)] = 32  # frames sampled from one video (the card's rule, capped)
    max_video_decoded_frames: Annotated[int, Field(ge=2)] = 8_000  # decoded for one request's videos together
    max_text_chars: pydantic.PositiveInt = 32_000  # all text of a request together
    max_schema_bytes: pydantic.PositiveInt = 65_536  # a response_format schema's JSON text
    schema_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0  # a new schema's grammar is built within this
    max_messages: pydantic.PositiveInt = 64
    max_choices: pydantic.PositiveInt = 8  # a request's `n`
    min_pixels: pydantic.NonNegativeInt = 0  # Qwen processors' visual-token bounds; 0 keeps the model's own
    max_pixels: pydantic.NonNegativeInt = 0
    compile: bool = True  # torch.compile + CUDA graphs for decoding (CUDA only, never bitsandbytes)
    preprocess_on_gpu: bool = True  # the Qwen family's processors finish on the GPU (resized on the host: same pixels)
    max_batch_tokens: Annotated[int, Field(ge=256)] = 8192  # prompt tokens per prefill; longer prompts go in chunks
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9  # of the GPU (or process cap): weights, KV, work
    image_cache_mb: pydantic.NonNegativeInt = 512  # vision-encoder outputs kept for images sent again; 0: off
    decoded_image_cache_mb: pydantic.NonNegativeInt = 256  # host memory: images sent again skip decoding; 0: off
    prefix_caching: bool = True  # full KV blocks of earlier prompts shared by a prompt that starts the same way
    kv_cache_tokens: pydantic.NonNegativeInt = 0  # the KV pool in tokens; 0: sized from free GPU memory (CPU: 32768)
    compile_cache_dir: str = ""  # compiled kernels kept here are reused by a restarted worker
    endpoint_type: Annotated[Literal["queue", "lb"], _Lower] = "queue"  # lb: an HTTP server (RunPod load balancing)
    api_key: str = Field(default="", repr=False)  # lb: requests must carry it (Bearer or X-Api-Key); "": none asked
    max_body_bytes: pydantic.PositiveInt = 30_000_000  # lb: a request body (RunPod's load balancer takes 30 MB)
    http_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0  # lb: a request's head, then its body, arrive within
    media: MediaPolicy = MediaPolicy()  # its own variables: see MediaPolicy.from_env

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> Settings:
        env = dict(os.environ if env is None else env)
        if not env.get("VLM_COMPILE_CACHE_DIR") and env.get("HF_HOME"):
            env["VLM_COMPILE_CACHE_DIR"] = os.path.join(env["HF_HOME"], "compile-cache")
        names = {f.name: f"VLM_{f.name.upper()}" for f in dataclasses.fields(cls) if f.name != "media"}
        return dataclasses.replace(_from_env(cls, env, names), media=MediaPolicy.from_env(env))
