"""The stubs of the stubbed suite (tests/support/) must not drift from the libraries they stand for.

tests/support/stubbed_api.py lists in STUBBED_API every torch/transformers attribute or call its fakes provide.
Here, on the real libraries (CPU, tiny random models), each entry must
  (a) resolve: name the same thing on real torch / torchvision / transformers, and
  (b) be exercised: the real worker (handler.py and runpod_vlm/), answering real requests, reaches it.
So an entry the engine no longer uses (the stub went stale) or one the fakes invented fails here,
unless it is one of the documented exceptions below (remote code, CUDA only).

STUBBED_API is imported from support.stubbed_api, which installs nothing on import (its fixtures do, in
test_handler.py's own process). "Exercised" means used by the worker's own code (the direct
caller's frame is in handler.py or runpod_vlm/), not somewhere inside transformers: counting wrappers are put, with
monkeypatch, on
  - module attributes ("torch.zeros", "transformers.StaticCache"): the module's class is swapped
    for a recording subclass; functions are recorded when called, classes and constants when read;
  - torch.Tensor members: the methods/properties/dunders themselves are wrapped on torch.Tensor;
  - class members: classmethods and dunders are wrapped on the class (and on loaded subclasses
    that override them); other members (methods, properties, instance attributes such as
    `model.config` or `output.logits`) through a recording __getattribute__/__setattr__.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from torch.utils._config_module import ConfigModule

import handler
import runpod_vlm
from runpod_vlm.engine.loading import quantization_config
from runpod_vlm.engine.one_at_a_time import sampling_kwargs
from runpod_vlm.families.remote import InternVL2Adapter, MiniCPMVAdapter, Phi3VisionAdapter
from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn
from support.stubbed_api import STUBBED_API
from tools.sample_images import data_uri, plain, striped

# The worker's own code: handler.py and the runpod_vlm package.
WORKER_FILES = (handler.handler.__code__.co_filename, os.path.dirname(runpod_vlm.__file__) + os.sep)

# Entries that cannot be exercised here. Each needs a one-line reason; a new STUBBED_API entry
# that the engine does not exercise fails unless it is added here, by name, with its reason.
REMOTE_CODE = {
    "remote.MiniCPMV.chat": "MiniCPM-V's chat() is code from its hub repository (trust_remote_code), "
    "run by tests/test_remote_code_real.py on the legacy line only",
    "remote.InternVLChatModel.chat": "InternVL2's chat() is code from its hub repository (trust_remote_code), "
    "run by tests/test_remote_code_real.py on the legacy line only",
    "transformers.AutoModelForCausalLM.from_pretrained": "only Phi-3-vision loads through it, and only "
    "its remote code registers a vision model there",
}
# Reached only when torch.cuda.is_available(): they are exercised by the GPU benchmark
# (bench/harness.py), never on this CPU machine; here they must at least exist on real torch.
CUDA_ONLY = {
    "torch.cuda.is_bf16_supported": "asked only once torch.cuda.is_available() (dtype 'auto')",
    "torch.compile": "the decode forward is compiled only on a CUDA device",
    "torch._dynamo.config.patch": "the compile's trace limit, set only where the decode forward compiles",
    "torch.cuda.synchronize": "the background compile waits for its shadow decoder's steps, CUDA only",
    "torch.cuda.empty_cache": "called after a GPU out-of-memory error, CUDA only",
    "torch.cuda.CUDAGraph": "decode steps are captured as CUDA graphs only on a CUDA device",
    "torch.cuda.CUDAGraph.capture_begin": "decode steps are captured as CUDA graphs only on a CUDA device",
    "torch.cuda.CUDAGraph.capture_end": "decode steps are captured as CUDA graphs only on a CUDA device",
    "torch.cuda.Stream": "graph capture runs on a side stream, CUDA only",
    "torch.cuda.stream": "graph capture runs on a side stream, CUDA only",
    "torch.cuda.current_stream": "graph capture runs on a side stream, CUDA only",
    "torch.cuda.Stream.wait_stream": "graph capture runs on a side stream, CUDA only",
    "torch.cuda.Stream.synchronize": "the intake waits for images processed on its GPU stream, CUDA only",
    "torch.device": "the intake compares its pixels' device with the GPU it processes images on, CUDA only",
    "torch.cuda.CUDAGraph.replay": "decode steps replay CUDA graphs only on a CUDA device",
    "torch.cuda.get_device_properties": "the KV pool is sized from GPU memory only on a CUDA device",
    "torch.cuda.get_per_process_memory_fraction": "the KV pool is sized from GPU memory only on a CUDA device",
    "torch.cuda.mem_get_info": "the KV pool is sized from GPU memory only on a CUDA device",
    "torch.cuda.memory_allocated": "the KV pool is sized from GPU memory only on a CUDA device",
    "torch.cuda.memory_reserved": "the KV pool is sized from GPU memory only on a CUDA device",
    "torch.backends.cuda.enable_cudnn_sdp": "cuDNN's attention is left out only on a CUDA device",
}
# Tensor members recorded through a TorchFunctionMode rather than by wrapping them on torch.Tensor:
# a Python __getitem__ on torch.Tensor makes torch.tensor([0-d tensors...]) call len() on them.
VIA_TORCH_FUNCTION = {"__getitem__"}
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Names in the stubs' scheme that are not attributes of the top-level package.
ALIASES = {"transformers.ModelOutput": "transformers.utils.ModelOutput"}


# ---- resolving names ----------------------------------------------------------------------------

_MISSING = object()


def _import_path(dotted: str):
    """The object at a dotted path, importing submodules as needed; _MISSING if there is none."""
    dotted = ALIASES.get(dotted, dotted)
    head, *rest = dotted.split(".")
    obj = importlib.import_module(head)
    path = head
    for part in rest:
        path = f"{path}.{part}"
        value = getattr(obj, part, _MISSING)
        if value is _MISSING and isinstance(obj, types.ModuleType):
            try:
                value = importlib.import_module(path)
            except ImportError:
                value = _MISSING
        if value is _MISSING:
            return _MISSING
        obj = value
    return obj


@dataclasses.dataclass
class Entry:
    name: str
    owner: object  # a module or a class
    member: str


def split_entry(name: str) -> Entry:
    """'torch.zeros' -> (torch, 'zeros'); 'transformers.StaticCache.reset' -> (StaticCache, 'reset')."""
    parent, member = name.rsplit(".", 1)
    owner = _import_path(parent)
    if owner is _MISSING:
        raise LookupError(f"{parent} does not exist")
    if not isinstance(owner, (types.ModuleType, type)):
        raise LookupError(f"{parent} is neither a module nor a class")
    return Entry(name, owner, member)


# ---- recording ----------------------------------------------------------------------------------


def _from_handler(depth: int = 2) -> bool:
    """Whether the code `depth` frames up (1: the caller of the function calling this) is the worker's."""
    return sys._getframe(depth).f_code.co_filename.startswith(WORKER_FILES)


def _subclasses(cls: type) -> list:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


class Recorder:
    """Installs the counting wrappers (all undone by `patch`) and collects what handler.py used."""

    def __init__(self, entries: list[Entry], patch: pytest.MonkeyPatch):
        self.hits: set[str] = set()
        self.instances: dict[type, list] = {}  # real instances the hooks saw, a few per class
        self.patch = patch
        self.torch_function: dict = {}  # Tensor members recorded by the TorchFunctionMode instead
        modules: dict[types.ModuleType, dict] = {}
        attr_hooks: dict[type, dict] = {}
        for entry in entries:
            if isinstance(entry.owner, types.ModuleType):
                modules.setdefault(entry.owner, {})[entry.member] = entry.name
            elif entry.owner is torch.Tensor:
                self._wrap_tensor_member(entry)
            elif entry.member.startswith("__") or isinstance(
                inspect.getattr_static(entry.owner, entry.member, None), (classmethod, staticmethod)
            ):
                self._wrap_class_member(entry)
            else:
                attr_hooks.setdefault(entry.owner, {})[entry.member] = entry.name
        for module, names in modules.items():
            self._hook_module(module, names)
        self._hook_attributes(attr_hooks)

    def keep(self, owner: type, obj) -> None:
        kept = self.instances.setdefault(owner, [])
        if len(kept) < 8 and all(k is not obj for k in kept):
            kept.append(obj)

    def mode(self):
        """Records the Tensor members in VIA_TORCH_FUNCTION; enter it around the requests."""
        recorder = self

        class Recording(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                label = recorder.torch_function.get(func)
                if label is not None:
                    frame = sys._getframe(1)
                    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                        frame = frame.f_back
                    if frame is not None and frame.f_code.co_filename.startswith(WORKER_FILES):
                        recorder.hits.add(label)
                return func(*args, **(kwargs or {}))

        return Recording()

    def _hook_module(self, module: types.ModuleType, names: dict) -> None:
        recorder, base = self, type(module)
        original = base.__getattribute__

        def __getattribute__(self, attr):
            try:
                value = original(self, attr)
            except AttributeError:
                fallback = getattr(base, "__getattr__", None)  # transformers' lazy module
                if fallback is None:
                    raise
                value = fallback(self, attr)
            label = names.get(attr)
            if label is None or not _from_handler():
                return value
            if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):

                @functools.wraps(value)
                def called(*args, **kwargs):
                    recorder.hits.add(label)
                    return value(*args, **kwargs)

                return called
            recorder.hits.add(label)  # a class or a constant: reading it is the use
            return value

        if issubclass(base, ConfigModule):  # torch's config modules take no new attribute: their own class is theirs
            self.patch.setattr(base, "__getattribute__", __getattribute__)
            return
        recording = type(f"Recording{base.__name__}", (base,), {"__getattribute__": __getattribute__})
        self.patch.setattr(module, "__class__", recording)

    def _wrap_tensor_member(self, entry: Entry) -> None:
        recorder, original = self, inspect.getattr_static(torch.Tensor, entry.member)
        if entry.member in VIA_TORCH_FUNCTION:
            self.torch_function[original] = entry.name
            return
        if inspect.isdatadescriptor(original) and not callable(original):  # shape, dtype

            def get(tensor):
                if _from_handler():
                    recorder.hits.add(entry.name)
                return original.__get__(tensor, type(tensor))

            self.patch.setattr(torch.Tensor, entry.member, property(get))
            return

        def wrapper(tensor, *args, **kwargs):
            if _from_handler():
                recorder.hits.add(entry.name)
            return original(tensor, *args, **kwargs)

        self.patch.setattr(torch.Tensor, entry.member, functools.wraps(original)(wrapper))

    def _wrap_class_member(self, entry: Entry) -> None:
        recorder = self
        for cls in [entry.owner] + [s for s in _subclasses(entry.owner) if entry.member in s.__dict__]:
            original = inspect.getattr_static(cls, entry.member)
            if isinstance(original, (classmethod, staticmethod)):
                function, kind = original.__func__, type(original)

                def wrapper(*args, _function=function, **kwargs):
                    if _from_handler():
                        recorder.hits.add(entry.name)
                    return _function(*args, **kwargs)

                self.patch.setattr(cls, entry.member, kind(functools.wraps(function)(wrapper)))
            else:

                def wrapper(obj, *args, _original=original, **kwargs):
                    if _from_handler():
                        recorder.hits.add(entry.name)
                        recorder.keep(entry.owner, obj)
                    return _original(obj, *args, **kwargs)

                self.patch.setattr(cls, entry.member, functools.wraps(original)(wrapper))

    def _hook_attributes(self, hooks: dict[type, dict]) -> None:
        """Reads and writes of tracked members, on each class and on subclasses with their own hooks."""
        recorder = self
        tracked = set().union(*hooks.values()) if hooks else set()

        def record(obj, attr):
            for owner, names in hooks.items():
                if attr in names and isinstance(obj, owner):
                    recorder.hits.add(names[attr])
                    recorder.keep(owner, obj)

        for special in ("__getattribute__", "__setattr__"):
            targets = set(hooks)
            for owner in hooks:
                targets.update(s for s in _subclasses(owner) if special in s.__dict__)
            for cls in targets:
                original = inspect.getattr_static(cls, special)
                if special == "__getattribute__":

                    def hook(obj, attr, _original=original):
                        if attr in tracked and _from_handler():
                            record(obj, attr)
                        return _original(obj, attr)
                else:

                    def hook(obj, attr, value, _original=original):
                        if attr in tracked and _from_handler():
                            record(obj, attr)
                        return _original(obj, attr, value)

                self.patch.setattr(cls, special, hook)


# ---- the requests -------------------------------------------------------------------------------


def ask(payload: dict) -> dict:
    out = asyncio.run(handler.local_test_answer({"id": "honesty", "input": payload}))
    assert "error" not in out, out
    return out


class Phi3StyleProcessor:
    """Phi-3-vision's processor takes (text, images) positionally; this forwards to the tiny
    model's real processor, so Phi3VisionAdapter.run drives real tokenizer/generate calls."""

    def __init__(self, processor):
        self.processor, self.tokenizer = processor, processor.tokenizer

    def __call__(self, text, images=None, return_tensors=None):
        return self.processor(text=[text], images=images, return_tensors=return_tensors)


def run_everything(folder: Path, patch: pytest.MonkeyPatch) -> dict:
    """A representative set of real requests through handler.handler, plus the family adapters
    that only remote-code models reach, driven with real transformers objects. Returns what the
    adapters produced, for the behaviour assertions."""
    handler.reset_engine()
    engine = handler.get_engine()
    image = data_uri(striped((64, 48)))
    single = ask({"task": "caption", "image_url": image, "max_new_tokens": 3})
    assert single["usage"]["completion_tokens"] == 3
    sampled = ask(
        {
            "task": "vqa",
            "image_url": data_uri(plain("red")),
            "question": "Colour?",
            "do_sample": True,
            "temperature": 0.8,
            "top_p": 0.9,
            "max_new_tokens": 3,
            "min_new_tokens": 2,
        }
    )
    assert sampled["usage"]["completion_tokens"] >= 2
    batch = ask(
        {
            "requests": [
                {"task": "caption", "image_url": image, "max_new_tokens": 2},
                {"task": "caption", "image_url": image, "max_new_tokens": 2, "do_sample": True, "temperature": 1.0},
                {"messages": [{"role": "user", "content": "Hello?"}], "max_new_tokens": 2},
            ]
        }
    )
    assert batch["count"] == 3 and all("error" not in r for r in batch["results"]), batch
    grounding = ask({"task": "grounding", "image_url": image, "target": "the stripe", "max_new_tokens": 4})
    assert grounding["supports_grounding"] is True
    # A repetition penalty from the model's generation_config; a new length gives a new Decoder,
    # which reads the penalty when it is built.
    patch.setattr(engine.model.generation_config, "repetition_penalty", 1.3)
    penalized = ask({"task": "caption", "image_url": image, "max_new_tokens": 5})
    assert penalized["usage"]["completion_tokens"] == 5 and penalized["finish_reason"] == "length"
    # Long enough for the decode loop's periodic look for the end (every 16 tokens).
    long = ask({"task": "caption", "image_url": image, "max_new_tokens": 20, "min_new_tokens": 20})
    assert long["usage"]["completion_tokens"] == 20 and long["finish_reason"] == "length"
    # The bitsandbytes settings a 4-bit (and 8-bit) load would use, built by the engine's code.
    for quantize in ("4bit", "8bit"):
        config = quantization_config(quantize, engine.adapter, torch.float32)
        assert isinstance(config, transformers.BitsAndBytesConfig)
        assert config.llm_int8_skip_modules == list(engine.adapter.quantization_skip_modules)
        assert (config.load_in_4bit, config.load_in_8bit) == (quantize == "4bit", quantize == "8bit")

    # Remote-code families (MiniCPM-V, InternVL2, Phi-3-vision) run on transformers 4.45-4.48 only
    # (tests/test_remote_code_real.py): here their adapters run on the tiny model's real objects, with
    # only the remote-code `chat` stood in.
    results: dict = {}
    tokenizer = engine.tokenizer
    chats: list = []

    prompt = tokenizer("Describe.", return_tensors="pt")["input_ids"]
    answers: list = []

    def chat(*args, **kwargs):  # stands for remote.*.chat, which STUBBED_API lists as exceptions; like
        chats.append((args, kwargs))  # theirs, it calls its inner language model's generate() with embeddings
        ids = engine.model.generate(
            inputs_embeds=engine.model.get_input_embeddings()(prompt),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=sorted(engine.eos_ids),
        )[0].tolist()
        answers.append(ids)
        return tokenizer.decode(ids, skip_special_tokens=True)

    patch.setattr(engine.model, "chat", chat, raising=False)
    for inner in ("llm", "language_model"):  # MiniCPM-V's and InternVL2's inner language model
        patch.setattr(engine.model, inner, engine.model, raising=False)
    params = GenerationParams(max_new_tokens=4, temperature=0.0, top_p=1.0, do_sample=False)
    item = GenerationRequest("caption", [Turn("user", [striped((112, 56)), "Describe."])], params)
    results["internvl"] = InternVL2Adapter().run(engine.model, tokenizer, item, sampling_kwargs(params))
    results["internvl_chat"] = chats[-1]
    results["minicpm"] = MiniCPMVAdapter().run(engine.model, tokenizer, item, sampling_kwargs(params))
    results["remote_answers"], results["remote_prompt"], results["eos"] = answers, prompt, engine.eos_ids
    results["remote_load"] = MiniCPMVAdapter().load(
        str(folder), {"dtype": torch.float32, "device_map": "cpu", "trust_remote_code": False}
    )
    # Phi-3-vision: its real path is apply_chat_template + processor + model.generate; a text-only
    # item (its <|image_N|> placeholders are Phi-3's own) through the tiny model's tokenizer.
    if getattr(tokenizer, "chat_template", None) is None:
        patch.setattr(tokenizer, "chat_template", engine.processor.chat_template, raising=False)
    text_item = GenerationRequest("chat", [Turn("user", ["Hello there"])], params)
    results["phi3"] = Phi3VisionAdapter().run(
        engine.model, Phi3StyleProcessor(engine.processor), text_item, sampling_kwargs(params)
    )
    results["tokenizer"] = tokenizer
    return results


@pytest.fixture(scope="module")
def exercised(tiny_model):
    """(STUBBED_API, its entries, the recorder after the run, the adapters' results)."""
    api = STUBBED_API
    folder = tiny_model("qwen2-vl")
    entries, unresolved = [], {}
    for name in sorted(api):
        if name.startswith("remote."):  # names in no library: see REMOTE_CODE
            continue
        try:
            entries.append(split_entry(name))
        except LookupError as error:
            unresolved[name] = str(error)
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("VLM_")]:
            patch.delenv(key)
        patch.setenv("VLM_MODEL", str(folder))
        patch.setenv("VLM_ALLOW_ANY", "true")
        patch.setenv("VLM_DEVICE_MAP", "cpu")
        patch.setenv("VLM_DTYPE", "fp32")  # the engine's dtype table (fp16/bf16/fp32) is read
        # A first engine and request without wrappers: transformers imports the model's concrete
        # classes lazily, and their own overrides (processor __call__, config hooks) get wrapped too.
        handler.reset_engine()
        ask({"task": "caption", "image_url": data_uri(plain("blue")), "max_new_tokens": 1})
        try:
            recorder = Recorder([e for e in entries if e.name not in CUDA_ONLY and e.name not in REMOTE_CODE], patch)
            with recorder.mode():
                results = run_everything(folder, patch)
        finally:
            handler.reset_engine()
    return api, entries, unresolved, recorder, results


# ---- the tests ----------------------------------------------------------------------------------


def test_importing_the_fakes_installs_no_stub():
    before = {name: sys.modules.get(name) for name in ("torch", "transformers", "torchvision")}
    for name in [name for name in sys.modules if name.startswith("support.")]:
        sys.modules.pop(name)
    importlib.import_module("support.fixtures")  # every fake, through the fixtures' imports
    api = importlib.import_module("support.stubbed_api").STUBBED_API
    assert api == STUBBED_API and all(isinstance(name, str) and "." in name for name in api)
    assert {name: sys.modules.get(name) for name in before} == before  # no fake modules installed
    assert sys.modules["torch"] is torch and isinstance(torch.zeros(2), torch.Tensor)


def test_every_entry_resolves_on_the_real_libraries(exercised):
    api, entries, unresolved, recorder, _ = exercised
    problems = dict(unresolved)
    for entry in entries:
        if isinstance(entry.owner, types.ModuleType) or hasattr(entry.owner, entry.member):
            if getattr(entry.owner, entry.member, _MISSING) is _MISSING:
                problems[entry.name] = "missing on the module"
            continue
        # Instance attributes (model.config, output.logits, processor.tokenizer, ...): on the real
        # objects the handler used (or, for a model's generate, its concrete class).
        if not any(hasattr(obj, entry.member) for obj in recorder.instances.get(entry.owner, ())):
            problems[entry.name] = f"neither {entry.owner.__name__} nor a real instance of it has {entry.member!r}"
    assert not problems, f"STUBBED_API entries that name nothing real: {problems}"


def test_every_entry_is_exercised_by_the_real_engine(exercised):
    api, entries, unresolved, recorder, _ = exercised
    expected = {e.name for e in entries} - set(CUDA_ONLY) - set(REMOTE_CODE)
    missing = sorted(expected - recorder.hits)
    assert not missing, (
        "STUBBED_API lists these, but handler.py never used them while serving real requests on "
        f"the real engine (stale stubs, or add a documented exception): {missing}"
    )


def test_exceptions_are_documented_and_the_cuda_ones_exist():
    api = STUBBED_API
    for name in api:
        if name.startswith("remote."):
            assert REMOTE_CODE.get(name), f"{name}: a remote-code entry needs a reason in REMOTE_CODE"
    for name in set(CUDA_ONLY) & api:
        assert _import_path(name) is not _MISSING, f"{name} is not on the real torch"
    # Listed as CUDA only, these must still be real on this torch (for when the stubs list them).
    for name in CUDA_ONLY:
        assert _import_path(name) is not _MISSING, name


def test_the_remote_family_adapters_on_real_objects(exercised):
    """What the adapters made of real tokenizers and models, so the run above checks behaviour too."""
    *_, results = exercised
    tokenizer = results["tokenizer"]
    for family, ids in zip(("internvl", "minicpm"), results["remote_answers"]):
        generation, eos = results[family], results["eos"]
        kept = next((k for k, token in enumerate(ids) if token in eos), len(ids))  # counted from the ids
        assert generation.text == tokenizer.decode(ids, skip_special_tokens=True).strip()
        assert (generation.prompt_tokens, generation.completion_tokens) == (results["remote_prompt"].shape[1], kept)
        assert generation.finish_reason == ("stop" if kept < len(ids) else "length")
    (args, kwargs) = results["internvl_chat"]
    values = args[1]
    # 112x56 is a 2:1 image: two 448px tiles plus a thumbnail, normalised.
    assert tuple(values.shape) == (3, 3, 448, 448) and kwargs["num_patches_list"] == [3]
    assert values.dtype == torch.float32 and float(values.min()) < 0.0
    model, remote_tokenizer = results["remote_load"]
    assert not model.training and remote_tokenizer.eos_token_id == tokenizer.eos_token_id
    phi3 = results["phi3"]
    assert phi3.prompt_tokens > 0 and 0 <= phi3.completion_tokens <= 4
    assert phi3.finish_reason == ("length" if phi3.completion_tokens == 4 else "stop")
