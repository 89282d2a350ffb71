"""A fake torch/transformers for the stubbed suite (test_handler.py): no real torch is imported.

Importing this module installs nothing. Its fixtures (`stub_modules`, `hub`, `web`), which
test_handler.py binds, put the fakes into sys.modules for that module only and remove them afterwards.

The fakes are a scripted "hub": AutoConfig knows a few model ids, the fake processor/tokenizer encode
text one character per token, and every fake model answers with `HUB.reply` (a string or a function
of the prompt), whether it is driven through generate(), a hand-written decode loop (forward calls
that return one-hot logits), or a remote-code `chat()`. They record what they receive, so tests can
assert on handler outputs and on what the model was given, never on the engine's internals.

Every stubbed torch/transformers attribute the handler touches is listed in STUBBED_API; the stubs
record each use, a test checks that the handler exercises exactly that list, and each test fails if
the handler reaches for a torch/transformers attribute the stubs do not provide.
tests/test_stub_honesty.py checks the list against the real libraries.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import math
import os
import random
import sys
import types
import urllib.error
import urllib.request

import pytest

import handler
import runpod_vlm.engine.background_compile as background_compile
import runpod_vlm.engine.engine as engine_module
import runpod_vlm.engine.memory as memory_module
from runpod_vlm import fetch, media
from runpod_vlm.engine.blocks import BlockPool
from runpod_vlm.engine.decoder import Launched, PagedDecoder, row_buckets
from runpod_vlm.families.remote import InternVL2Adapter
from runpod_vlm.vocabulary import RequestError

# =================================================================================================
# The stubbed API surface
# =================================================================================================

STUBBED_API = frozenset(
    {
        # torch
        "torch.cuda.is_available",
        "torch.cuda.is_bf16_supported",
        "torch.float32",
        "torch.float16",
        "torch.bfloat16",
        "torch.inference_mode",
        "torch.stack",
        "torch.cat",
        "torch.Tensor.shape",
        "torch.Tensor.__getitem__",
        "torch.Tensor.tolist",
        "torch.Tensor.to",
        "torch.Tensor.sum",
        # torch: pixels moved to the GPU (the stand-in of cached images, one row repeated, moved once)
        "torch.Tensor.ndim",
        "torch.Tensor.stride",
        "torch.Tensor.is_floating_point",
        "torch.Tensor.element_size",
        "torch.Tensor.__len__",
        # torch: a preempted request's prompt followed by its tokens
        "torch.tensor",
        "torch.Tensor.dtype",
        "torch.Tensor.device",
        # torch: images processed on the GPU by the intake, on a stream of its own (VLM_PREPROCESS_ON_GPU)
        "torch.device",
        "torch.cuda.Stream",
        "torch.cuda.stream",
        "torch.cuda.Stream.synchronize",
        # torch: the compiled path and the GPU's memory (torch.compile, synchronize, empty_cache)
        "torch.compile",
        "torch.cuda.synchronize",
        "torch.cuda.empty_cache",
        # torch: sizing the KV pool from GPU memory
        "torch.cuda.get_device_properties",
        "torch.cuda.get_per_process_memory_fraction",
        "torch.cuda.mem_get_info",
        "torch.cuda.memory_allocated",
        "torch.cuda.memory_reserved",
        # torch: attention kernels on the GPU
        "torch.backends.cuda.enable_cudnn_sdp",
        # torchvision (InternVL2's tiling)
        "torchvision.transforms.functional.to_tensor",
        "torchvision.transforms.functional.normalize",
        # transformers: loading
        "transformers.__version__",
        "transformers.AutoConfig.from_pretrained",
        "transformers.PretrainedConfig.model_type",
        "transformers.PretrainedConfig.get_text_config",
        "transformers.PretrainedConfig.max_position_embeddings",
        "transformers.AutoProcessor.from_pretrained",
        "transformers.AutoModelForImageTextToText.from_pretrained",
        "transformers.AutoModel.from_pretrained",
        "transformers.AutoTokenizer.from_pretrained",
        "transformers.AutoModelForCausalLM.from_pretrained",
        "transformers.BitsAndBytesConfig",
        # transformers: models
        "transformers.PreTrainedModel.eval",
        # the vocabulary's size for the grammar builder, made at boot
        "transformers.PreTrainedModel.get_output_embeddings",
        "torch.nn.Linear.weight",
        "transformers.PreTrainedModel.generate",
        "transformers.PreTrainedModel.device",
        "transformers.PreTrainedModel.dtype",
        "transformers.PreTrainedModel.config",
        "transformers.PreTrainedModel.generation_config",
        "transformers.GenerationConfig.eos_token_id",
        # transformers: processors and tokenizers
        "transformers.ProcessorMixin.__call__",
        "transformers.ProcessorMixin.apply_chat_template",
        "transformers.ProcessorMixin.tokenizer",
        "transformers.ProcessorMixin.image_processor",
        "transformers.BatchFeature.to",
        "transformers.BatchFeature.__getitem__",
        "transformers.BatchFeature.__setitem__",
        "transformers.BatchFeature.__contains__",
        "transformers.PreTrainedTokenizerBase.decode",
        "transformers.PreTrainedTokenizerBase.apply_chat_template",
        "transformers.PreTrainedTokenizerBase.eos_token_id",
        "transformers.PreTrainedTokenizerBase.pad_token_id",
        "transformers.PreTrainedTokenizerBase.padding_side",
        # trust_remote_code model APIs
        "remote.MiniCPMV.chat",
        "remote.InternVLChatModel.chat",
    }
)

USED: set = set()  # stubbed names the handler touched (fakes' own internal use is not recorded)
MISSING: set = set()  # torch/transformers attributes the handler asked for that no stub provides
_QUIET = [0]


def _use(name: str) -> None:
    if not _QUIET[0]:
        USED.add(name)


@contextlib.contextmanager
def _quiet():
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


# =================================================================================================
# A tiny pure-Python tensor: nested lists, broadcasting, the ops the engine uses
# =================================================================================================


class FakeDtype:
    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind

    def __repr__(self):
        return f"torch.{self.name}"


F32, F16, BF16 = FakeDtype("float32", "float"), FakeDtype("float16", "float"), FakeDtype("bfloat16", "float")
I64, BOOL = FakeDtype("int64", "int"), FakeDtype("bool", "bool")


def _shape_of(data) -> tuple:
    dims = []
    while isinstance(data, list):
        dims.append(len(data))
        if not data:
            break
        data = data[0]
    return tuple(dims)


def _flat(data):
    if isinstance(data, list):
        for d in data:
            yield from _flat(d)
    else:
        yield data


def _map(data, fn):
    return [_map(d, fn) for d in data] if isinstance(data, list) else fn(data)


def _cast(value, dtype: FakeDtype):
    if dtype.kind == "bool":
        return bool(value)
    if dtype.kind == "int":
        return int(value)
    return float(value)


def _infer_dtype(data) -> FakeDtype:
    values = list(_flat(data))
    if values and all(isinstance(v, bool) for v in values):
        return BOOL
    if any(isinstance(v, float) for v in values):
        return F32
    return I64


def _broadcast_shape(a: tuple, b: tuple) -> tuple:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise RuntimeError(f"shapes {a} and {b} cannot be broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


def _expand(data, shape: tuple, target: tuple):
    for _ in range(len(target) - len(shape)):
        data, shape = [data], (1,) + tuple(shape)

    def go(d, s, t):
        if not t:
            return d
        if s[0] == t[0]:
            return [go(x, s[1:], t[1:]) for x in d]
        return [go(d[0], s[1:], t[1:]) for _ in range(t[0])]

    return go(data, tuple(shape), tuple(target))


def _zip(a, b, fn):
    if isinstance(a, list):
        return [_zip(x, y, fn) for x, y in zip(a, b)]
    return fn(a, b)


def _norm_key(key, ndim: int) -> tuple:
    if not isinstance(key, tuple):
        key = (key,)
    key = tuple(int(k._data) if isinstance(k, FakeTensor) else k for k in key)
    if any(k is Ellipsis for k in key):
        i = key.index(Ellipsis)
        used = sum(1 for k in key if k is not None and k is not Ellipsis)
        key = key[:i] + (slice(None),) * (ndim - used) + key[i + 1 :]
    used = sum(1 for k in key if k is not None)
    if used > ndim:
        raise IndexError(f"too many indices for a tensor of dimension {ndim}")
    return key + (slice(None),) * (ndim - used)


def _index(data, key: tuple):
    if not key:
        return data
    k, rest = key[0], key[1:]
    if k is None:
        return [_index(data, rest)]
    if isinstance(k, int):
        return _index(data[k], rest)
    if isinstance(k, slice):
        return [_index(d, rest) for d in data[k]]
    raise TypeError(f"the fake tensor cannot be indexed with {k!r}")


def _assign(data, key: tuple, value) -> None:
    k, rest = key[0], key[1:]
    if isinstance(k, int):
        if rest:
            _assign(data[k], rest, value)
        else:
            data[k] = value
        return
    for v, idx in zip(value, range(*k.indices(len(data)))):
        if rest:
            _assign(data[idx], rest, v)
        else:
            data[idx] = v


def _same_device(*tensors) -> None:
    devices = {_device_name(t._device) for t in tensors if isinstance(t, FakeTensor) and t.dims}
    if len(devices) > 1:
        HUB.protocol_errors.append(f"an op mixed tensors on {sorted(devices)}")
        raise RuntimeError(f"Expected all tensors to be on the same device, but found {sorted(devices)}")


def _device_name(device) -> str:
    device = str(device)
    return "cuda:0" if device == "cuda" else device


def _last_dim(dims: tuple, dim: int, what: str) -> None:
    if dim not in (-1, len(dims) - 1):
        raise NotImplementedError(f"the fake tensor's {what} works on the last dimension only")


def _rows(data, fn):
    """Apply fn to every innermost row (a list of scalars)."""
    if data and isinstance(data[0], list):
        return [_rows(d, fn) for d in data]
    return fn(data)


def _elementwise(name: str, fn, dtype=None, in_place=False):
    """A torch.Tensor operator, elementwise over broadcast operands (in place: into self, keeping its dtype unless one
    is given)."""

    def operator(self, other):
        _use(f"torch.Tensor.{name}")
        if in_place:
            return self._in_place(other, fn, dtype or self._dtype)
        return self._binary(other, fn, dtype)

    operator.__name__ = operator.__qualname__ = name
    return operator


class _Dense:
    """A fake tensor's layout: dense, row-major (a fake never repeats a row without copying it)."""

    dims: tuple

    @property
    def ndim(self) -> int:
        _use("torch.Tensor.ndim")
        return len(self.dims)

    def stride(self, dim: int) -> int:
        _use("torch.Tensor.stride")
        n = 1
        for d in self.dims[dim + 1 :]:
            n *= d
        return n


class FakeTensor(_Dense):
    """Just enough of torch.Tensor for the engine: nested lists with broadcasting."""

    def __init__(self, data, dtype: FakeDtype = None, device="cpu"):
        self._dtype = dtype or _infer_dtype(data)
        self._data = _map(copy.deepcopy(data), lambda v: _cast(v, self._dtype))
        self._device = str(device)

    # -- internal helpers (never recorded) --
    @property
    def dims(self) -> tuple:
        return _shape_of(self._data)

    def numel(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @staticmethod
    def of(value, like=None) -> FakeTensor:
        if isinstance(value, FakeTensor):
            return value
        return FakeTensor(value, _infer_dtype(value), getattr(like, "_device", "cpu"))

    def _binary(self, other, fn, dtype=None) -> FakeTensor:
        other = FakeTensor.of(other, self)
        _same_device(self, other)
        target = _broadcast_shape(self.dims, other.dims)
        a, b = _expand(self._data, self.dims, target), _expand(other._data, other.dims, target)
        if dtype is None:
            dtype = self._dtype if self._dtype.kind == "float" or other._dtype.kind != "float" else other._dtype
        return FakeTensor(_zip(a, b, fn), dtype, self._device)

    def _single(self):
        if self.numel() != 1:
            raise RuntimeError("a tensor with more than one element has no single value")
        return next(_flat(self._data))

    def _scatter_into(self, dim, index, src) -> None:
        _last_dim(self.dims, dim, "scatter")
        index = FakeTensor.of(index, self)
        _same_device(self, index)
        source = src._data if isinstance(src, FakeTensor) else None

        def go(d, idx, s):
            if idx and isinstance(idx[0], list):
                for k, sub in enumerate(idx):
                    go(d[k], sub, s[k] if s is not None else None)
                return
            for j, i in enumerate(idx):
                d[i] = _cast(s[j] if s is not None else src, self._dtype)

        go(self._data, index._data, source)

    def __repr__(self):
        return f"FakeTensor({self._data!r}, dtype={self._dtype!r})"

    # -- the recorded torch.Tensor API --
    # Every stubbed member, here and in the fake transformers classes below, first records its
    # STUBBED_API name with _use() and then does its work: that two-line shape repeats by design.
    @property
    def shape(self) -> tuple:
        _use("torch.Tensor.shape")
        return self.dims

    @property
    def device(self):
        _use("torch.Tensor.device")
        return self._device

    @property
    def dtype(self):
        _use("torch.Tensor.dtype")
        return self._dtype

    def __getitem__(self, key):
        _use("torch.Tensor.__getitem__")
        if isinstance(key, list) or (isinstance(key, FakeTensor) and key.dims):
            # Advanced indexing by a list or an integer tensor on the first dimension.
            index = key._data if isinstance(key, FakeTensor) else key
            if isinstance(key, FakeTensor) and key._dtype.kind != "int":
                raise NotImplementedError("the fake tensor takes integer index tensors only")
            return FakeTensor(_map(index, lambda i: copy.deepcopy(self._data[i])), self._dtype, self._device)
        return FakeTensor(_index(self._data, _norm_key(key, len(self.dims))), self._dtype, self._device)

    def __setitem__(self, key, value):
        _use("torch.Tensor.__setitem__")
        if isinstance(key, list):
            value = FakeTensor.of(value, self)
            if value.dims:
                raise NotImplementedError("the fake tensor sets list-indexed elements to a scalar only")
            for i in key:
                self._data[i] = _cast(value._single(), self._dtype)
            return
        key = _norm_key(key, len(self.dims))
        if any(k is None for k in key):
            raise IndexError("None cannot be used in an assignment")
        region = _shape_of(_index(self._data, key))
        value = FakeTensor.of(value, self)
        data = _map(_expand(value._data, value.dims, region), lambda v: _cast(v, self._dtype))
        _assign(self._data, key, data)

    def tolist(self):
        _use("torch.Tensor.tolist")
        return copy.deepcopy(self._data)

    def to(self, *args, **kwargs):
        _use("torch.Tensor.to")
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, FakeDtype)), self._dtype)
        device = kwargs.get("device") or next((a for a in args if isinstance(a, str)), self._device)
        return FakeTensor(self._data, dtype, str(device))

    def is_floating_point(self) -> bool:
        _use("torch.Tensor.is_floating_point")
        return self._dtype.kind == "float"

    def element_size(self) -> int:
        _use("torch.Tensor.element_size")
        return {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "bool": 1}[self._dtype.name]

    def sum(self, dim=None):
        _use("torch.Tensor.sum")
        dtype = F32 if self._dtype.kind == "float" else I64
        if dim is None:
            return FakeTensor(sum(_flat(self._data)), dtype, self._device)
        _last_dim(self.dims, dim, "sum over a dimension")
        return FakeTensor(_rows(self._data, sum), dtype, self._device)

    def float(self):
        _use("torch.Tensor.float")
        return FakeTensor(self._data, F32, self._device)

    def argmax(self, dim=-1):
        _use("torch.Tensor.argmax")
        _last_dim(self.dims, dim, "argmax")

        def go(d):
            if isinstance(d[0], list):
                return [go(x) for x in d]
            return max(range(len(d)), key=lambda i: (d[i], -i))

        return FakeTensor(go(self._data), I64, self._device)

    def masked_fill(self, mask, value):
        _use("torch.Tensor.masked_fill")
        mask = FakeTensor.of(mask, self)
        _same_device(self, mask)
        if mask._dtype is not BOOL:
            raise RuntimeError("masked_fill only supports boolean masks")
        if _broadcast_shape(self.dims, mask.dims) != self.dims:
            raise RuntimeError("the mask does not broadcast to the tensor")
        m = _expand(mask._data, mask.dims, self.dims)
        return FakeTensor(_zip(self._data, m, lambda v, hide: value if hide else v), self._dtype, self._device)

    def all(self):
        _use("torch.Tensor.all")
        return FakeTensor(all(_flat(self._data)), BOOL, self._device)

    def __bool__(self):
        _use("torch.Tensor.__bool__")
        return bool(self._single())

    def __int__(self):
        _use("torch.Tensor.__int__")
        return int(self._single())

    def __len__(self):
        _use("torch.Tensor.__len__")
        if not self.dims:
            raise TypeError("len() of a 0-d tensor")
        return self.dims[0]

    def _in_place(self, other, fn, dtype) -> FakeTensor:
        result = self._binary(other, fn, dtype)
        if result.dims != self.dims:
            raise RuntimeError("an in-place operation may not change the shape")
        self._data = result._data
        return self

    __iadd__ = _elementwise("__iadd__", lambda a, b: a + b, in_place=True)
    __ior__ = _elementwise("__ior__", lambda a, b: bool(a) or bool(b), BOOL, in_place=True)
    __and__ = _elementwise("__and__", lambda a, b: bool(a) and bool(b), BOOL)
    __or__ = _elementwise("__or__", lambda a, b: bool(a) or bool(b), BOOL)
    __gt__ = _elementwise("__gt__", lambda a, b: a > b, BOOL)
    __ge__ = _elementwise("__ge__", lambda a, b: a >= b, BOOL)
    __lt__ = _elementwise("__lt__", lambda a, b: a < b, BOOL)
    __add__ = _elementwise("__add__", lambda a, b: a + b)
    __sub__ = _elementwise("__sub__", lambda a, b: a - b)
    __mul__ = _elementwise("__mul__", lambda a, b: a * b)

    def __truediv__(self, other):
        _use("torch.Tensor.__truediv__")

        def divide(a, b):
            if b == 0:
                return math.copysign(math.inf, a) if a else math.nan
            return a / b

        other = FakeTensor.of(other, self)
        dtype = self._dtype if self._dtype.kind == "float" else (other._dtype if other._dtype.kind == "float" else F32)
        return self._binary(other, divide, dtype)

    # in-place writes into fixed buffers
    def fill_(self, value):
        _use("torch.Tensor.fill_")
        value = value._single() if isinstance(value, FakeTensor) else value
        self._data = _filled(list(self.dims), _cast(value, self._dtype))
        return self

    def zero_(self):
        _use("torch.Tensor.zero_")
        self._data = _filled(list(self.dims), _cast(0, self._dtype))
        return self

    def copy_(self, src):
        _use("torch.Tensor.copy_")
        src = FakeTensor.of(src, self)  # any device: copy_ moves data
        if _broadcast_shape(self.dims, src.dims) != self.dims:
            raise RuntimeError(f"copy_ of shape {src.dims} into {self.dims}")
        self._data = _map(_expand(src._data, src.dims, self.dims), lambda v: _cast(v, self._dtype))
        return self

    def index_copy_(self, dim, index, source):
        _use("torch.Tensor.index_copy_")
        _same_device(self, index, source)
        dims, dim = self.dims, dim % len(self.dims)
        positions = list(_flat(index._data))
        if source.dims != dims[:dim] + (len(positions),) + dims[dim + 1 :]:
            raise RuntimeError(f"index_copy_: source {source.dims} does not fit {dims} at dim {dim}")

        def go(d, s, depth):
            if depth == dim:
                for j, i in enumerate(positions):
                    if not 0 <= i < len(d):
                        raise IndexError(f"index_copy_: index {i} out of range")
                    d[i] = _map(copy.deepcopy(s[j]), lambda v: _cast(v, self._dtype))
            else:
                for x, y in zip(d, s):
                    go(x, y, depth + 1)

        go(self._data, source._data, 0)
        return self

    def scatter_(self, dim, index, src):
        _use("torch.Tensor.scatter_")
        self._scatter_into(dim, index, src)
        return self

    def scatter(self, dim, index, src):
        _use("torch.Tensor.scatter")
        out = FakeTensor(self._data, self._dtype, self._device)
        out._scatter_into(dim, index, src)
        return out

    # sampling
    def sort(self, dim=-1, descending=False):
        _use("torch.Tensor.sort")
        _last_dim(self.dims, dim, "sort")

        def go(row):
            order = sorted(range(len(row)), key=lambda i: (-row[i], i) if descending else (row[i], i))
            return [row[i] for i in order], order

        pairs = _rows(self._data, go)

        def split(p, k):
            return [split(x, k) for x in p] if isinstance(p, list) else p[k]

        return (FakeTensor(split(pairs, 0), self._dtype, self._device), FakeTensor(split(pairs, 1), I64, self._device))

    def cumsum(self, dim=-1):
        _use("torch.Tensor.cumsum")
        _last_dim(self.dims, dim, "cumsum")
        return FakeTensor(_rows(self._data, lambda row: list(itertools.accumulate(row))), self._dtype, self._device)

    def exponential_(self, lambd=1.0):
        _use("torch.Tensor.exponential_")
        self._data = _map(self._data, lambda v: HUB.rng.expovariate(lambd))
        return self

    def clamp(self, min=None, max=None):
        _use("torch.Tensor.clamp")

        def bound(v):
            if min is not None and v < min:
                v = min
            if max is not None and v > max:
                v = max
            return v

        return FakeTensor(_map(self._data, bound), self._dtype, self._device)


class FakeImageTensor(_Dense):
    """Stacked InternVL tiles: a shape and the tiles it came from, no pixel data."""

    def __init__(self, shape: tuple, tiles: list, dtype=F32, device="cpu", normalized=False):
        self.dims, self.tiles, self._dtype, self._device, self.normalized = shape, tiles, dtype, device, normalized

    @property
    def shape(self):
        _use("torch.Tensor.shape")
        return self.dims

    def __len__(self):
        _use("torch.Tensor.__len__")
        return self.dims[0]

    def to(self, *args, **kwargs):
        _use("torch.Tensor.to")
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, FakeDtype)), self._dtype)
        device = kwargs.get("device") or next((a for a in args if isinstance(a, str)), self._device)
        return FakeImageTensor(self.dims, self.tiles, dtype, str(device), self.normalized)


def _ensure_tensor(value, dtype=None, device=None) -> FakeTensor:
    if isinstance(value, FakeTensor):
        return value
    return FakeTensor(value, dtype or _infer_dtype(value), str(device or "cpu"))


def _sizes(args) -> list:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return list(args[0])
    return list(args)


def _filled(sizes, value):
    if not sizes:
        return value
    return [_filled(sizes[1:], value) for _ in range(sizes[0])]


def torch_zeros(*size, dtype=None, device=None):
    _use("torch.zeros")
    dtype = dtype or F32
    return FakeTensor(_filled(_sizes(size), _cast(0, dtype)), dtype, str(device or "cpu"))


def _zeros_like(tensor, dtype, device) -> FakeTensor:
    dtype = dtype or tensor._dtype
    return FakeTensor(_filled(list(tensor.dims), _cast(0, dtype)), dtype, str(device or tensor._device))


def torch_zeros_like(tensor, dtype=None, device=None):
    _use("torch.zeros_like")
    return _zeros_like(tensor, dtype, device)


def torch_empty_like(tensor, dtype=None, device=None):
    _use("torch.empty_like")
    return _zeros_like(tensor, dtype, device)  # any contents will do: zeros


def torch_tensor(data, dtype=None, device=None):
    _use("torch.tensor")
    return FakeTensor(data, dtype or _infer_dtype(data), str(device or "cpu"))


def torch_arange(start, end=None, step=1, dtype=None, device=None):
    _use("torch.arange")
    if end is None:
        start, end = 0, start
    return FakeTensor(list(range(int(start), int(end), int(step))), dtype or I64, str(device or "cpu"))


def torch_where(condition, input, other):
    _use("torch.where")
    condition = _ensure_tensor(condition)
    a, b = FakeTensor.of(input, condition), FakeTensor.of(other, condition)
    _same_device(condition, a, b)
    if condition._dtype is not BOOL:
        raise RuntimeError("where expected a boolean condition")
    target = _broadcast_shape(_broadcast_shape(condition.dims, a.dims), b.dims)
    c = _expand(condition._data, condition.dims, target)
    x, y = _expand(a._data, a.dims, target), _expand(b._data, b.dims, target)

    def pick(c, x, y):
        if isinstance(c, list):
            return [pick(*t) for t in zip(c, x, y)]
        return x if c else y

    dtype = a._dtype if a._dtype.kind == "float" or b._dtype.kind != "float" else b._dtype
    return FakeTensor(pick(c, x, y), dtype, condition._device)


def torch_softmax(input, dim=-1):
    _use("torch.softmax")
    _last_dim(input.dims, dim, "softmax")

    def row(values):
        top = max(values)
        exps = [math.exp(v - top) for v in values]
        total = sum(exps)
        return [e / total for e in exps]

    return FakeTensor(_rows(input._data, row), F32, input._device)


def torch_cat(tensors, dim=0):
    _use("torch.cat")
    tensors = list(tensors)
    if any(isinstance(t, FakeImageTensor) for t in tensors):
        if dim != 0:
            raise NotImplementedError("image stacks concatenate on dim 0 only")
        rest = tensors[0].dims[1:]
        return FakeImageTensor(
            (sum(t.dims[0] for t in tensors),) + rest,
            [x for t in tensors for x in t.tiles],
            tensors[0]._dtype,
            tensors[0]._device,
            all(t.normalized for t in tensors),
        )
    if dim == 0 and all(isinstance(t, FakeTensor) for t in tensors):  # batches, one after another
        _same_device(*tensors)
        return FakeTensor([row for t in tensors for row in t._data], tensors[0]._dtype, tensors[0]._device)
    if dim == 1 and all(isinstance(t, FakeTensor) for t in tensors):  # rows of tokens, lengthened
        _same_device(*tensors)
        rows = zip(*(t._data for t in tensors))
        return FakeTensor([[x for part in row for x in part] for row in rows], tensors[0]._dtype, tensors[0]._device)
    raise NotImplementedError("the handler concatenates image stacks and token rows only")


def torch_stack(tensors, dim=0):
    _use("torch.stack")
    tensors = list(tensors)
    if dim != 0:
        raise NotImplementedError("the fake stack works on dim 0 only")
    if all(isinstance(t, FakeImageTensor) for t in tensors):
        return FakeImageTensor(
            (len(tensors),) + tensors[0].dims,
            [x for t in tensors for x in t.tiles],
            tensors[0]._dtype,
            tensors[0]._device,
            all(t.normalized for t in tensors),
        )
    return FakeTensor([_ensure_tensor(t)._data for t in tensors])


def torch_compile(fn, dynamic=None, **kwargs):
    """The compiled function is the function itself, counted, and recorded as one op in a graph."""
    _use("torch.compile")
    HUB.compiles.append(dict(kwargs, dynamic=dynamic))
    owner = getattr(fn, "__self__", None)

    def compiled(*args, **kw):
        if owner is not None:
            owner.compiled_calls += 1
        return fn(*args, **kw)

    return compiled


class FakeStream:
    def __init__(self, device=None, priority=0):
        self.waited_on = []

    def wait_stream(self, stream):
        _use("torch.cuda.Stream.wait_stream")
        self.waited_on.append(stream)

    def synchronize(self):  # the fakes' work is done when it returns
        _use("torch.cuda.Stream.synchronize")


def torch_device(name):
    _use("torch.device")
    return str(name)


def cuda_current_stream(device=None):
    _use("torch.cuda.current_stream")
    return HUB.stream


@contextlib.contextmanager
def _stream_cm(stream):
    previous, HUB.stream = HUB.stream, stream
    try:
        yield stream
    finally:
        HUB.stream = previous


def cuda_stream(stream):
    _use("torch.cuda.stream")
    return _stream_cm(stream)


@contextlib.contextmanager
def _inference_mode_cm():
    HUB.inference_depth += 1
    try:
        yield
    finally:
        HUB.inference_depth -= 1


def torch_inference_mode(mode=True):
    _use("torch.inference_mode")
    return _inference_mode_cm()


def torch_no_grad():
    _use("torch.no_grad")
    return _inference_mode_cm()


def cuda_empty_cache():
    _use("torch.cuda.empty_cache")


def cuda_synchronize(device=None):
    _use("torch.cuda.synchronize")


def cuda_get_device_properties(device=None):
    _use("torch.cuda.get_device_properties")
    return types.SimpleNamespace(total_memory=HUB.gpu_memory)


def cuda_get_per_process_memory_fraction(device=None):
    _use("torch.cuda.get_per_process_memory_fraction")
    return HUB.memory_fraction


def cuda_mem_get_info(device=None):
    _use("torch.cuda.mem_get_info")
    return HUB.gpu_memory - HUB.gpu_used, HUB.gpu_memory


def cuda_memory_allocated(device=None):
    _use("torch.cuda.memory_allocated")
    return HUB.gpu_used


def cuda_memory_reserved(device=None):
    _use("torch.cuda.memory_reserved")
    return HUB.gpu_used


def enable_cudnn_sdp(enabled: bool):
    _use("torch.backends.cuda.enable_cudnn_sdp")
    HUB.cudnn_sdp = enabled


def cuda_is_available():
    _use("torch.cuda.is_available")
    return HUB.cuda_available


def cuda_is_bf16_supported(*args, **kwargs):
    _use("torch.cuda.is_bf16_supported")
    return HUB.bf16_supported


def tv_to_tensor(picture):
    _use("torchvision.transforms.functional.to_tensor")
    width, height = picture.size
    return FakeImageTensor((3, height, width), [picture.size])


def tv_normalize(tensor, mean, std, inplace=False):
    _use("torchvision.transforms.functional.normalize")
    if tuple(mean) != InternVL2Adapter.mean or tuple(std) != InternVL2Adapter.std:
        HUB.protocol_errors.append(f"InternVL tiles normalised with {mean}/{std}")
    return FakeImageTensor(tensor.dims, tensor.tiles, tensor._dtype, tensor._device, normalized=True)


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
        {"cuda": cuda, "Tensor": FakeTensor, "backends": backends},
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


# =================================================================================================
# Fixtures (bound by test_handler.py): the fakes in sys.modules, a fresh hub, no network
# =================================================================================================


@pytest.fixture(scope="module", autouse=True)
def stub_modules():
    """Install the stubs for this module only; sys.modules is restored afterwards."""
    patch = pytest.MonkeyPatch()
    modules = build_stub_modules()
    for name, module in modules.items():
        patch.setitem(sys.modules, name, module)
    handler.reset_engine()
    try:
        yield modules
    finally:
        handler.reset_engine()
        patch.undo()


class UnusedGrammars:
    """The engine's grammar builder, made at boot; no stubbed test asks for structured output."""

    def __init__(self, tokenizer, vocab_size, end_token, deadline_s):
        pass

    def start(self, schema, param, limit=None):
        raise AssertionError("structured output is tested on real tiny models")

    def close(self):
        pass


@pytest.fixture(autouse=True)
def hub(monkeypatch):
    """A fresh scripted hub and no VLM_ setting per test; afterwards the handler must have used only
    stubbed, listed API and kept to the protocol the fakes check (devices, padding, KV cache)."""
    for key in list(os.environ):
        if key.startswith("VLM_"):
            monkeypatch.delenv(key)
    HUB.reset()
    MISSING.clear()
    handler.reset_engine()
    monkeypatch.setattr(engine_module, "PagedDecoder", FakePagedDecoder)
    monkeypatch.setattr(engine_module, "use_paged_attention", lambda model: HUB.paged_attention)
    # Grammars (llguidance over a real tokenizer) run for real in tests/test_structured_output.py.
    monkeypatch.setattr(engine_module, "Grammars", UnusedGrammars)
    # The vision tower's attention runs for real in tests/test_vision_attention.py.
    monkeypatch.setattr(engine_module, "use_packed_vision_attention", lambda model: True)
    # GPU memory is asked of the fake torch.cuda; the work memory is measured on the GPU (bench/harness.py).
    monkeypatch.setattr(
        memory_module, "measured_work_memory", lambda model, settings, dtype, graph_tokens=0: HUB.work_memory
    )
    monkeypatch.setattr(memory_module, "kv_bytes_per_token", lambda model: HUB.kv_bytes_per_token)
    # The compile-artifact file is torch's (tests/test_compile_cache.py runs it for real): here the
    # engine's use of it is recorded.
    monkeypatch.setattr(
        background_compile, "compile_cache_key", lambda model_id, **parts: f"{model_id}:{parts['shapes']}"
    )
    monkeypatch.setattr(
        background_compile, "load_compile_artifacts", lambda s, key: HUB.artifacts.append(("load", key)) or False
    )
    monkeypatch.setattr(
        background_compile, "save_compile_artifacts", lambda settings, key: HUB.artifacts.append(("save", key))
    )
    yield HUB
    handler.reset_engine()
    assert not MISSING, f"the handler used torch/transformers API the stubs lack: {sorted(MISSING)}"
    assert not HUB.protocol_errors, HUB.protocol_errors
    assert USED <= STUBBED_API, f"recorded but not listed in STUBBED_API: {sorted(USED - STUBBED_API)}"


WEB: dict = {}


@pytest.fixture(autouse=True)
def web(monkeypatch):
    """No test touches the network: URL fetches are answered from WEB (url -> bytes)."""
    WEB.clear()
    fetched = []

    def serve_url(url):
        fetched.append(url)
        if url not in WEB:
            raise urllib.error.URLError("unreachable (fake web)")
        return WEB[url]

    def fake_fetch(url, policy=None, param=None, *args, **kwargs):
        if policy is not None:
            fetch.check_image_url(url, policy, param)  # the policy still decides what may be fetched
        try:
            return serve_url(url)
        except urllib.error.URLError:
            raise RequestError("fetch_failed", "the image URL could not be fetched", param) from None

    monkeypatch.setattr(media, "fetch_image_url", fake_fetch)

    class FakeResponse(io.BytesIO):
        status = code = 200

        def __init__(self, data, url):
            super().__init__(data)
            self.url = url
            self.headers = {"Content-Type": "image/png", "Content-Length": str(len(data))}

        def getheader(self, name, default=None):
            return self.headers.get(name, default)

        def info(self):
            return self.headers

        def geturl(self):
            return self.url

        def getcode(self):
            return 200

    def fake_urlopen(request, *args, **kwargs):
        url = getattr(request, "full_url", request)
        return FakeResponse(serve_url(url), url)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", lambda self, req, *a, **k: fake_urlopen(req))
    return fetched


# =================================================================================================
# What the fakes received
# =================================================================================================


def sent_images(call_index=-1) -> list:
    """The images the native processor received in one call, flattened, in order."""
    images = HUB.processor_calls[call_index]["images"] or []
    flat = []
    for entry in images:
        flat.extend(entry if isinstance(entry, list) else [entry])
    return flat


def model_load():
    """(api, path, kwargs) of the call that loaded the model weights."""
    loads = [entry for entry in HUB.loads if entry[0].startswith("AutoModel")]
    assert len(loads) == 1, HUB.loads
    return loads[0]


# =================================================================================================
# The decoder, faked: PagedDecoder's protocol in plain Python
# =================================================================================================


class FakeChunked:
    """A chunked prompt as the fake decoder holds it: the whole prompt's inputs, fed `size` tokens a call."""

    def __init__(self, inputs, row, params, prior):
        self.inputs, self.row, self.params, self.prior, self.done = inputs, row, params, prior, 0
        self.length = sum(inputs["attention_mask"]._data[0])


class FakePagedDecoder(PagedDecoder):
    """The real decoder's block bookkeeping (its BlockPool, buckets, forwards) with rows that answer HUB's
    script for their prompt: the fake logits are 10 for the script's token, HUB.runner_up_logit for
    FILLER and 0 elsewhere; end tokens are blocked before min_new_tokens, the generation config's
    repetition penalty applies, and sampled rows draw at their temperature and top_p from HUB.rng.
    A resumed row (preempted, its tokens after its prompt) continues its script where it stopped; a
    chunked prompt is fed `size` tokens a call. Every step checks that each busy row holds the blocks
    of its tokens. The tensor side of the real decoder is tested on real tiny models (tests/)."""

    def __init__(
        self, model, eos_ids, rows, blocks, block_size, use_graph, interval, max_row_tokens=None, prefill_tokens=None
    ):
        self.model, self.eos_ids, self.rows = model, set(eos_ids), rows
        self.use_graph, self.interval, self.block_size = use_graph, interval, block_size
        self.pool = BlockPool(blocks, block_size)
        self.columns = self.pool.capacity + 1
        self.buckets = row_buckets(rows)
        self.forwards = {bucket: model for bucket in self.buckets}
        self.graphs, self.lengths, self.any_sample = {}, {}, False
        self.any_logprobs = self.any_constrained = False  # logprobs and grammars: tested on real tiny models
        self.answers: dict = {}  # row -> its script, tokens so far, params and seen tokens
        self.decode_kernel = False  # as on the CPU
        self.eager_steps, self.capture_s = 0, 0.0
        self.ahead = []  # buckets whose graphs are to be recorded while the engine is idle
        HUB.decoders.append(self)

    def capture_ahead(self, bucket):
        self.ahead.append(bucket)

    def captures_ahead_due(self, ahead=True):  # only decode steps' graphs, each asked for ahead of need
        return bool(self.ahead and ahead)

    def capture_one_ahead(self, ahead=True):
        if self.captures_ahead_due(ahead):
            bucket = self.ahead.pop(0)
            HUB.captured_ahead.append((bucket, self.forwards[bucket] is not self.model, bool(self.lengths)))

    def grow(self, row, tokens):
        self.pool.grow(row, tokens)

    def share(self, row, blocks):
        HUB.shared.append((row, list(blocks)))
        self.pool.share(row, blocks)

    def prefill(self, inputs, rows, params, allowed=None, prior=None):
        HUB.forward_rows.append(len(rows))
        prior = prior or [0] * len(rows)
        ids_rows = [ids[len(ids) - p :] if p else [] for ids, p in zip(inputs["input_ids"]._data, prior)]
        with _quiet():
            prompt_ids = FakeTensor([ids[: len(ids) - p] for ids, p in zip(inputs["input_ids"]._data, prior)])
            mask = inputs.get("attention_mask")
            prompt_mask = FakeTensor([m[: len(m) - p] for m, p in zip(mask._data, prior)]) if mask is not None else None
        prompts, lengths = self.model._prompts(prompt_ids, prompt_mask)
        HUB.resumed.extend(prompt for prompt, p in zip(prompts, prior) if p)
        pixels = inputs.get("pixel_values") if hasattr(inputs, "get") else None
        width = len(inputs["input_ids"]._data[0])
        HUB.prefills.append(
            dict(prompts=prompts, pixel_dtype=getattr(pixels, "_dtype", None), keys=sorted(inputs), width=width)
        )
        first = []
        for row, prompt, p, ids, done, length in zip(rows, prompts, params, prompt_ids._data, ids_rows, lengths):
            self.grow(row, length + len(done))
            self.lengths[row] = length + len(done)
            self.answers[row] = dict(script=HUB.script(prompt), tokens=list(done), params=p, seen=set(ids) | set(done))
            first.append(self._next(row))
        self.any_sample = any(a["params"].do_sample for a in self.answers.values())
        return first

    def begin_chunks(self, inputs, row, params, prior=0):
        HUB.chunked.append(row)
        return FakeChunked(inputs, row, params, prior)

    def prefill_chunk(self, chunked, size, allowed=None):
        end = min(chunked.done + size, chunked.length)
        HUB.chunks.append((chunked.row, end - chunked.done))
        self.pool.grow(chunked.row, end)
        chunked.done = end
        if end < chunked.length:
            return None
        first = self.prefill(chunked.inputs, [chunked.row], [chunked.params], allowed, [chunked.prior])
        return Launched(1, [first], (), None, (chunked.row,))

    def _next(self, row):
        answer = self.answers[row]
        p, k = answer["params"], len(answer["tokens"])
        logits = [0.0] * VOCAB
        logits[FILLER] = HUB.runner_up_logit
        logits[answer["script"][k] if k < len(answer["script"]) else EOS] = 10.0
        if HUB.repetition_penalty:
            for token in answer["seen"]:
                if token < VOCAB:
                    logits[token] = (
                        logits[token] / HUB.repetition_penalty
                        if logits[token] > 0
                        else (logits[token] * HUB.repetition_penalty)
                    )
        if k < p.min_new_tokens:
            for token in self.eos_ids:
                if token < VOCAB:
                    logits[token] = float("-inf")
        if p.do_sample:
            scaled = [x / max(p.temperature, 1e-5) for x in logits]
            top = max(scaled)
            weights = [math.exp(x - top) for x in scaled]
            total = sum(weights)
            order = sorted(range(VOCAB), key=lambda i: -weights[i])
            kept, mass = [], 0.0
            for i in order:
                if mass > p.top_p * total:
                    break
                kept.append(i)
                mass += weights[i]
            token = HUB.rng.choices(kept, [weights[i] for i in kept])[0]
        else:
            token = max(range(VOCAB), key=lambda i: logits[i])
        answer["tokens"].append(token)
        answer["seen"].add(token)
        return token

    def release(self, row):
        self.pool.release(row)
        self.lengths.pop(row, None)
        self.answers.pop(row, None)
        self.any_sample = any(a["params"].do_sample for a in self.answers.values())

    def _advance(self, bucket, span=None):
        HUB.forward_rows.append(bucket)
        if self.forwards[bucket] is not self.model:
            HUB.compiled_steps.append(bucket)

    def launch(self, steps):  # the tokens are chosen at once; the engine hands them out after the next launch
        return Launched(steps, self.step(steps), (), None)

    def read(self, launched):
        return launched.tokens

    def prefill_launch(self, inputs, rows, params, allowed=None, prior=None):
        first = self.prefill(inputs, rows, params, allowed, prior)
        return Launched(1, [[token] for token in first], (), None, tuple(rows))

    def step(self, steps):
        bucket = self.bucket()
        HUB.steps.append((bucket, steps, self.forwards[bucket] is not self.model))
        for row, length in self.lengths.items():  # steps past a row's budget write block 0: their tokens are dropped
            answer = self.answers[row]
            written = min(length + steps, length + answer["params"].max_new_tokens - len(answer["tokens"]))
            if self.pool.blocks_for(written) > len(self.pool.table(row)):
                HUB.protocol_errors.append(f"row {row} stepped past its blocks")
        for _ in range(steps):
            self._advance(bucket)
        for row in self.lengths:
            self.lengths[row] += steps
        return [
            [self._next(row) for _ in range(steps)] if row in self.answers else [PAD] * steps for row in range(bucket)
        ]
