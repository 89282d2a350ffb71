"""The compiled decode step and vision blocks (regional compilation), and the compile-artifact cache."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Any, Optional

from runpod_vlm.engine.loading import RUNPOD_VOLUME
from runpod_vlm.engine.memory import text_model
from runpod_vlm.settings import Settings

log = logging.getLogger("runpod-vlm")


# README "Cold start". The compile artifacts are torch's "mega-cache" bundle, in a file named by the
# cache key. Torch checks its checksum and unpickles it: the folder must be the operator's own.

COMPILE_ARTIFACTS_SUFFIX = ".torch-artifacts"
_reported_unwritable: set = set()  # folders already reported as unwritable, one log line each


def runtime_fingerprint() -> dict:
    """What compiled code depends on besides the model: library versions and the GPU."""
    import importlib.metadata
    import platform

    import torch
    import transformers

    gpu = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": next((d.version for d in importlib.metadata.distributions(name="triton")), None),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "capability": "{}.{}".format(*torch.cuda.get_device_capability()) if gpu else None,
    }


def compile_cache_key(
    model_id: str,
    *,
    config: Any = None,
    revision: Optional[str] = None,
    dtype: Any = None,
    shapes: Any = (),
    runtime: Optional[dict] = None,
) -> str:
    """A readable file name that changes with the model, dtype, compiled shapes and `runtime` (this process's)."""
    runtime = runtime_fingerprint() if runtime is None else runtime
    identity = dict(model=model_id, revision=revision, config=config, dtype=dtype, shapes=shapes, runtime=runtime)

    def plain(value: Any) -> Any:  # what json cannot write: sets (in order), configs, dtypes
        if isinstance(value, (set, frozenset)):
            return sorted(value, key=repr)
        return value.to_dict() if hasattr(value, "to_dict") else str(value)

    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=plain).encode()).hexdigest()[:24]
    parts = [model_id, runtime.get("gpu"), f"torch-{runtime.get('torch')}", digest]
    return "__".join(re.sub(r"[^A-Za-z0-9.+-]+", "_", str(part)).strip("_")[:80] or "none" for part in parts)


def compile_artifact_dirs(settings: Settings, env: Optional[dict] = None) -> list[str]:
    """Artifact folders, preferred first: VLM_COMPILE_CACHE_DIR, else the network volume's; then the container's."""
    env = os.environ if env is None else env
    container = os.path.join(env.get("HF_HOME") or os.path.expanduser("~/.cache/runpod-vlm"), "compile-cache")
    if (env.get("VLM_COMPILE_CACHE_DIR") or "").strip():
        return list(dict.fromkeys([settings.compile_cache_dir, container]))
    volume = [os.path.join(RUNPOD_VOLUME, "vlm-compile-cache")] if os.path.isdir(RUNPOD_VOLUME) else []
    return [*volume, container]


def _first_writable(folders: list[str]) -> Optional[str]:
    """The first of `folders` (made if absent) that takes a file; each that does not is logged once."""
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()  # a read-only volume refuses to make a file
            return folder
        except OSError as error:
            if folder not in _reported_unwritable:
                _reported_unwritable.add(folder)
                log.warning("compile cache: cannot write to %s (%s)", folder, error)
    return None


def set_torch_cache_dirs(settings: Settings, env: Optional[dict] = None) -> None:
    """Unless already set, put inductor's and Triton's caches (where loaded artifacts are unpacked) in
    VLM_COMPILE_CACHE_DIR, else in the container's folder. Call before anything compiles."""
    if settings.compile_cache_dir:
        folder = _first_writable([settings.compile_cache_dir]) or compile_artifact_dirs(settings, env)[-1]
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(folder, "inductor"))
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(folder, "triton"))


def load_compile_artifacts(settings: Settings, key: str, env: Optional[dict] = None) -> bool:
    """Load the artifacts saved under `key` before anything compiles; True when loaded. Never raises."""
    import torch

    set_torch_cache_dirs(settings, env)
    folders = compile_artifact_dirs(settings, env)
    paths = [os.path.join(folder, key + COMPILE_ARTIFACTS_SUFFIX) for folder in folders]
    if not any(map(os.path.exists, paths)):
        log.info("compile cache: no artifacts for %s in %s; compiling from scratch", key, " or ".join(folders))
    for path in filter(os.path.exists, paths):
        try:
            with open(path, "rb") as f:
                payload = f.read()
            info = torch.compiler.load_cache_artifacts(payload)
            if info is None:  # torch logged why: its checksum or unpickling failed
                raise ValueError("torch refused it as corrupt or truncated")
        except Exception as error:
            log.warning("compile cache: ignored %s (%s: %s)", path, type(error).__name__, error)
            continue
        counts = ", ".join(f"{kind} {len(entries)}" for kind, entries in sorted(info.artifacts.items()))
        log.info("compile cache: loaded %s (%.1f MB; %s)", path, len(payload) / 1e6, counts or "empty")
        return True
    return False


def save_compile_artifacts(settings: Settings, key: str, env: Optional[dict] = None) -> Optional[str]:
    """Save what this process compiled under `key` in the first writable folder: the file, or None. Never raises."""
    import torch

    try:
        saved = torch.compiler.save_cache_artifacts()  # None when nothing was compiled
        folder = _first_writable(compile_artifact_dirs(settings, env)) if saved else None
        if folder is None:
            log.info("compile cache: nothing saved (%s)", "no folder writable" if saved else "nothing compiled")
            return None
        path = os.path.join(folder, key + COMPILE_ARTIFACTS_SUFFIX)
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(saved[0])
            os.replace(temporary, path)  # however many workers write, a reader sees one whole file
        except BaseException:
            os.unlink(temporary)
            raise
    except Exception as error:
        log.warning("compile cache: nothing saved (%s: %s)", type(error).__name__, error)
        return None
    log.info("compile cache: saved %s (%.1f MB)", path, len(saved[0]) / 1e6)
    return path


def model_view(model):
    """The model's module tree copied, weights and buffers shared: what a forward sets on a module (Qwen's
    rope_deltas at a prefill) stays apart, so the engine thread cannot change what the compile's guards read."""
    view = copy.copy(model)
    view.__dict__.pop("forward", None)  # one set on the module (the graphed vision tower's) runs the engine's module
    view.__dict__["_modules"] = {
        name: None if child is None else model_view(child) for name, child in model._modules.items()
    }
    return view


class _OneLayerCache:
    """A compiled decoder layer's cache: its own layer's keys/values whatever index it asks for (dynamo would make the
    index a constant, tracing every layer anew). Layers use nothing else of a cache (transformers 5.17)."""

    def __init__(self, layer):
        self.layer = layer

    def update(self, keys, values, layer_idx, *args, **kwargs):
        return self.layer.update(keys, values, *args, **kwargs)


def _run_layer(compiled_forward, layer, index: int, *args, past_key_values=None, **kwargs):
    if past_key_values is not None:
        past_key_values = _OneLayerCache(past_key_values.layers[index])
    return compiled_forward(layer, *args, past_key_values=past_key_values, **kwargs)


def decoder_layers(model) -> list:
    """The language model's decoder layers (`text_model(model).layers`: Llama 4's are inside its causal LM), or []."""
    decoder = text_model(model) if hasattr(model, "get_decoder") else None
    return list(getattr(decoder, "layers", None) or ())


def with_compiled_layers(view, **options):
    """`view` with its decoder layers compiled (regional compilation): one layer is traced and compiled per shape and
    runs for all, where compiling the whole unrolled model took 35-40 s a shape on the H200."""
    import torch

    layers = decoder_layers(view)
    if not layers:
        return torch.compile(view.__call__, dynamic=False, **options)
    for layer in layers:
        # The paged attention reads each layer's window from its step (`PagedStep.limits`); one value on every layer
        # of the view keeps Gemma 3's sliding and full layers one trace a shape (each its own past the recompile limit).
        if getattr(getattr(layer, "self_attn", None), "sliding_window", None) is not None:
            layer.self_attn.sliding_window = None
    # One compiled function per layer class: dynamo reuses a trace within one function only.
    compiled = {kind: torch.compile(kind.forward, dynamic=False, **options) for kind in set(map(type, layers))}
    for index, layer in enumerate(layers):
        layer.forward = functools.partial(_run_layer, compiled[type(layer)], layer, index)
    return view


def vision_blocks(model) -> list:
    """A packed vision tower's repeated blocks (`visual.blocks`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V), or []."""
    visual = getattr(getattr(model, "model", None), "visual", None) or getattr(model, "visual", None)
    return list(getattr(visual, "blocks", None) or ())


def dynamic_forwards(modules: list, **options) -> dict:
    """Each module class's forward compiled with dynamic shapes: one trace serves every module of the class (the
    vision blocks, the decoder layers of a prefill), and every count of images or tokens once it has met one (a
    vision tower compiled whole traced anew for each set of images)."""
    import torch

    return {kind: torch.compile(kind.forward, dynamic=True, **options) for kind in set(map(type, modules))}


# On the H200 (bench/profile.py --parts vision_blocks) 5,120 patches took 30 -> 20 ms compiled, 23,552
# 119 -> 78 ms; with every call compiled, a batch-1 448x448 image (1,024) was answered in 78 ms, not 54-62
# (not measured apart from other changes of the time): fewer patches stay eager.
COMPILED_FROM_PATCHES = 4096
# A prefill through the decoder layers (--parts prefill_layers, the engine thread's whole time): 97 to 2,057 tokens
# 25-32 ms either way (host-bound: a compiled layer's four graphs cost the host as much as the eager ops); 4,057
# tokens 38 -> 29 ms compiled, 8,057 78 -> 62 ms.
COMPILED_PREFILL_FROM_TOKENS = 3072


def compiled_or_eager(compiled_forward, module, smallest: int, hidden_states, *args, **kwargs):
    import torch

    if hidden_states.numel() < smallest * hidden_states.shape[-1]:  # fewer patches or tokens than `smallest`
        return type(module).forward(module, hidden_states, *args, **kwargs)
    # A shape the compile thread did not meet runs eagerly: compiling it here would stall every row for seconds.
    with torch.compiler.set_stance("eager_on_recompile"):
        return compiled_forward(module, hidden_states, *args, **kwargs)


def _run(modules: list, forwards: dict, recompile: bool, smallest: int) -> None:
    for module in modules:
        forward = forwards[type(module)]
        module.forward = (
            functools.partial(forward, module)
            if recompile
            else functools.partial(compiled_or_eager, forward, module, smallest)
        )


def run_blocks_compiled(blocks: list, forwards: dict, recompile: bool = False) -> None:
    """`blocks` run `forwards` (`dynamic_forwards`) from now on, on `COMPILED_FROM_PATCHES` patches or more;
    compiling new shapes only if `recompile` (the compile thread's warm-up, on any number of patches)."""
    _run(blocks, forwards, recompile, COMPILED_FROM_PATCHES)


def run_layers_compiled(layers: list, forwards: dict, recompile: bool = False) -> None:
    """The engine model's decoder `layers` run `forwards` (`dynamic_forwards`) from now on, for prefills and chunks
    of `COMPILED_PREFILL_FROM_TOKENS` tokens or more; compiling new shapes only if `recompile` (the compile thread's
    warm-up, on any number of tokens). A call the warm-up did not meet (`generate()`'s steps) runs eagerly."""
    _run(layers, forwards, recompile, COMPILED_PREFILL_FROM_TOKENS)
