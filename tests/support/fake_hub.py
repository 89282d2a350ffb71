"""The scripted hub of the stubbed suite: a one-character-a-token tokenizer, processors, models that answer
`HUB.reply`, and the stub modules that stand for torch, transformers and the rest."""

from __future__ import annotations

import copy
import random
import types

from support.fake_torch import (
    BF16,
    BOOL,
    F16,
    F32,
    I64,
    FakeStream,
    FakeTensor,
    _device_name,
    cuda_current_stream,
    cuda_empty_cache,
    cuda_get_device_properties,
    cuda_get_per_process_memory_fraction,
    cuda_is_available,
    cuda_is_bf16_supported,
    cuda_mem_get_info,
    cuda_memory_allocated,
    cuda_memory_reserved,
    cuda_stream,
    cuda_synchronize,
    dynamo_config_patch,
    enable_cudnn_sdp,
    torch_arange,
    torch_cat,
    torch_compile,
    torch_device,
    torch_empty_like,
    torch_inference_mode,
    torch_no_grad,
    torch_softmax,
    torch_stack,
    torch_tensor,
    torch_where,
    torch_zeros,
    torch_zeros_like,
    tv_normalize,
    tv_to_tensor,
)
from support.stubbed_api import MISSING, _quiet, _use

# =================================================================================================
# The scripted hub: tokenizer, processor, models
# =================================================================================================

SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<image>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
]
SPECIAL_IDS = {s: i for i, s in enumerate(SPECIALS)}
PAD, EOS, END = SPECIAL_IDS["<pad>"], SPECIAL_IDS["</s>"], SPECIAL_IDS["<|end|>"]
CHAR_BASE = 100
VOCAB = CHAR_BASE + 128
FILLER = CHAR_BASE + ord("~")  # the fake model's second choice, picked when its first is forbidden


def encode_text(text: str) -> list:
    ids, i = [], 0
    while i < len(text):
        for special in SPECIALS:
            if text.startswith(special, i):
                ids.append(SPECIAL_IDS[special])
                i += len(special)
                break
        else:
            ch = text[i]
            ids.append(CHAR_BASE + (ord(ch) if ord(ch) < 128 else ord("?")))
            i += 1
    return ids


def decode(ids, skip_special_tokens=False) -> str:
    if isinstance(ids, FakeTensor):
        ids = ids._data
    out = []
    for t in ids:
        t = int(t)
        if t < len(SPECIALS):
            if not skip_special_tokens:
                out.append(SPECIALS[t])
        elif t < CHAR_BASE:
            out.append("\N{REPLACEMENT CHARACTER}")  # an id no text encodes to (sampling may pick one)
        else:
            out.append(chr(t - CHAR_BASE))
    return "".join(out)


def render(messages, add_generation_prompt: bool) -> str:
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            body = content
        else:
            body = "".join(b["text"] if b.get("type") == "text" else "<image>" for b in content)
        out.append(f"<|{message['role']}|>{body}<|end|>")
    if add_generation_prompt:
        out.append("<|assistant|>")
    return "".join(out)


def last_user_text(prompt: str) -> str:
    """The text of the last user turn of a rendered prompt, without image placeholders."""
    tail = prompt.rsplit("<|user|>", 1)[-1]
    return tail.split("<|end|>", 1)[0].replace("<image>", "")


MODEL_TYPES = {
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2_vl",
    "Qwen/Qwen2-VL-7B-Instruct": "qwen2_vl",
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2_5_vl",
    "llava-hf/llava-1.5-7b-hf": "llava",
    "llava-hf/llava-1.5-13b-hf": "llava",
    "llava-hf/llava-v1.6-mistral-7b-hf": "llava_next",
    "openbmb/MiniCPM-V-2_6": "minicpmv",
    "microsoft/Phi-3-vision-128k-instruct": "phi3_v",
    "OpenGVLab/InternVL2-8B": "internvl_chat",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "idefics3",
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen3-VL-2B-Instruct": "qwen3_vl",
    "Qwen/Qwen3-VL-4B-Instruct": "qwen3_vl",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl",
    "google/gemma-3-4b-it": "gemma3",
    "google/gemma-3-12b-it": "gemma3",
    "google/paligemma2-3b-mix-448": "paligemma",
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": "smolvlm",
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": "smolvlm",
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": "llava_onevision",
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": "llava_onevision",
    "OpenGVLab/InternVL3-2B-hf": "internvl",
    "OpenGVLab/InternVL3-8B-hf": "internvl",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": "mistral3",
    "zai-org/GLM-4.1V-9B-Thinking": "glm4v",
    "microsoft/Phi-4-multimodal-instruct": "phi4_multimodal",
}
NATIVE_TYPES = {
    "qwen2_vl",
    "qwen2_5_vl",
    "llava",
    "llava_next",
    "idefics3",
    "qwen3_vl",
    "gemma3",
    "paligemma",
    "smolvlm",
    "llava_onevision",
    "internvl",
    "mistral3",
    "glm4v",
}

QWEN = "Qwen/Qwen2-VL-2B-Instruct"
QWEN25 = "Qwen/Qwen2.5-VL-3B-Instruct"
LLAVA = "llava-hf/llava-1.5-7b-hf"
LLAVA_NEXT = "llava-hf/llava-v1.6-mistral-7b-hf"
MINICPM = "openbmb/MiniCPM-V-2_6"
PHI3 = "microsoft/Phi-3-vision-128k-instruct"
INTERNVL = "OpenGVLab/InternVL2-8B"
GENERIC = "HuggingFaceTB/SmolVLM-256M-Instruct"  # not curated, no family adapter
NATIVE_FAMILY_MODELS = [QWEN, QWEN25, LLAVA, LLAVA_NEXT, GENERIC]


class Hub:
    def reset(self):
        self.loads = []  # (api, path, kwargs)
        self.models = []
        self.processors = []
        self.templates = []  # messages handed to any apply_chat_template
        self.template_kwargs = []
        self.processor_calls = []
        self.generate_calls = []
        self.prefills = []  # one per batch decoded through forward calls
        self.chat_calls = []
        self.chat_question = ""  # the question remote chat() was asked (its inner generate answers it)
        self.inner_generate_calls = []  # remote chat()'s calls of its language model's generate()
        self.protocol_errors = []
        self.reply = "ok"
        self.cuda_available = False
        self.bf16_supported = True
        self.torchvision_images = False  # whether processors' image processors are torchvision-backed (fast) ones
        self.device = "cpu"
        self.repetition_penalty = None
        self.inference_depth = 0
        self.static_caches = []
        self.context = 32768  # the text model's max_position_embeddings
        self.extra_eos = []  # more end tokens in the generation config (ids may lie past the vocabulary)
        self.rng = random.Random(1234)  # the fake GPU's sampling noise: seeded, so runs repeat
        self.runner_up_logit = 5.0  # the filler's logit (the answer's is 10): near 10, sampling strays
        self.compiles = []  # torch.compile calls
        self.stream = FakeStream()  # the current CUDA stream
        self.forward_rows = []  # the rows of every forward call of the model (prefills, steps, warm-up)
        self.decoders = []  # every FakePagedDecoder made
        self.paged_attention = True  # whether the model takes the paged attention
        self.cudnn_sdp = True  # torch.backends.cuda.enable_cudnn_sdp's switch
        self.chunked, self.chunks = [], []  # rows given a chunked prompt; (row, tokens) of every chunk
        self.shared: list = []  # (row, blocks) of every prompt that started from cached blocks
        self.resumed = []  # the prompts of preempted rows prefilled again
        self.gpu_memory, self.memory_fraction = 80 * 2**30, 1.0  # torch.cuda's device memory and process cap
        self.gpu_used = 16 * 2**30  # allocated (the weights) and reserved
        self.work_memory, self.kv_bytes_per_token = 4 * 2**30, 2**17
        self.artifacts = []  # ("load" | "save", key) of the compile-artifact file
        self.steps = []  # (bucket, steps, compiled forward?) of every decode interval
        self.compiled_steps = []  # the bucket of every step run with the compiled forward
        self.captured_ahead = []  # (bucket, its forward is the compiled one, rows busy) per graph recorded ahead

    def respond(self, prompt: str) -> str:
        return self.reply(prompt) if callable(self.reply) else self.reply

    def script(self, prompt: str) -> list:
        return encode_text(self.respond(prompt)) + [EOS]


HUB = Hub()
HUB.reset()


class FakeConfig:
    def __init__(self, model_type: str):
        self._model_type = model_type

    @property
    def model_type(self):
        _use("transformers.PretrainedConfig.model_type")
        return self._model_type

    @property
    def max_position_embeddings(self):
        _use("transformers.PretrainedConfig.max_position_embeddings")
        return HUB.context

    def get_text_config(self, decoder=False, **kwargs):
        _use("transformers.PretrainedConfig.get_text_config")
        return self


class FakeAutoConfig:
    @classmethod
    def from_pretrained(cls, path, **kwargs):
        _use("transformers.AutoConfig.from_pretrained")
        HUB.loads.append(("AutoConfig", path, kwargs))
        if path not in MODEL_TYPES:
            raise OSError(
                f"{path} is not a local folder and is not a valid model identifier (token hf_{'x' * 30}, "
                "https://user:secret-hub-detail@hub.example/)\nTraceback line two"
            )
        return FakeConfig(MODEL_TYPES[path])


class FakeTokenizer:
    chat_template = "<|role|>content<|end|>"

    def __init__(self):
        self._padding_side = "right"

    @property
    def eos_token_id(self):
        _use("transformers.PreTrainedTokenizerBase.eos_token_id")
        return EOS

    @property
    def pad_token_id(self):
        _use("transformers.PreTrainedTokenizerBase.pad_token_id")
        return PAD

    @property
    def padding_side(self):
        _use("transformers.PreTrainedTokenizerBase.padding_side")
        return self._padding_side

    @padding_side.setter
    def padding_side(self, value):
        _use("transformers.PreTrainedTokenizerBase.padding_side")
        self._padding_side = value

    def __call__(self, text, add_special_tokens=True, **kwargs):
        _use("transformers.PreTrainedTokenizerBase.__call__")
        if isinstance(text, list):
            return {"input_ids": [encode_text(t) for t in text]}
        return {"input_ids": encode_text(text)}

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        _use("transformers.PreTrainedTokenizerBase.decode")
        return decode(ids, skip_special_tokens)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kwargs):
        _use("transformers.PreTrainedTokenizerBase.apply_chat_template")
        HUB.templates.append(copy.deepcopy(messages))
        HUB.template_kwargs.append(dict(tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs))
        return render(messages, add_generation_prompt)


class FakeBatch(dict):
    """BatchFeature: a dict of tensors with .to()."""

    def to(self, device):
        _use("transformers.BatchFeature.to")
        with _quiet():
            for key, value in list(dict.items(self)):
                if isinstance(value, FakeTensor):
                    dict.__setitem__(self, key, value.to(str(device)))
        return self

    def __getitem__(self, key):
        _use("transformers.BatchFeature.__getitem__")
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        _use("transformers.BatchFeature.__setitem__")
        super().__setitem__(key, value)

    def __contains__(self, key):
        _use("transformers.BatchFeature.__contains__")
        return super().__contains__(key)


class TorchvisionBackend:
    """Named as transformers' base class of its torchvision-backed image processors, which adapters look for."""


class FakeProcessor:
    chat_template = None  # Phi-4-multimodal's: transformers 5.17 loads it onto the tokenizer only

    def __init__(self, path, kwargs):
        self.path, self.kwargs = path, kwargs
        self._tokenizer = FakeTokenizer()

    @property
    def tokenizer(self):
        _use("transformers.ProcessorMixin.tokenizer")
        return self._tokenizer

    @property
    def image_processor(self):
        _use("transformers.ProcessorMixin.image_processor")
        if not HUB.torchvision_images:
            raise AttributeError("image_processor")
        return TorchvisionBackend()

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        _use("transformers.ProcessorMixin.apply_chat_template")
        HUB.templates.append(copy.deepcopy(messages))
        HUB.template_kwargs.append(dict(tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs))
        return render(messages, add_generation_prompt)

    def __call__(self, text=None, images=None, padding=False, return_tensors=None, **kwargs):
        _use("transformers.ProcessorMixin.__call__")
        with _quiet():
            texts = [text] if isinstance(text, str) else list(text)
            HUB.processor_calls.append(
                dict(text=texts, images=images, padding=padding, return_tensors=return_tensors, **kwargs)
            )
            rows = [encode_text(t) for t in texts]
            width = max(len(r) for r in rows)
            if len({len(r) for r in rows}) > 1 and not padding:
                raise ValueError("prompts of different lengths need padding=True")
            left = self._tokenizer._padding_side == "left"
            ids, mask = [], []
            for r in rows:
                pad = [PAD] * (width - len(r))
                ids.append(pad + r if left else r + pad)
                mask.append([0] * len(pad) + [1] * len(r) if left else [1] * len(r) + [0] * len(pad))
            batch = FakeBatch(input_ids=FakeTensor(ids, I64), attention_mask=FakeTensor(mask, I64))
            flat = []
            for entry in images or []:
                flat.extend(entry if isinstance(entry, list) else [entry])
            if flat:
                dict.__setitem__(batch, "pixel_values", FakeTensor([[0.5, 0.5] for _ in flat], F32))
            return batch


class FakeGenerationConfig:
    @property
    def eos_token_id(self):
        _use("transformers.GenerationConfig.eos_token_id")
        return [EOS, END] + list(HUB.extra_eos)

    @property
    def repetition_penalty(self):
        _use("transformers.GenerationConfig.repetition_penalty")
        return HUB.repetition_penalty


class FakeOutput:
    def __init__(self, logits):
        self._logits = logits

    @property
    def logits(self):
        _use("transformers.ModelOutput.logits")
        return self._logits


class FakeLinear:
    """The language-model head: only its weight's shape (vocabulary, hidden) is read."""

    def __init__(self, out_features, in_features, device):
        self._weight = FakeTensor([[0.0] * in_features for _ in range(out_features)], F32, device)

    @property
    def weight(self):
        _use("torch.nn.Linear.weight")
        return self._weight


class FakeModelBase:
    def __init__(self, path, kwargs):
        self.path, self.kwargs = path, kwargs
        self._config = FakeConfig(MODEL_TYPES.get(path, "unknown"))
        self._generation_config = FakeGenerationConfig()
        self.evaluated = False
        self._modules: dict = {}  # torch.nn.Module's children (the compile thread copies the tree): none here

    def eval(self):
        _use("transformers.PreTrainedModel.eval")
        self.evaluated = True
        return self

    @property
    def device(self):
        _use("transformers.PreTrainedModel.device")
        return HUB.device

    @property
    def dtype(self):
        _use("transformers.PreTrainedModel.dtype")
        return self.kwargs.get("dtype", self.kwargs.get("torch_dtype"))

    @property
    def config(self):
        _use("transformers.PreTrainedModel.config")
        return self._config

    @property
    def generation_config(self):
        _use("transformers.PreTrainedModel.generation_config")
        return self._generation_config


class FakeModel(FakeModelBase):
    """An image-text-to-text / causal LM that answers HUB.reply, one character per token."""

    def __init__(self, path, kwargs):
        super().__init__(path, kwargs)
        self._scripts = None
        self.compiled_calls = 0

    def _check_inference(self, what):
        if HUB.inference_depth <= 0:
            HUB.protocol_errors.append(f"{what} ran with autograd on (outside inference_mode/no_grad)")

    def _prompts(self, input_ids, attention_mask):
        ids = input_ids._data
        mask = attention_mask._data if attention_mask is not None else [[1] * len(r) for r in ids]
        prompts, real = [], []
        for row, m in zip(ids, mask):
            if 0 in m and m[-1] == 0:
                HUB.protocol_errors.append("right padding reached the model (padding_side must be left)")
            kept = [t for t, keep in zip(row, m) if keep]
            prompts.append(decode(kept))
            real.append(len(kept))
        return prompts, real

    # ---- the hand-written decode loop's API ----
    def get_output_embeddings(self):
        _use("transformers.PreTrainedModel.get_output_embeddings")
        return FakeLinear(VOCAB, 2, HUB.device)

    def _prepare_position_ids_for_generation(self, input_ids, model_kwargs):
        _use("transformers.PreTrainedModel._prepare_position_ids_for_generation")
        with _quiet():
            mask = model_kwargs.get("attention_mask")
            mask = mask._data if mask is not None else [[1] * len(r) for r in input_ids._data]
            positions = []
            for m in mask:
                total, row = 0, []
                for keep in m:
                    total += keep
                    row.append(total - 1 if keep else 1)
                positions.append(row)
            return FakeTensor(positions, I64, input_ids._device)

    def __call__(self, **kwargs):
        _use("transformers.PreTrainedModel.__call__")
        return self._forward(kwargs)

    def _forward(self, kwargs):
        with _quiet():
            self._check_inference("forward")
            input_ids = kwargs["input_ids"]
            cache_position = kwargs.get("cache_position")
            cache = kwargs.get("past_key_values")
            device = _device_name(HUB.device)
            for name, value in kwargs.items():
                if isinstance(value, FakeTensor) and _device_name(value._device) != device:
                    HUB.protocol_errors.append(f"forward: {name} on {value._device}, the model on {device}")
            rows, width = input_ids.dims
            HUB.forward_rows.append(rows)
            if width > 1 or cache_position is None:  # a prefill: a new batch
                if isinstance(cache, FakeStaticCache) and cache.dirty:
                    HUB.protocol_errors.append("a static cache was reused for a new batch without reset()")
                mask = kwargs.get("attention_mask")
                prompts, real = self._prompts(input_ids, mask)
                self._scripts = [HUB.script(p) for p in prompts]
                self._real, self._prompt_length, self._step = real, width, 0
                self._prompt_mask = mask._data if mask is not None else [[1] * width for _ in range(rows)]
                pixels = kwargs.get("pixel_values")
                HUB.prefills.append(
                    dict(
                        prompts=prompts,
                        pixel_dtype=getattr(pixels, "_dtype", None),
                        keys=sorted(kwargs),
                        cache=cache,
                    )
                )
                last = width - 1 if cache_position is None else cache_position._data[-1]
            elif self._scripts is None or cache_position._data[0] < self._prompt_length:
                # Any in-range state will do to warm up or capture a step: answer, remember nothing.
                if isinstance(cache, FakeStaticCache):
                    cache.dirty = True
                row = [0.0] * VOCAB
                row[EOS] = 10.0
                return FakeOutput(FakeTensor([[row] for _ in range(rows)], F32, HUB.device))
            else:
                self._step += 1
                step = self._step
                if rows != len(self._scripts):
                    HUB.protocol_errors.append(
                        f"decode step {step}: {rows} rows after a prefill of {len(self._scripts)}"
                    )
                if cache is not HUB.prefills[-1]["cache"]:
                    HUB.protocol_errors.append(f"decode step {step}: not the prefill's KV cache")
                last = self._prompt_length + step - 1
                if cache_position is not None and cache_position.tolist() != [last]:
                    HUB.protocol_errors.append(
                        f"decode step {step}: cache_position {cache_position.tolist()}, expected [{last}]"
                    )
                positions = kwargs.get("position_ids")
                if positions is not None:
                    got = [row[-1] for row in positions._data]
                    want = [n + step - 1 for n in self._real]
                    if got != want:
                        HUB.protocol_errors.append(f"decode step {step}: position_ids {got}, expected {want}")
                mask = kwargs.get("attention_mask")
                if mask is not None:
                    for r, (m, prompt_mask) in enumerate(zip(mask._data, self._prompt_mask)):
                        if m[: self._prompt_length] != prompt_mask or not all(m[self._prompt_length : last + 1]):
                            HUB.protocol_errors.append(
                                f"decode step {step}: row {r}'s attention mask hides "
                                "a token it should see or shows padding"
                            )
                            break
            if isinstance(cache, FakeStaticCache):
                cache.dirty = True
                if cache.max_cache_len is not None and last >= cache.max_cache_len:
                    HUB.protocol_errors.append(f"position {last} written past a cache of {cache.max_cache_len}")
            logits = []
            for script in self._scripts:
                token = script[self._step] if self._step < len(script) else EOS
                row = [0.0] * VOCAB
                row[FILLER] = HUB.runner_up_logit
                row[token] = 10.0
                logits.append([row])
            return FakeOutput(FakeTensor(logits, F32, HUB.device))

    # ---- generate() ----
    def generate(
        self,
        input_ids=None,
        attention_mask=None,
        max_new_tokens=20,
        min_new_tokens=0,
        pad_token_id=None,
        eos_token_id=None,
        **kwargs,
    ):
        _use("transformers.PreTrainedModel.generate")
        with _quiet():
            self._check_inference("generate")
            HUB.generate_calls.append(
                dict(
                    kwargs,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=min_new_tokens,
                    pad_token_id=pad_token_id,
                    eos_token_id=eos_token_id,
                    rows=len(input_ids._data),
                    pixel_values=kwargs.get("pixel_values"),
                )
            )
            prompts, _ = self._prompts(input_ids, attention_mask)
            stops = {EOS, END}  # the generation config's end tokens, unless the call overrides them
            if eos_token_id is not None:
                stops = set(eos_token_id) if isinstance(eos_token_id, list) else {eos_token_id}
            pad = PAD if pad_token_id is None else pad_token_id
            rows = []
            for prompt in prompts:
                script, new = HUB.script(prompt), []
                for k in range(max_new_tokens):
                    token = script[k] if k < len(script) else EOS
                    if token in stops and k < (min_new_tokens or 0):
                        token = FILLER
                    new.append(token)
                    if token in stops:
                        break
                rows.append(new)
            width = max(len(r) for r in rows)
            out = [list(ids) + r + [pad] * (width - len(r)) for ids, r in zip(input_ids._data, rows)]
            return FakeTensor(out, I64, input_ids._device)


class FakeInnerLM:
    """The language model inside a remote-code model (MiniCPM-V's `llm`, InternVL2's `language_model`):
    chat() calls its generate() with the prompt as `inputs_embeds`, which returns the new tokens only."""

    def __init__(self):
        self.generation_config = FakeGenerationConfig()

    def generate(self, inputs_embeds=None, eos_token_id=None, max_new_tokens=20, min_new_tokens=0, **kwargs):
        HUB.inner_generate_calls.append(
            dict(
                kwargs,
                inputs_embeds=inputs_embeds,
                eos_token_id=eos_token_id,
                max_new_tokens=max_new_tokens,
                min_new_tokens=min_new_tokens,
            )
        )
        stops = list(eos_token_id) if isinstance(eos_token_id, list) else [eos_token_id]
        new = []  # the reply, ended (as a trained model ends it) by the first token it is asked to stop at
        for k, token in enumerate((encode_text(HUB.respond(HUB.chat_question)) + stops[:1])[:max_new_tokens]):
            new.append(FILLER if token in stops and k < min_new_tokens else token)
            if new[-1] in stops:
                break
        return FakeTensor([new], I64, HUB.device)


def _embedded(text: str):
    """A prompt's `inputs_embeds`: (1, tokens, 1)."""
    return FakeTensor([[[0.0]] * len(encode_text(text))], F32, HUB.device)


class FakeMiniCPMV(FakeModelBase):
    """MiniCPM-V 2.6's chat() as its repository writes it: roles user/assistant opening with a user
    turn; `sampling=True` (default) samples with top_k 100 and repetition_penalty 1.05, `sampling=False`
    runs beam search (3 beams, repetition_penalty 1.2); the call's kwargs replace only those keys;
    `self.llm.generate` stops at <|im_end|>/<|endoftext|> (here END, EOS)."""

    def __init__(self, path, kwargs):
        super().__init__(path, kwargs)
        self.llm = FakeInnerLM()

    def chat(
        self,
        image=None,
        msgs=None,
        tokenizer=None,
        max_new_tokens=2048,
        min_new_tokens=0,
        sampling=True,
        system_prompt="",
        **kwargs,
    ):
        _use("remote.MiniCPMV.chat")
        with _quiet():
            roles = [m["role"] for m in msgs]
            assert set(roles) <= {"user", "assistant"} and roles[0] == "user", roles  # the repository's asserts
            config = (
                {"top_p": 0.8, "top_k": 100, "temperature": 0.7, "do_sample": True, "repetition_penalty": 1.05}
                if sampling
                else {"num_beams": 3, "repetition_penalty": 1.2}
            )
            config.update((k, kwargs[k]) for k in config.keys() & kwargs.keys())
            HUB.chat_calls.append(
                dict(
                    image=image,
                    tokenizer=tokenizer,
                    generation_config=config,
                    kwargs=dict(
                        kwargs,
                        max_new_tokens=max_new_tokens,
                        sampling=sampling,
                        **({"system_prompt": system_prompt} if system_prompt else {}),
                    ),
                    msgs=[{"role": m["role"], "content": list(m["content"])} for m in msgs],
                )
            )
            last = msgs[-1]["content"]
            HUB.chat_question = " ".join(p for p in last if isinstance(p, str)) if isinstance(last, list) else last
            prompt = system_prompt + "".join(str(m["content"]) for m in msgs)
            ids = self.llm.generate(
                inputs_embeds=_embedded(prompt),
                eos_token_id=[END, EOS],
                max_new_tokens=max_new_tokens,
                min_new_tokens=min_new_tokens,
                **config,
            )._data[0]
            return decode([t for t in ids if t not in (END, EOS)], skip_special_tokens=True).strip()


class FakeInternVL(FakeModelBase):
    """InternVL2's chat() as its repository writes it: `generation_config` (a dict) gets the template's
    separator as eos_token_id and goes to `self.language_model.generate` with the prompt embedded."""

    def __init__(self, path, kwargs):
        super().__init__(path, kwargs)
        self.language_model = FakeInnerLM()
        self.system_message = "You are an AI assistant."

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
        _use("remote.InternVLChatModel.chat")
        with _quiet():
            if pixel_values is not None and pixel_values.dims[0] != sum(num_patches_list or [pixel_values.dims[0]]):
                HUB.protocol_errors.append("InternVL pixel_values rows != sum(num_patches_list)")
            HUB.chat_calls.append(
                dict(
                    tokenizer=tokenizer,
                    pixel_values=pixel_values,
                    question=question,
                    generation_config=dict(generation_config),
                    history=history,
                    num_patches_list=num_patches_list,
                    system_message=self.system_message,
                    kwargs=kwargs,
                )
            )
            HUB.chat_question = question
            prompt = self.system_message + "".join(q + a for q, a in history or []) + question
            generation_config["eos_token_id"] = END
            ids = self.language_model.generate(inputs_embeds=_embedded(prompt), **generation_config)._data[0]
            return decode(ids, skip_special_tokens=True).split(SPECIALS[END])[0].strip()


def _loader(api: str, factory, allowed_types):
    class Loader:
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            _use(f"transformers.{api}.from_pretrained")
            HUB.loads.append((api, path, kwargs))
            model_type = MODEL_TYPES.get(path)
            if allowed_types is not None and model_type not in allowed_types:
                raise ValueError(f"Unrecognized configuration class for {api}: {model_type}")
            # Phi-3-vision's config.json sets `_attn_implementation: flash_attention_2`; only a kwarg of that
            # very name overrides it (`attn_implementation` does not), and flash-attn is not installed here.
            asks_flash = kwargs.get("_attn_implementation", "flash_attention_2") == "flash_attention_2"
            if model_type == "phi3_v" and api.startswith("AutoModel") and asks_flash:
                raise ImportError("FlashAttention2 has been toggled on, but it cannot be used: no flash_attn")
            obj = factory(path, kwargs)
            HUB.models.append(obj) if api.startswith("AutoModel") else HUB.processors.append(obj)
            return obj

    Loader.__name__ = api
    return Loader


def _remote_model(path, kwargs):
    return {"minicpmv": FakeMiniCPMV, "internvl_chat": FakeInternVL}[MODEL_TYPES[path]](path, kwargs)


class FakeBitsAndBytesConfig:
    def __init__(self, **kwargs):
        _use("transformers.BitsAndBytesConfig")
        self.kwargs = kwargs


class FakeStaticCache:
    def __init__(self, config=None, max_cache_len=None, **kwargs):
        _use("transformers.StaticCache")
        self.config, self.max_cache_len, self.kwargs, self.resets = config, max_cache_len, kwargs, 0
        self.dirty = False  # written since the last reset()
        HUB.static_caches.append(self)

    def reset(self):
        _use("transformers.StaticCache.reset")
        self.resets += 1
        self.dirty = False


class StubModule(types.ModuleType):
    """A module whose plain attributes are recorded when read; unknown ones are reported."""

    def __init__(self, name, tracked: dict, untracked: dict = None):
        super().__init__(name)
        self.__dict__.update(untracked or {})
        self.__dict__.update(tracked)
        self.__dict__["_stub_tracked"] = frozenset(tracked)

    def __getattribute__(self, attr):
        value = super().__getattribute__(attr)
        tracked = super().__getattribute__("__dict__").get("_stub_tracked", ())
        if attr in tracked:
            _use(f"{super().__getattribute__('__name__')}.{attr}")
        return value

    def __getattr__(self, attr):
        if not attr.startswith("__"):
            MISSING.add(f"{self.__name__}.{attr}")
        raise AttributeError(
            f"stub module {self.__name__!r} has no attribute {attr!r}: add a stub and list it in STUBBED_API"
        )


def build_stub_modules() -> dict:
    cuda = StubModule(
        "torch.cuda",
        {
            "is_available": cuda_is_available,
            "is_bf16_supported": cuda_is_bf16_supported,
            "Stream": FakeStream,
            "current_stream": cuda_current_stream,
            "stream": cuda_stream,
            "synchronize": cuda_synchronize,
            "empty_cache": cuda_empty_cache,
            "get_device_properties": cuda_get_device_properties,
            "get_per_process_memory_fraction": cuda_get_per_process_memory_fraction,
            "mem_get_info": cuda_mem_get_info,
            "memory_allocated": cuda_memory_allocated,
            "memory_reserved": cuda_memory_reserved,
        },
    )
    backends = StubModule(
        "torch.backends", {}, {"cuda": StubModule("torch.backends.cuda", {"enable_cudnn_sdp": enable_cudnn_sdp})}
    )
    dynamo = StubModule(
        "torch._dynamo", {}, {"config": StubModule("torch._dynamo.config", {"patch": dynamo_config_patch})}
    )
    torch = StubModule(
        "torch",
        {
            "float32": F32,
            "float16": F16,
            "bfloat16": BF16,
            "bool": BOOL,
            "long": I64,
            "float": F32,
            "inference_mode": torch_inference_mode,
            "no_grad": torch_no_grad,
            "stack": torch_stack,
            "cat": torch_cat,
            "zeros": torch_zeros,
            "zeros_like": torch_zeros_like,
            "empty_like": torch_empty_like,
            "tensor": torch_tensor,
            "arange": torch_arange,
            "where": torch_where,
            "softmax": torch_softmax,
            "compile": torch_compile,
            "device": torch_device,
        },
        {"cuda": cuda, "Tensor": FakeTensor, "backends": backends, "_dynamo": dynamo},
    )
    functional = StubModule("torchvision.transforms.functional", {"to_tensor": tv_to_tensor, "normalize": tv_normalize})
    transforms = StubModule("torchvision.transforms", {}, {"functional": functional})
    torchvision = StubModule("torchvision", {}, {"transforms": transforms})
    transformers = StubModule(
        "transformers",
        {"__version__": "5.0.0"},
        {
            "AutoConfig": FakeAutoConfig,
            "AutoProcessor": _loader("AutoProcessor", FakeProcessor, None),
            "AutoModelForImageTextToText": _loader("AutoModelForImageTextToText", FakeModel, NATIVE_TYPES),
            "AutoModelForCausalLM": _loader("AutoModelForCausalLM", FakeModel, {"phi3_v", "phi4_multimodal"}),
            "AutoModel": _loader("AutoModel", _remote_model, {"minicpmv", "internvl_chat"}),
            "AutoTokenizer": _loader("AutoTokenizer", lambda path, kwargs: FakeTokenizer(), None),
            "BitsAndBytesConfig": FakeBitsAndBytesConfig,
            "StaticCache": FakeStaticCache,
        },
    )
    return {
        "torch": torch,
        "torch.cuda": cuda,
        "torchvision": torchvision,
        "torchvision.transforms": transforms,
        "torchvision.transforms.functional": functional,
        "transformers": transformers,
        # Absent, as on a machine without them: importing any fails (Triton: the decode kernel is GPU-only).
        "qwen_vl_utils": None,
        "bitsandbytes": None,
        "triton": None,
    }
