"""Weights and model: where they come from (RunPod's cache), dtype, quantization, the loaded model."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from runpod_vlm.engine import decode_kernel
from runpod_vlm.families import adapter_for
from runpod_vlm.families.base import FamilyAdapter
from runpod_vlm.settings import CURATED_MODELS, Settings, SettingsError

log = logging.getLogger("runpod-vlm")

RUNPOD_VOLUME = "/runpod-volume"
RUNPOD_MODEL_CACHE = "/runpod-volume/huggingface-cache/hub"


def weights_source(model_id: str, hub_cache: str = RUNPOD_MODEL_CACHE) -> str:
    """Where to load `model_id` from, logged: a local folder, its complete snapshot in RunPod's cache, or the id."""
    from huggingface_hub import errors, snapshot_download

    if os.path.isdir(model_id):
        log.info("weights: %s is a local folder", model_id)
        return model_id
    snapshot = None
    try:
        snapshot = snapshot_download(model_id, cache_dir=hub_cache, local_files_only=True)
    except getattr(errors, "IncompleteSnapshotError", ()):  # huggingface_hub 1.x; the legacy line has 0.x
        pass
    except errors.LocalEntryNotFoundError:  # no refs/main: take the only snapshot, as RunPod's own look-up does
        folder = os.path.join(hub_cache, "models--" + model_id.replace("/", "--"), "snapshots")
        found = [entry.path for entry in os.scandir(folder) if entry.is_dir()] if os.path.isdir(folder) else []
        snapshot = found[0] if len(found) == 1 else None
    except (ValueError, OSError):  # not a valid repo id, or an unreadable tree
        pass
    missing = missing_model_files(snapshot) if snapshot else []
    if snapshot and not missing:
        log.info("weights: %s from RunPod's cached models (%s)", model_id, snapshot)
        return snapshot
    lacks = f" (RunPod's cached copy lacks {', '.join(missing)})" if missing else ""
    log.log(logging.WARNING if missing else logging.INFO, "weights: %s through HF_HOME or the hub%s", model_id, lacks)
    return model_id


def missing_model_files(folder: str) -> list[str]:
    """What of config.json, its index's shards and any weights a folder lacks (dangling links too)."""
    present = {entry.name for entry in os.scandir(folder) if entry.is_file()}
    needed = {"config.json"}
    for index in (name for name in present if name.endswith(".index.json")):
        try:
            with open(os.path.join(folder, index), encoding="utf-8") as f:
                needed.update(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            needed.add(f"{index} (unreadable)")
    if not any(name.endswith((".safetensors", ".bin")) for name in present):
        needed.add("weights (*.safetensors)")
    return sorted(needed - present)


@dataclasses.dataclass
class LoadedModel:
    model: Any
    processor: Any  # a processor, or a tokenizer for families whose card uses one alone
    adapter: FamilyAdapter
    model_type: str
    dtype: Any


def check_allowed(settings: Settings) -> None:
    if settings.model in CURATED_MODELS or settings.allow_any:
        return
    raise SettingsError(
        f"VLM_MODEL={settings.model!r} is not on the curated list "
        f"({', '.join(CURATED_MODELS)}); set VLM_ALLOW_ANY=true to serve it anyway"
    )


def torch_dtype(choice: str):
    """VLM_DTYPE as a torch dtype; auto: bf16 where the GPU supports it, else fp16 on a GPU, fp32 on the CPU."""
    import torch

    if choice == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[choice]


def quantization_config(quantize: str, adapter: FamilyAdapter, dtype):
    """bitsandbytes settings that keep the vision tower and projector in full precision (none for fp8: `engine.fp8`
    quantizes the loaded model)."""
    if quantize in ("none", "fp8"):
        return None
    from transformers import BitsAndBytesConfig

    skip = list(adapter.quantization_skip_modules)
    if quantize == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            llm_int8_skip_modules=skip,
        )
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)


def _on_cuda(settings: Settings) -> bool:
    import torch

    return torch.cuda.is_available() and settings.device_map in ("auto", "cuda", "cuda:0")


def load_model(settings: Settings, quantize: str) -> LoadedModel:
    """The model and processor of VLM_MODEL as its family's card loads them."""
    import transformers

    check_allowed(settings)
    trust = settings.trust_remote_code
    source = weights_source(settings.model)  # RunPod's cached copy when it has one
    config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=trust)
    adapter = adapter_for(config.model_type)
    if not adapter.native and not trust:
        raise SettingsError(
            f"{settings.model} ({adapter.name}) needs its repository's code: set VLM_TRUST_REMOTE_CODE=true"
        )
    dtype = torch_dtype(settings.dtype)
    if quantize == "fp8":
        check_fp8(settings, adapter)
    if _on_cuda(settings):
        import torch

        # cuDNN's attention builds a plan for each shape it meets first (0.07-1.6 s a prefill on the H200,
        # bench/results/profile-new-shapes-d279a0c.json), and a server's prefill shapes are nearly always new.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if adapter.native and _on_cuda(settings):
        decode_kernel.build_ahead(config, dtype)  # while the weights load
    # transformers 4.x (which the remote-code families need) calls the dtype `torch_dtype`.
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    load_kwargs = {dtype_key: dtype, "device_map": settings.device_map, "trust_remote_code": trust}
    quantization = quantization_config(quantize, adapter, dtype)
    if quantization is not None:
        load_kwargs["quantization_config"] = quantization
    if adapter.native:
        options = dict(trust_remote_code=trust, **adapter.processor_kwargs(settings))
        processor = transformers.AutoProcessor.from_pretrained(source, **options)
        processor.tokenizer.padding_side = "left"
        model = getattr(transformers, adapter.model_class).from_pretrained(source, **load_kwargs).eval()
    else:
        model, processor = adapter.load(source, load_kwargs)
    adapter.after_load(model, processor, source)
    if quantize == "fp8":
        from runpod_vlm.engine.fp8 import quantize_language_model

        quantize_language_model(model)
    return LoadedModel(model, processor, adapter, config.model_type, dtype)


def check_fp8(settings: Settings, adapter: FamilyAdapter) -> None:
    """FP8 weights need a native family (its decoder layers in the batch) on a GPU that multiplies float8."""
    if not adapter.native:
        raise SettingsError(f"VLM_QUANTIZE=fp8 is for the native families, not {adapter.name} (remote code)")
    if not _on_cuda(settings):
        raise SettingsError("VLM_QUANTIZE=fp8 needs a CUDA GPU; use none, 4bit or 8bit elsewhere")
    from runpod_vlm.engine.fp8 import MIN_CAPABILITY, fp8_supported

    if not fp8_supported("cuda"):
        import torch

        name, capability = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        raise SettingsError(
            f"VLM_QUANTIZE=fp8 needs a GPU that multiplies float8 (compute capability {MIN_CAPABILITY[0]}."
            f"{MIN_CAPABILITY[1]}+: L40S, RTX 4090, H100, H200); this {name} is {capability[0]}.{capability[1]}"
        )
