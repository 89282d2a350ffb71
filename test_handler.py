"""Fast, stubbed tests of handler.py: no torch, transformers, torchvision, qwen_vl_utils or
bitsandbytes is imported (run alone: `python -m pytest test_handler.py`).

The stubs are installed into sys.modules by a module-scoped fixture and removed afterwards. They are
a scripted "hub": AutoConfig knows a few model ids, the fake processor/tokenizer encode text one
character per token, and every fake model answers with `HUB.reply` (a string or a function of the
prompt), whether it is driven through generate(), a hand-written decode loop (forward calls that
return one-hot logits), or a remote-code `chat()`. Tests assert on handler outputs and on what the
fakes received, so the engine's internals may change freely.

Every stubbed torch/transformers attribute the handler touches is listed in STUBBED_API; the stubs
record each use, a test checks that the handler exercises exactly that list, and each test fails if
the handler reaches for a torch/transformers attribute the stubs do not provide.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import functools
import io
import itertools
import json
import math
import os
import random
import sys
import types
import urllib.error
import urllib.request

import pytest
from PIL import Image

import handler

# =================================================================================================
# The stubbed API surface
# =================================================================================================

STUBBED_API = frozenset({
    # torch
    "torch.cuda.is_available",
    "torch.cuda.is_bf16_supported",
    "torch.float32",
    "torch.float16",
    "torch.bfloat16",
    "torch.bool",
    "torch.long",
    "torch.float",
    "torch.inference_mode",
    "torch.no_grad",
    "torch.stack",
    "torch.cat",
    "torch.zeros",
    "torch.zeros_like",
    "torch.empty_like",
    "torch.tensor",
    "torch.arange",
    "torch.where",
    "torch.softmax",
    "torch.Tensor.shape",
    "torch.Tensor.__getitem__",
    "torch.Tensor.__setitem__",
    "torch.Tensor.tolist",
    "torch.Tensor.to",
    "torch.Tensor.sum",
    "torch.Tensor.float",
    "torch.Tensor.argmax",
    "torch.Tensor.masked_fill",
    "torch.Tensor.all",
    "torch.Tensor.__bool__",
    "torch.Tensor.__len__",
    "torch.Tensor.__iadd__",
    "torch.Tensor.__ior__",
    "torch.Tensor.__and__",
    "torch.Tensor.__or__",
    "torch.Tensor.__gt__",
    "torch.Tensor.__ge__",
    "torch.Tensor.__lt__",
    "torch.Tensor.__add__",
    "torch.Tensor.__sub__",
    "torch.Tensor.__mul__",
    "torch.Tensor.__truediv__",
    "torch.Tensor.fill_",
    "torch.Tensor.zero_",
    "torch.Tensor.copy_",
    "torch.Tensor.index_copy_",
    "torch.Tensor.scatter_",
    "torch.Tensor.scatter",
    "torch.Tensor.sort",
    "torch.Tensor.cumsum",
    "torch.Tensor.exponential_",
    "torch.Tensor.clamp",
    "torch.nn.Linear.weight",
    # torch: the compiled path (torch.compile, CUDA graphs on a side stream)
    "torch.compile",
    "torch.cuda.Stream",
    "torch.cuda.Stream.wait_stream",
    "torch.cuda.current_stream",
    "torch.cuda.stream",
    "torch.cuda.CUDAGraph",
    "torch.cuda.CUDAGraph.replay",
    "torch.cuda.graph",
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
    "transformers.StaticCache",
    "transformers.StaticCache.reset",
    # transformers: models
    "transformers.PreTrainedModel.eval",
    "transformers.PreTrainedModel.generate",
    "transformers.PreTrainedModel.__call__",
    "transformers.PreTrainedModel.get_output_embeddings",
    "transformers.PreTrainedModel._prepare_position_ids_for_generation",
    "transformers.PreTrainedModel.device",
    "transformers.PreTrainedModel.dtype",
    "transformers.PreTrainedModel.config",
    "transformers.PreTrainedModel.generation_config",
    "transformers.GenerationConfig.eos_token_id",
    "transformers.GenerationConfig.repetition_penalty",
    "transformers.ModelOutput.logits",
    # transformers: processors and tokenizers
    "transformers.ProcessorMixin.__call__",
    "transformers.ProcessorMixin.apply_chat_template",
    "transformers.ProcessorMixin.tokenizer",
    "transformers.BatchFeature.to",
    "transformers.BatchFeature.__getitem__",
    "transformers.BatchFeature.__setitem__",
    "transformers.BatchFeature.__contains__",
    "transformers.PreTrainedTokenizerBase.__call__",
    "transformers.PreTrainedTokenizerBase.decode",
    "transformers.PreTrainedTokenizerBase.apply_chat_template",
    "transformers.PreTrainedTokenizerBase.eos_token_id",
    "transformers.PreTrainedTokenizerBase.padding_side",
    # trust_remote_code model APIs
    "remote.MiniCPMV.chat",
    "remote.InternVLChatModel.chat",
})

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
        key = key[:i] + (slice(None),) * (ndim - used) + key[i + 1:]
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


# ---- CUDA graphs, faked: ops run at once, and the ops run while capturing are recorded as a tape
# that replay() runs again on the same tensor objects (Python control flow is frozen, as on a GPU).

CAPTURE: list = [None]  # the node list of the graph being captured, or None
_OP_DEPTH = [0]


def _op(fn):
    """A tensor op: runs at once, and is recorded (outermost calls only) while a graph captures."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _OP_DEPTH[0]:
            return fn(*args, **kwargs)
        _OP_DEPTH[0] += 1
        try:
            result = fn(*args, **kwargs)
        finally:
            _OP_DEPTH[0] -= 1
        if CAPTURE[0] is not None:
            CAPTURE[0].append((fn, args, kwargs, result))
        return result

    return wrapper


def _refresh(old, new) -> None:
    """Write a replayed op's result into the object the capture handed out (its 'graph memory')."""
    if old is new:
        return
    if isinstance(old, FakeTensor):
        old._data, old._dtype = new._data, new._dtype
    elif isinstance(old, FakeOutput):
        _refresh(old._logits, new._logits)
    elif isinstance(old, (tuple, list)):
        for o, n in zip(old, new):
            _refresh(o, n)


def _sync(what: str) -> None:
    """Reading a GPU value on the host while a graph captures fails on a GPU: fail here too."""
    if CAPTURE[0] is not None and not _QUIET[0]:
        HUB.protocol_errors.append(f"{what} during CUDA graph capture (a host sync cannot be captured)")
        raise RuntimeError("operation not permitted when stream is capturing")


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


class FakeTensor:
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
    def of(value, like=None) -> "FakeTensor":
        if isinstance(value, FakeTensor):
            return value
        return FakeTensor(value, _infer_dtype(value), getattr(like, "_device", "cpu"))

    def _binary(self, other, fn, dtype=None) -> "FakeTensor":
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
    @property
    def shape(self) -> tuple:
        _use("torch.Tensor.shape")
        return self.dims

    @property
    def dtype(self):
        _use("torch.Tensor.dtype")
        return self._dtype

    @_op
    def __getitem__(self, key):
        _use("torch.Tensor.__getitem__")
        if isinstance(key, list) or (isinstance(key, FakeTensor) and key.dims):
            # Advanced indexing by a list or an integer tensor on the first dimension.
            index = key._data if isinstance(key, FakeTensor) else key
            if isinstance(key, FakeTensor) and key._dtype.kind != "int":
                raise NotImplementedError("the fake tensor takes integer index tensors only")
            return FakeTensor(_map(index, lambda i: copy.deepcopy(self._data[i])), self._dtype, self._device)
        return FakeTensor(_index(self._data, _norm_key(key, len(self.dims))), self._dtype, self._device)

    @_op
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
        _sync("tolist()")
        return copy.deepcopy(self._data)

    @_op
    def to(self, *args, **kwargs):
        _use("torch.Tensor.to")
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, FakeDtype)), self._dtype)
        device = kwargs.get("device") or next((a for a in args if isinstance(a, str)), self._device)
        return FakeTensor(self._data, dtype, str(device))

    @_op
    def sum(self, dim=None):
        _use("torch.Tensor.sum")
        dtype = F32 if self._dtype.kind == "float" else I64
        if dim is None:
            return FakeTensor(sum(_flat(self._data)), dtype, self._device)
        _last_dim(self.dims, dim, "sum over a dimension")
        return FakeTensor(_rows(self._data, sum), dtype, self._device)

    @_op
    def float(self):
        _use("torch.Tensor.float")
        return FakeTensor(self._data, F32, self._device)

    @_op
    def argmax(self, dim=-1):
        _use("torch.Tensor.argmax")
        _last_dim(self.dims, dim, "argmax")

        def go(d):
            if isinstance(d[0], list):
                return [go(x) for x in d]
            return max(range(len(d)), key=lambda i: (d[i], -i))

        return FakeTensor(go(self._data), I64, self._device)

    @_op
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

    @_op
    def all(self):
        _use("torch.Tensor.all")
        return FakeTensor(all(_flat(self._data)), BOOL, self._device)

    def __bool__(self):
        _use("torch.Tensor.__bool__")
        _sync("bool(tensor)")
        return bool(self._single())

    def __int__(self):
        _use("torch.Tensor.__int__")
        _sync("int(tensor)")
        return int(self._single())

    def __len__(self):
        _use("torch.Tensor.__len__")
        if not self.dims:
            raise TypeError("len() of a 0-d tensor")
        return self.dims[0]

    def _in_place(self, other, fn, dtype) -> "FakeTensor":
        result = self._binary(other, fn, dtype)
        if result.dims != self.dims:
            raise RuntimeError("an in-place operation may not change the shape")
        self._data = result._data
        return self

    @_op
    def __iadd__(self, other):
        _use("torch.Tensor.__iadd__")
        return self._in_place(other, lambda a, b: a + b, self._dtype)

    @_op
    def __ior__(self, other):
        _use("torch.Tensor.__ior__")
        return self._in_place(other, lambda a, b: bool(a) or bool(b), BOOL)

    @_op
    def __and__(self, other):
        _use("torch.Tensor.__and__")
        return self._binary(other, lambda a, b: bool(a) and bool(b), BOOL)

    @_op
    def __or__(self, other):
        _use("torch.Tensor.__or__")
        return self._binary(other, lambda a, b: bool(a) or bool(b), BOOL)

    @_op
    def __gt__(self, other):
        _use("torch.Tensor.__gt__")
        return self._binary(other, lambda a, b: a > b, BOOL)

    @_op
    def __ge__(self, other):
        _use("torch.Tensor.__ge__")
        return self._binary(other, lambda a, b: a >= b, BOOL)

    @_op
    def __lt__(self, other):
        _use("torch.Tensor.__lt__")
        return self._binary(other, lambda a, b: a < b, BOOL)

    @_op
    def __add__(self, other):
        _use("torch.Tensor.__add__")
        return self._binary(other, lambda a, b: a + b)

    @_op
    def __sub__(self, other):
        _use("torch.Tensor.__sub__")
        return self._binary(other, lambda a, b: a - b)

    @_op
    def __mul__(self, other):
        _use("torch.Tensor.__mul__")
        return self._binary(other, lambda a, b: a * b)

    @_op
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
    @_op
    def fill_(self, value):
        _use("torch.Tensor.fill_")
        value = value._single() if isinstance(value, FakeTensor) else value
        self._data = _filled(list(self.dims), _cast(value, self._dtype))
        return self

    @_op
    def zero_(self):
        _use("torch.Tensor.zero_")
        self._data = _filled(list(self.dims), _cast(0, self._dtype))
        return self

    @_op
    def copy_(self, src):
        _use("torch.Tensor.copy_")
        src = FakeTensor.of(src, self)  # any device: copy_ moves data
        if _broadcast_shape(self.dims, src.dims) != self.dims:
            raise RuntimeError(f"copy_ of shape {src.dims} into {self.dims}")
        self._data = _map(_expand(src._data, src.dims, self.dims), lambda v: _cast(v, self._dtype))
        return self

    @_op
    def index_copy_(self, dim, index, source):
        _use("torch.Tensor.index_copy_")
        _same_device(self, index, source)
        dims, dim = self.dims, dim % len(self.dims)
        positions = list(_flat(index._data))
        if source.dims != dims[:dim] + (len(positions),) + dims[dim + 1:]:
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

    @_op
    def scatter_(self, dim, index, src):
        _use("torch.Tensor.scatter_")
        self._scatter_into(dim, index, src)
        return self

    @_op
    def scatter(self, dim, index, src):
        _use("torch.Tensor.scatter")
        out = FakeTensor(self._data, self._dtype, self._device)
        out._scatter_into(dim, index, src)
        return out

    # sampling
    @_op
    def sort(self, dim=-1, descending=False):
        _use("torch.Tensor.sort")
        _last_dim(self.dims, dim, "sort")
        values, indices = [], []

        def go(row):
            order = sorted(range(len(row)), key=lambda i: (-row[i], i) if descending else (row[i], i))
            return [row[i] for i in order], order

        pairs = _rows(self._data, go)

        def split(p, k):
            return [split(x, k) for x in p] if isinstance(p, list) else p[k]

        return (FakeTensor(split(pairs, 0), self._dtype, self._device),
                FakeTensor(split(pairs, 1), I64, self._device))

    @_op
    def cumsum(self, dim=-1):
        _use("torch.Tensor.cumsum")
        _last_dim(self.dims, dim, "cumsum")
        return FakeTensor(_rows(self._data, lambda row: list(itertools.accumulate(row))), self._dtype, self._device)

    @_op
    def exponential_(self, lambd=1.0):
        _use("torch.Tensor.exponential_")
        self._data = _map(self._data, lambda v: HUB.rng.expovariate(lambd))
        return self

    @_op
    def clamp(self, min=None, max=None):
        _use("torch.Tensor.clamp")

        def bound(v):
            if min is not None and v < min:
                v = min
            if max is not None and v > max:
                v = max
            return v

        return FakeTensor(_map(self._data, bound), self._dtype, self._device)


class FakeImageTensor:
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


@_op
def torch_zeros(*size, dtype=None, device=None):
    _use("torch.zeros")
    dtype = dtype or F32
    return FakeTensor(_filled(_sizes(size), _cast(0, dtype)), dtype, str(device or "cpu"))


@_op
def torch_zeros_like(tensor, dtype=None, device=None):
    _use("torch.zeros_like")
    dtype = dtype or tensor._dtype
    return FakeTensor(_filled(list(tensor.dims), _cast(0, dtype)), dtype, str(device or tensor._device))


@_op
def torch_empty_like(tensor, dtype=None, device=None):
    _use("torch.empty_like")
    dtype = dtype or tensor._dtype
    return FakeTensor(_filled(list(tensor.dims), _cast(0, dtype)), dtype, str(device or tensor._device))


@_op
def torch_tensor(data, dtype=None, device=None):
    _use("torch.tensor")
    return FakeTensor(data, dtype or _infer_dtype(data), str(device or "cpu"))


@_op
def torch_arange(start, end=None, step=1, dtype=None, device=None):
    _use("torch.arange")
    if end is None:
        start, end = 0, start
    return FakeTensor(list(range(int(start), int(end), int(step))), dtype or I64, str(device or "cpu"))


@_op
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


@_op
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
            (sum(t.dims[0] for t in tensors),) + rest, [x for t in tensors for x in t.tiles],
            tensors[0]._dtype, tensors[0]._device, all(t.normalized for t in tensors),
        )
    raise NotImplementedError("the handler concatenates image stacks only")


def torch_stack(tensors, dim=0):
    _use("torch.stack")
    tensors = list(tensors)
    if dim != 0:
        raise NotImplementedError("the fake stack works on dim 0 only")
    if all(isinstance(t, FakeImageTensor) for t in tensors):
        return FakeImageTensor(
            (len(tensors),) + tensors[0].dims, [x for t in tensors for x in t.tiles],
            tensors[0]._dtype, tensors[0]._device, all(t.normalized for t in tensors),
        )
    return FakeTensor([_ensure_tensor(t)._data for t in tensors])


def torch_compile(fn, dynamic=None, **kwargs):
    """The compiled function is the function itself, counted, and recorded as one op in a graph."""
    _use("torch.compile")
    HUB.compiles.append(dict(kwargs, dynamic=dynamic))
    owner = getattr(fn, "__self__", None)

    @_op
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


class FakeCUDAGraph:
    """A captured step: the tape of ops recorded under torch.cuda.graph(), run again by replay()."""

    def __init__(self, keep_graph=False):
        self.nodes, self.captured, self.replays = [], False, 0
        HUB.graphs.append(self)

    def replay(self):
        _use("torch.cuda.CUDAGraph.replay")
        if not self.captured:
            raise RuntimeError("replay() of a graph that was never captured")
        if CAPTURE[0] is not None:
            raise RuntimeError("replay() while another graph captures")
        self.replays += 1
        with _quiet():
            for fn, args, kwargs, result in self.nodes:
                _refresh(result, fn(*args, **kwargs))


@contextlib.contextmanager
def _graph_cm(graph):
    if CAPTURE[0] is not None:
        raise RuntimeError("a graph capture is already under way")
    HUB.capture_attempts += 1
    if HUB.capture_failures:
        HUB.capture_failures -= 1
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture (fake)")
    graph.nodes.clear()
    CAPTURE[0] = graph.nodes
    try:
        yield graph
    finally:
        CAPTURE[0] = None
    if not graph.nodes:
        raise RuntimeError("the captured graph is empty")
    graph.captured = True


def cuda_graph(graph, pool=None, stream=None, **kwargs):
    _use("torch.cuda.graph")
    return _graph_cm(graph)


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
    if tuple(mean) != handler.InternVL2Adapter.mean or tuple(std) != handler.InternVL2Adapter.std:
        HUB.protocol_errors.append(f"InternVL tiles normalised with {mean}/{std}")
    return FakeImageTensor(tensor.dims, tensor.tiles, tensor._dtype, tensor._device, normalized=True)


# =================================================================================================
# The scripted hub: tokenizer, processor, models
# =================================================================================================

SPECIALS = [
    "<pad>", "<s>", "</s>", "<image>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
]
SPECIAL_IDS = {s: i for i, s in enumerate(SPECIALS)}
PAD, EOS, END = SPECIAL_IDS["<pad>"], SPECIAL_IDS["</s>"], SPECIAL_IDS["<|end|>"]
CHAR_BASE = 100
VOCAB = CHAR_BASE + 128
FILLER = CHAR_BASE + ord("~")  # the fake model's second choice, picked when its first is forbidden


def encode(text: str) -> list:
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
}
NATIVE_TYPES = {"qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "idefics3", "qwen3_vl", "gemma3", "paligemma",
                "smolvlm", "llava_onevision", "internvl", "mistral3", "glm4v"}

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
        self.protocol_errors = []
        self.reply = "ok"
        self.cuda_available = False
        self.bf16_supported = True
        self.device = "cpu"
        self.repetition_penalty = None
        self.inference_depth = 0
        self.static_caches = []
        self.context = 32768  # the text model's max_position_embeddings
        self.extra_eos = []  # more end tokens in the generation config (ids may lie past the vocabulary)
        self.rng = random.Random(1234)  # the fake GPU's sampling noise: seeded, so runs repeat
        self.compiles = []  # torch.compile calls
        self.graphs = []  # every torch.cuda.CUDAGraph made
        self.capture_attempts = 0
        self.capture_failures = 0  # the next N captures fail
        self.stream = FakeStream()  # the current CUDA stream
        self.decode_steps = 0  # forward calls that decoded a real token (after a prefill)
        self.scratch_steps = 0  # forward calls on scratch state (warm-up and capture of a graph)
        self.decode_calls = []  # what each Decoder.run received: rows and per-row params

    def respond(self, prompt: str) -> str:
        return self.reply(prompt) if callable(self.reply) else self.reply

    def script(self, prompt: str) -> list:
        return encode(self.respond(prompt)) + [EOS]


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
            raise OSError(f"{path} is not a local folder and is not a valid model identifier (secret-hub-detail)")
        return FakeConfig(MODEL_TYPES[path])


class FakeTokenizer:
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
            return {"input_ids": [encode(t) for t in text]}
        return {"input_ids": encode(text)}

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


class FakeProcessor:
    def __init__(self, path, kwargs):
        self.path, self.kwargs = path, kwargs
        self._tokenizer = FakeTokenizer()

    @property
    def tokenizer(self):
        _use("transformers.ProcessorMixin.tokenizer")
        return self._tokenizer

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        _use("transformers.ProcessorMixin.apply_chat_template")
        HUB.templates.append(copy.deepcopy(messages))
        HUB.template_kwargs.append(dict(tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs))
        return render(messages, add_generation_prompt)

    def __call__(self, text=None, images=None, padding=False, return_tensors=None, **kwargs):
        _use("transformers.ProcessorMixin.__call__")
        with _quiet():
            texts = [text] if isinstance(text, str) else list(text)
            HUB.processor_calls.append(dict(text=texts, images=images, padding=padding,
                                            return_tensors=return_tensors, **kwargs))
            rows = [encode(t) for t in texts]
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

    @_op
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
            if width > 1 or cache_position is None:  # a prefill: a new batch
                if isinstance(cache, FakeStaticCache) and cache.dirty:
                    HUB.protocol_errors.append("a static cache was reused for a new batch without reset()")
                mask = kwargs.get("attention_mask")
                prompts, real = self._prompts(input_ids, mask)
                self._scripts = [HUB.script(p) for p in prompts]
                self._real, self._prompt_length, self._step = real, width, 0
                self._prompt_mask = mask._data if mask is not None else [[1] * width for _ in range(rows)]
                pixels = kwargs.get("pixel_values")
                HUB.prefills.append(dict(
                    prompts=prompts, pixel_dtype=getattr(pixels, "_dtype", None),
                    keys=sorted(kwargs), cache=cache,
                ))
                last = width - 1 if cache_position is None else cache_position._data[-1]
            elif self._scripts is None or cache_position._data[0] < self._prompt_length:
                # Any in-range state will do to warm up or capture a step: answer, remember nothing.
                HUB.scratch_steps += 1
                if isinstance(cache, FakeStaticCache):
                    cache.dirty = True
                row = [0.0] * VOCAB
                row[EOS] = 10.0
                return FakeOutput(FakeTensor([[row] for _ in range(rows)], F32, HUB.device))
            else:
                self._step += 1
                step = self._step
                HUB.decode_steps += 1
                if rows != len(self._scripts):
                    HUB.protocol_errors.append(f"decode step {step}: {rows} rows after a prefill of {len(self._scripts)}")
                if cache is not HUB.prefills[-1]["cache"]:
                    HUB.protocol_errors.append(f"decode step {step}: not the prefill's KV cache")
                last = self._prompt_length + step - 1
                if cache_position is not None and cache_position.tolist() != [last]:
                    HUB.protocol_errors.append(
                        f"decode step {step}: cache_position {cache_position.tolist()}, expected [{last}]")
                positions = kwargs.get("position_ids")
                if positions is not None:
                    got = [row[-1] for row in positions._data]
                    want = [n + step - 1 for n in self._real]
                    if got != want:
                        HUB.protocol_errors.append(f"decode step {step}: position_ids {got}, expected {want}")
                mask = kwargs.get("attention_mask")
                if mask is not None:
                    for r, (m, prompt_mask) in enumerate(zip(mask._data, self._prompt_mask)):
                        if m[:self._prompt_length] != prompt_mask or not all(m[self._prompt_length:last + 1]):
                            HUB.protocol_errors.append(f"decode step {step}: row {r}'s attention mask hides "
                                                       "a token it should see or shows padding")
                            break
            if isinstance(cache, FakeStaticCache):
                cache.dirty = True
                if cache.max_cache_len is not None and last >= cache.max_cache_len:
                    HUB.protocol_errors.append(f"position {last} written past a cache of {cache.max_cache_len}")
            logits = []
            for script in self._scripts:
                token = script[self._step] if self._step < len(script) else EOS
                row = [0.0] * VOCAB
                row[FILLER] = 5.0
                row[token] = 10.0
                logits.append([row])
            return FakeOutput(FakeTensor(logits, F32, HUB.device))

    # ---- generate() ----
    def generate(self, input_ids=None, attention_mask=None, max_new_tokens=20, min_new_tokens=0,
                 pad_token_id=None, eos_token_id=None, **kwargs):
        _use("transformers.PreTrainedModel.generate")
        with _quiet():
            self._check_inference("generate")
            HUB.generate_calls.append(dict(kwargs, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                           pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                                           rows=len(input_ids._data), pixel_values=kwargs.get("pixel_values")))
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


class FakeMiniCPMV(FakeModelBase):
    def chat(self, image=None, msgs=None, tokenizer=None, **kwargs):
        _use("remote.MiniCPMV.chat")
        with _quiet():
            HUB.chat_calls.append(dict(
                image=image, tokenizer=tokenizer, kwargs=kwargs,
                msgs=[{"role": m["role"], "content": list(m["content"])} for m in msgs],
            ))
            last = msgs[-1]["content"]
            question = " ".join(p for p in last if isinstance(p, str)) if isinstance(last, list) else last
            return HUB.respond(question)


class FakeInternVL(FakeModelBase):
    def chat(self, tokenizer, pixel_values, question, generation_config, history=None,
             return_history=False, num_patches_list=None, **kwargs):
        _use("remote.InternVLChatModel.chat")
        with _quiet():
            if pixel_values is not None and pixel_values.dims[0] != sum(num_patches_list or [pixel_values.dims[0]]):
                HUB.protocol_errors.append("InternVL pixel_values rows != sum(num_patches_list)")
            HUB.chat_calls.append(dict(
                tokenizer=tokenizer, pixel_values=pixel_values, question=question,
                generation_config=generation_config, history=history, num_patches_list=num_patches_list,
                kwargs=kwargs,
            ))
            return HUB.respond(question)


def _loader(api: str, factory, allowed_types):
    class Loader:
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            _use(f"transformers.{api}.from_pretrained")
            HUB.loads.append((api, path, kwargs))
            model_type = MODEL_TYPES.get(path)
            if allowed_types is not None and model_type not in allowed_types:
                raise ValueError(f"Unrecognized configuration class for {api}: {model_type}")
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


class _StubModule(types.ModuleType):
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
        raise AttributeError(f"stub module {self.__name__!r} has no attribute {attr!r}: add a stub and list it in STUBBED_API")


def build_stub_modules() -> dict:
    cuda = _StubModule("torch.cuda", {
        "is_available": cuda_is_available, "is_bf16_supported": cuda_is_bf16_supported,
        "Stream": FakeStream, "current_stream": cuda_current_stream, "stream": cuda_stream,
        "CUDAGraph": FakeCUDAGraph, "graph": cuda_graph,
    })
    torch = _StubModule(
        "torch",
        {
            "float32": F32, "float16": F16, "bfloat16": BF16, "bool": BOOL, "long": I64, "float": F32,
            "inference_mode": torch_inference_mode, "no_grad": torch_no_grad, "stack": torch_stack, "cat": torch_cat,
            "zeros": torch_zeros, "zeros_like": torch_zeros_like, "empty_like": torch_empty_like,
            "tensor": torch_tensor, "arange": torch_arange, "where": torch_where, "softmax": torch_softmax,
            "compile": torch_compile,
        },
        {"cuda": cuda, "Tensor": FakeTensor},
    )
    functional = _StubModule(
        "torchvision.transforms.functional", {"to_tensor": tv_to_tensor, "normalize": tv_normalize}
    )
    transforms = _StubModule("torchvision.transforms", {}, {"functional": functional})
    torchvision = _StubModule("torchvision", {}, {"transforms": transforms})
    transformers = _StubModule(
        "transformers",
        {"__version__": "5.0.0"},
        {
            "AutoConfig": FakeAutoConfig,
            "AutoProcessor": _loader("AutoProcessor", FakeProcessor, None),
            "AutoModelForImageTextToText": _loader("AutoModelForImageTextToText", FakeModel, NATIVE_TYPES),
            "AutoModelForCausalLM": _loader("AutoModelForCausalLM", FakeModel, {"phi3_v"}),
            "AutoModel": _loader("AutoModel", _remote_model, {"minicpmv", "internvl_chat"}),
            "AutoTokenizer": _loader("AutoTokenizer", lambda path, kwargs: FakeTokenizer(), None),
            "BitsAndBytesConfig": FakeBitsAndBytesConfig,
            "StaticCache": FakeStaticCache,
        },
    )
    return {
        "torch": torch, "torch.cuda": cuda, "torchvision": torchvision,
        "torchvision.transforms": transforms, "torchvision.transforms.functional": functional,
        "transformers": transformers,
        # Absent, as on a machine without them: importing either fails.
        "qwen_vl_utils": None, "bitsandbytes": None,
    }


# =================================================================================================
# Fixtures and helpers
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


@pytest.fixture(autouse=True)
def hub(monkeypatch):
    for key in list(os.environ):
        if key.startswith("VLM_"):
            monkeypatch.delenv(key)
    HUB.reset()
    MISSING.clear()
    handler.reset_engine()
    decoder = getattr(handler, "Decoder", None)
    if decoder is not None:  # record what each batch's decoding was asked for, row by row
        run = decoder.run

        def spy(self, inputs, params):
            HUB.decode_calls.append(dict(
                rows=self.rows, length=self.length, params=[dataclasses.replace(p) for p in params],
                **{field: [getattr(p, field) for p in params]
                   for field in ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p")},
            ))
            return run(self, inputs, params)

        monkeypatch.setattr(decoder, "run", spy)
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

    if hasattr(handler, "fetch_image_url"):
        def fake_fetch(url, policy=None, param=None, *args, **kwargs):
            check = getattr(handler, "check_image_url", None)
            if check is not None and policy is not None:
                check(url, policy, param)  # the policy still decides what may be fetched
            try:
                return serve_url(url)
            except urllib.error.URLError:
                raise handler.RequestError("fetch_failed", "the image URL could not be fetched", param) from None

        monkeypatch.setattr(handler, "fetch_image_url", fake_fetch)

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


def png(width=16, height=12, color=(200, 30, 30), mode="RGB", fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    fill = color if mode in ("RGB", "RGBA") else (color[0] if mode in ("L", "P") else color)
    if mode == "RGBA":
        fill = tuple(color) + (255,)
    Image.new(mode, (width, height), fill).save(buffer, fmt)
    return buffer.getvalue()


def b64(width=16, height=12, **kwargs) -> str:
    return base64.b64encode(png(width, height, **kwargs)).decode()


def data_uri(width=16, height=12, **kwargs) -> str:
    return "data:image/png;base64," + b64(width, height, **kwargs)


def call(payload, job_id="job-1") -> dict:
    out = handler.handler({"id": job_id, "input": payload})
    assert isinstance(out, dict)
    json.dumps(out)  # always JSON-serialisable
    return out


def assert_error(out: dict, param, code=None) -> None:
    assert "error" in out, out
    assert "response" not in out
    assert out.get("param") == param, out
    if param:
        assert param in out["error"], out
    if code is not None:
        assert out.get("code") == code, out
    assert "Traceback" not in json.dumps(out)


def serve(monkeypatch, model=QWEN, **env):
    monkeypatch.setenv("VLM_MODEL", model)
    if model not in handler.CURATED_MODELS:
        monkeypatch.setenv("VLM_ALLOW_ANY", "true")
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))


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


def load_dtype(kwargs):
    return kwargs.get("dtype", kwargs.get("torch_dtype"))


def user_text(messages) -> str:
    """All text of the last user message handed to a chat template."""
    content = [m for m in messages if m["role"] == "user"][-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content)


def caption(image=None, **extra):
    return dict({"task": "caption", "image_b64": image or b64()}, **extra)


def chat(text="hi", **extra):
    return dict({"messages": [{"role": "user", "content": text}]}, **extra)


# =================================================================================================
# Smoke
# =================================================================================================


def test_stubs_are_installed_and_real_libraries_are_not_imported():
    assert isinstance(sys.modules["torch"], _StubModule)
    assert isinstance(sys.modules["transformers"], _StubModule)
    assert sys.modules["bitsandbytes"] is None and sys.modules["qwen_vl_utils"] is None


def test_caption_smoke(monkeypatch):
    serve(monkeypatch)
    out = call(caption())
    assert out["response"] == "ok", out


# =================================================================================================
# Settings
# =================================================================================================


def test_settings_defaults_from_an_empty_environment():
    settings = handler.Settings.from_env({})
    assert settings.model == handler.DEFAULT_MODEL
    assert settings.quantize == "none" and settings.dtype == "auto"
    assert settings.allow_any is False and settings.trust_remote_code is True
    assert settings.max_new_tokens_cap >= settings.default_max_new_tokens >= 1


def test_settings_parse_values_case_and_whitespace():
    settings = handler.Settings.from_env({
        "VLM_MODEL": f"  {LLAVA}  ", "VLM_QUANTIZE": " 4BIT ", "VLM_DTYPE": "BF16", "VLM_ALLOW_ANY": "Yes",
        "VLM_TRUST_REMOTE_CODE": "off", "VLM_MAX_NEW_TOKENS": "77", "VLM_DEFAULT_MAX_NEW_TOKENS": "",
        "VLM_MAX_BATCH_SIZE": "3", "VLM_MIN_PIXELS": "0", "VLM_COMPILE": "0",
    })
    assert settings.model == LLAVA
    assert settings.quantize == "4bit" and settings.dtype == "bf16"
    assert settings.allow_any is True and settings.trust_remote_code is False and settings.compile is False
    assert settings.max_new_tokens_cap == 77 and settings.max_batch_size == 3
    assert settings.default_max_new_tokens == handler.Settings().default_max_new_tokens  # empty -> default


@pytest.mark.parametrize("name, value", [
    ("VLM_QUANTIZE", "3bit"),
    ("VLM_DTYPE", "int8"),
    ("VLM_ALLOW_ANY", "maybe"),
    ("VLM_TRUST_REMOTE_CODE", "2"),
    ("VLM_COMPILE", "sometimes"),
    ("VLM_MAX_NEW_TOKENS", "abc"),
    ("VLM_MAX_NEW_TOKENS", "0"),
    ("VLM_MAX_BATCH_SIZE", "-1"),
    ("VLM_MAX_IMAGES", "1.5"),
    ("VLM_MIN_PIXELS", "-5"),
])
def test_bad_setting_raises_settings_error_naming_it(name, value):
    with pytest.raises(handler.SettingsError) as info:
        handler.Settings.from_env({name: value})
    assert name in str(info.value)
    assert value.strip() in str(info.value)


def test_bad_setting_is_reported_by_the_handler_not_raised(monkeypatch, hub):
    serve(monkeypatch, VLM_QUANTIZE="bogus")
    out = call(caption())
    assert out["code"] == "worker_misconfigured"
    assert "VLM_QUANTIZE" in out["error"]
    assert not hub.loads  # nothing was loaded with broken settings


# =================================================================================================
# Loading: allow-list, loaders, dtype, quantization
# =================================================================================================


def test_uncurated_model_is_refused_and_the_message_names_vlm_allow_any(monkeypatch, hub):
    monkeypatch.setenv("VLM_MODEL", GENERIC)
    out = call(caption())
    assert out["code"] == "worker_misconfigured"
    assert "VLM_ALLOW_ANY" in out["error"] and GENERIC in out["error"]
    assert not [entry for entry in hub.loads if entry[0].startswith("AutoModel")]


def test_allow_any_serves_an_uncurated_native_model_with_the_generic_adapter(monkeypatch, hub):
    serve(monkeypatch, GENERIC)
    out = call(chat("What is this?", images=[b64()]))
    assert out["response"] == "ok" and out["model"] == GENERIC
    api, path, _ = model_load()
    assert (api, path) == ("AutoModelForImageTextToText", GENERIC)
    assert hub.templates[-1] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]


EXPECTED_LOADERS = {
    "qwen2-vl": ("AutoProcessor", "AutoModelForImageTextToText"),
    "qwen2.5-vl": ("AutoProcessor", "AutoModelForImageTextToText"),
    "llava": ("AutoProcessor", "AutoModelForImageTextToText"),
    "llava-next": ("AutoProcessor", "AutoModelForImageTextToText"),
    **{family: ("AutoProcessor", "AutoModelForImageTextToText")
       for family in ("qwen3-vl", "gemma3", "paligemma", "smolvlm", "llava-onevision", "internvl-hf", "mistral3",
                      "glm-4.1v")},
    "phi3-vision": ("AutoProcessor", "AutoModelForCausalLM"),
    "minicpm-v": ("AutoTokenizer", "AutoModel"),
    "internvl": ("AutoTokenizer", "AutoModel"),
}


@pytest.mark.parametrize("model_id", sorted(handler.CURATED_MODELS))
def test_every_curated_model_loads_through_its_familys_loaders(monkeypatch, hub, model_id):
    assert model_id in MODEL_TYPES, f"add {model_id}'s model_type to the fake hub"
    serve(monkeypatch, model_id)
    out = call(caption())
    assert out.get("response") == "ok", out
    family = handler.CURATED_MODELS[model_id].family
    assert handler.get_engine().adapter.name == family
    processor_api, model_api = EXPECTED_LOADERS[family]
    apis = [api for api, path, _ in hub.loads if path == model_id]
    assert apis[0] == "AutoConfig"
    assert processor_api in apis and model_api in apis
    api, _, kwargs = model_load()
    assert api == model_api
    assert kwargs["trust_remote_code"] is True
    assert hub.models[0].evaluated  # .eval() before serving


def test_remote_code_family_needs_trust_remote_code(monkeypatch, hub):
    serve(monkeypatch, MINICPM, VLM_TRUST_REMOTE_CODE="false")
    out = call(caption())
    assert out["code"] == "worker_misconfigured"
    assert "VLM_TRUST_REMOTE_CODE" in out["error"]
    assert not hub.models


def test_native_family_loads_without_remote_code(monkeypatch, hub):
    serve(monkeypatch, LLAVA, VLM_TRUST_REMOTE_CODE="false")
    assert call(caption())["response"] == "ok"
    assert all(kwargs.get("trust_remote_code") is False for _, _, kwargs in hub.loads)


def test_a_load_failure_is_a_clean_error_and_leaks_nothing(monkeypatch, hub):
    serve(monkeypatch, "someone/missing-model")
    out = call(caption())
    assert "error" in out and "response" not in out
    assert "secret-hub-detail" not in json.dumps(out) and "Traceback" not in json.dumps(out)
    hub.reset()
    serve(monkeypatch, QWEN)  # the worker is not wedged: a good configuration then loads
    assert call(caption())["response"] == "ok"


@pytest.mark.parametrize("cuda, bf16, choice, expected", [
    (False, False, "auto", F32),
    (True, True, "auto", BF16),
    (True, False, "auto", F16),
    (False, True, "fp16", F16),
    (False, True, "bf16", BF16),
    (True, True, "fp32", F32),
])
def test_dtype_choice(monkeypatch, hub, cuda, bf16, choice, expected):
    hub.cuda_available, hub.bf16_supported = cuda, bf16
    serve(monkeypatch, QWEN, VLM_DTYPE=choice)
    out = call(caption())
    assert out["response"] == "ok"
    assert load_dtype(model_load()[2]) is expected
    assert hub.prefills[-1]["pixel_dtype"] is expected  # pixels are cast to the model's dtype


EXPECTED_SKIPS = {
    QWEN: {"model.visual", "lm_head"},
    LLAVA: {"model.vision_tower", "model.multi_modal_projector", "lm_head"},
    LLAVA_NEXT: {"model.vision_tower", "model.multi_modal_projector", "lm_head"},
    MINICPM: {"vpm", "resampler", "lm_head"},
    PHI3: {"model.vision_embed_tokens", "lm_head"},
    INTERNVL: {"vision_model", "mlp1", "lm_head"},
}


@pytest.mark.parametrize("mode", ["4bit", "8bit"])
@pytest.mark.parametrize("model_id", list(EXPECTED_SKIPS))
def test_quantization_config_handed_to_from_pretrained(monkeypatch, model_id, mode):
    serve(monkeypatch, model_id, VLM_QUANTIZE=mode)
    assert call(caption()).get("response") == "ok"
    kwargs = model_load()[2]
    config = kwargs["quantization_config"]
    assert isinstance(config, FakeBitsAndBytesConfig)
    args = dict(config.kwargs)
    skip = set(args.pop("llm_int8_skip_modules"))
    assert skip >= EXPECTED_SKIPS[model_id]  # vision tower, projector and lm_head stay unquantized
    if mode == "4bit":
        assert args == {
            "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": load_dtype(kwargs),
        }
    else:
        assert args == {"load_in_8bit": True}


def test_no_quantization_means_no_quantization_config(monkeypatch):
    serve(monkeypatch, QWEN, VLM_QUANTIZE="none")
    call(caption())
    assert "quantization_config" not in model_load()[2]


def test_processor_gets_qwen_pixel_bounds_and_left_padding(monkeypatch, hub):
    serve(monkeypatch, QWEN, VLM_MIN_PIXELS=3136, VLM_MAX_PIXELS=401408)
    call(caption())
    processor_load = [kw for api, _, kw in hub.loads if api == "AutoProcessor"][0]
    assert processor_load["min_pixels"] == 3136 and processor_load["max_pixels"] == 401408
    assert hub.processors[0]._tokenizer._padding_side == "left"


def test_pixel_bounds_are_not_given_to_other_families(monkeypatch, hub):
    serve(monkeypatch, LLAVA, VLM_MIN_PIXELS=3136, VLM_MAX_PIXELS=401408)
    call(caption())
    processor_load = [kw for api, _, kw in hub.loads if api == "AutoProcessor"][0]
    assert "min_pixels" not in processor_load and "max_pixels" not in processor_load


def test_the_model_loads_once_for_many_requests(monkeypatch, hub):
    serve(monkeypatch)
    for _ in range(3):
        assert call(caption())["response"] == "ok"
    assert len([e for e in hub.loads if e[0].startswith("AutoModel")]) == 1


# =================================================================================================
# Request quantize and model
# =================================================================================================


def test_request_quantize_is_honoured_on_the_loading_call(monkeypatch):
    serve(monkeypatch, QWEN, VLM_QUANTIZE="none")
    out = call(caption(quantize="8bit"))
    assert out["response"] == "ok"
    assert model_load()[2]["quantization_config"].kwargs["load_in_8bit"] is True
    assert "quantize_warning" not in out


def test_a_later_different_quantize_is_reported_not_applied(monkeypatch, hub):
    serve(monkeypatch, QWEN)
    first = call(caption(quantize="4bit"))
    assert "quantize_warning" not in first
    later = call(caption(quantize="8bit"))
    assert later["response"] == "ok"
    assert later["quantize"] == "4bit"
    assert "4bit" in later["quantize_warning"] and "8bit" in later["quantize_warning"]
    assert len([e for e in hub.loads if e[0].startswith("AutoModel")]) == 1  # no reload
    same = call(caption(quantize="4bit"))
    assert "quantize_warning" not in same and "quantize" not in same


def test_a_later_request_without_quantize_gets_no_warning(monkeypatch):
    serve(monkeypatch, QWEN)
    call(caption(quantize="4bit"))
    out = call(caption())
    assert "quantize_warning" not in out


def test_invalid_request_quantize_names_the_field(monkeypatch, hub):
    serve(monkeypatch)
    out = call(caption(quantize="2bit"))
    assert_error(out, "quantize", "invalid_request")
    assert not hub.models


def test_model_swap_is_refused_before_anything_loads(monkeypatch, hub):
    serve(monkeypatch, QWEN)
    out = call(caption(model=LLAVA))
    assert_error(out, "model", "model_mismatch")
    assert QWEN in out["error"] and LLAVA in out["error"]
    assert not hub.models


def test_naming_the_served_model_is_fine(monkeypatch):
    serve(monkeypatch, QWEN)
    out = call(caption(model=QWEN))
    assert out["response"] == "ok" and out["model"] == QWEN


def test_model_swap_is_refused_after_loading_too(monkeypatch):
    serve(monkeypatch, QWEN)
    call(caption())
    monkeypatch.setenv("VLM_MODEL", LLAVA)  # the loaded engine, not the environment, decides
    out = call(caption(model=LLAVA))
    assert_error(out, "model", "model_mismatch")
    assert call(caption(model=QWEN))["model"] == QWEN


# =================================================================================================
# Generation parameters
# =================================================================================================


@pytest.mark.parametrize("extra, param, fragment", [
    ({"max_new_tokens": 65}, "max_new_tokens", "64"),
    ({"max_new_tokens": 0}, "max_new_tokens", None),
    ({"max_new_tokens": "many"}, "max_new_tokens", None),
    ({"temperature": 2.5}, "temperature", None),
    ({"temperature": -0.1}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"do_sample": True, "temperature": 0}, "temperature", "do_sample"),
    ({"do_sample": True}, "temperature", "do_sample"),  # the default temperature 0 cannot sample
    ({"min_new_tokens": -1}, "min_new_tokens", None),
    ({"foo": 1}, "foo", "unknown field"),
    ({"task": "summarize"}, "task", "summarize"),
])
def test_bad_generation_parameters_name_the_field(monkeypatch, hub, extra, param, fragment):
    serve(monkeypatch, VLM_MAX_NEW_TOKENS=64)
    out = call(caption(**extra))
    assert_error(out, param, "invalid_request")
    if fragment:
        assert fragment in out["error"]
    assert not hub.models  # refused before loading


def test_max_new_tokens_at_the_cap_is_accepted(monkeypatch, hub):
    serve(monkeypatch, VLM_MAX_NEW_TOKENS=64)
    out = call(caption(max_new_tokens=64))
    assert out["response"] == "ok"


def test_greedy_decoding_by_default(monkeypatch, hub):
    hub.reply = "a red square"
    serve(monkeypatch, VLM_DEFAULT_MAX_NEW_TOKENS=40)
    out = call(caption())
    assert out["response"] == "a red square" and out["finish_reason"] == "stop"
    for generate in hub.generate_calls:  # greedy may use generate() or a hand-written loop
        assert generate["do_sample"] is False
        assert generate.get("temperature") is None and generate.get("top_p") is None


def test_sampling_parameters_reach_the_decoder(monkeypatch, hub):
    hub.reply = "sampled"
    serve(monkeypatch, VLM_DEFAULT_MAX_NEW_TOKENS=40)
    out = call(caption(do_sample=True, temperature=0.7, top_p=0.9))
    assert out["response"] == "sampled"
    (decoded,) = hub.decode_calls
    assert decoded["do_sample"] == [True]
    assert decoded["temperature"] == [0.7] and decoded["top_p"] == [0.9]
    assert decoded["max_new_tokens"] == [40]  # VLM_DEFAULT_MAX_NEW_TOKENS when the request sets none
    (prefill,) = hub.prefills  # the prompt reached the model whole, its padding hidden by the mask
    assert prefill["prompts"] == hub.processor_calls[-1]["text"]


@pytest.mark.parametrize("sampling", [False, True])
def test_min_new_tokens_holds_off_the_end(monkeypatch, hub, sampling):
    hub.reply = "ok"
    serve(monkeypatch)
    extra = {"do_sample": True, "temperature": 0.5} if sampling else {}
    out = call(caption(min_new_tokens=6, max_new_tokens=20, **extra))
    assert out["usage"]["completion_tokens"] >= 6
    assert out["response"].startswith("ok")
    assert out["finish_reason"] == "stop"


def test_min_new_tokens_above_max_new_tokens_is_clamped(monkeypatch, hub):
    hub.reply = "ok"
    serve(monkeypatch)
    out = call(caption(min_new_tokens=50, max_new_tokens=5))
    assert out["usage"]["completion_tokens"] == 5
    assert out["finish_reason"] == "length"


def test_repetition_penalty_from_the_generation_config_does_not_change_a_clear_answer(monkeypatch, hub):
    hub.repetition_penalty = 1.3
    hub.reply = "aaa bbb"
    serve(monkeypatch)
    out = call(caption(max_new_tokens=30))
    assert out["response"] == "aaa bbb"


# =================================================================================================
# Tasks
# =================================================================================================


@pytest.mark.parametrize("task", ["caption", "caption_long"])
def test_caption_tasks_send_their_prompt_after_the_image(monkeypatch, hub, task):
    serve(monkeypatch)
    out = call({"task": task, "image_b64": b64(20, 10)})
    assert out["task"] == task and out["image_count"] == 1
    (messages,) = hub.templates
    assert messages == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": handler.TASK_PROMPTS[task]}]}]
    assert [im.size for im in sent_images()] == [(20, 10)]


def test_caption_and_caption_long_prompts_differ():
    assert handler.TASK_PROMPTS["caption"] != handler.TASK_PROMPTS["caption_long"]


def test_vqa_sends_the_question(monkeypatch, hub):
    hub.reply = lambda prompt: "asked: " + last_user_text(prompt)
    serve(monkeypatch)
    out = call({"task": "vqa", "image_b64": b64(), "question": "  How many dogs?  "})
    assert out["task"] == "vqa"
    assert out["response"] == "asked: How many dogs?"
    assert hub.templates[0][0]["content"][0] == {"type": "image"}


@pytest.mark.parametrize("payload, param, code", [
    ({"task": "vqa", "image_b64": "IMG"}, "question", "invalid_request"),
    ({"task": "vqa", "image_b64": "IMG", "question": "   "}, "question", "invalid_request"),
    ({"task": "grounding", "image_b64": "IMG"}, "target", "invalid_request"),
    ({"task": "grounding", "image_b64": "IMG", "target": ""}, "target", "invalid_request"),
    ({"task": "caption"}, "image_url", "missing_image"),
    ({"task": "vqa", "question": "what?"}, "image_url", "missing_image"),
    ({"task": "chat"}, "messages", "invalid_request"),
    ({"task": "chat", "image_b64": "IMG"}, "messages", "invalid_request"),
    ({"image_b64": "IMG"}, "task", "invalid_request"),
    ({}, "task", "invalid_request"),
    ({"task": "caption", "image_b64": "IMG", "messages": [{"role": "user", "content": "hi"}]}, "messages",
     "invalid_request"),
])
def test_task_requirements_name_the_missing_field(monkeypatch, hub, payload, param, code):
    serve(monkeypatch)
    payload = {k: (b64() if v == "IMG" else v) for k, v in payload.items()}
    out = call(payload)
    assert_error(out, param, code)
    assert not hub.models


def test_messages_without_task_mean_chat(monkeypatch):
    serve(monkeypatch)
    out = call(chat("hello"))
    assert out["task"] == "chat" and out["image_count"] == 0


# =================================================================================================
# Output shape and finish reasons
# =================================================================================================


def test_output_shape_of_a_chat(monkeypatch, hub):
    hub.reply = "Hello there"
    serve(monkeypatch, QWEN)
    out = call(chat("Hi!"))
    assert {"response", "model", "task", "image_count", "finish_reason", "usage"} <= set(out)
    assert out["response"] == "Hello there"
    assert out["model"] == QWEN and out["task"] == "chat" and out["image_count"] == 0
    assert out["finish_reason"] == "stop"
    prompt = hub.prefills[-1]["prompts"][0] if hub.prefills else hub.processor_calls[-1]["text"][0]
    assert out["usage"] == {"prompt_tokens": len(encode(prompt)), "completion_tokens": len("Hello there")}
    for absent in ("bbox", "bbox_warning", "supports_grounding", "batch_images", "quantize_warning", "error"):
        assert absent not in out


@pytest.mark.parametrize("max_new_tokens, response, reason", [
    (5, "hello", "length"),
    (11, "hello world", "length"),  # all budget used and no end token: cut off
    (12, "hello world", "stop"),
    (200, "hello world", "stop"),
])
def test_finish_reason_stop_or_length(monkeypatch, hub, max_new_tokens, response, reason):
    hub.reply = "hello world"
    serve(monkeypatch)
    out = call(caption(max_new_tokens=max_new_tokens))
    assert out["response"] == response
    assert out["finish_reason"] == reason
    assert out["usage"]["completion_tokens"] == len(response)


def test_every_end_token_of_the_generation_config_stops_the_answer(monkeypatch, hub):
    hub.reply = "done<|end|>more text"
    serve(monkeypatch)
    out = call(caption(max_new_tokens=100))
    assert out["response"] == "done"
    assert out["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 4


def test_special_tokens_are_stripped_from_the_response(monkeypatch, hub):
    hub.reply = "<|object_ref_start|>a cat<|object_ref_end|>"
    serve(monkeypatch)
    assert call(caption())["response"] == "a cat"


def test_response_whitespace_is_trimmed(monkeypatch, hub):
    hub.reply = "  spaced out \n"
    serve(monkeypatch)
    assert call(caption())["response"] == "spaced out"


@pytest.mark.parametrize("value", [True, False])
def test_batch_images_is_echoed(monkeypatch, value):
    serve(monkeypatch)
    out = call(caption(batch_images=value))
    assert out["batch_images"] is value


def test_image_count_counts_every_image(monkeypatch):
    serve(monkeypatch)
    out = call({"task": "caption", "image_b64": b64(), "images": [b64(), data_uri()]})
    assert out["image_count"] == 3


def test_a_cap_below_the_default_clamps_requests_that_set_no_max_new_tokens(monkeypatch, hub):
    # Regression: VLM_MAX_NEW_TOKENS=8 with the default 256 refused every request without
    # max_new_tokens, blaming a field the client never sent.
    hub.reply = "a rather long answer"
    serve(monkeypatch, VLM_MAX_NEW_TOKENS=8)
    out = call(caption())
    assert out["response"] == "a rather"
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 8


# =================================================================================================
# Images: every spec and block form
# =================================================================================================

HTTPS_URL = "https://images.example.com/cat.png"


def _spec(kind: str, width: int, height: int):
    if kind == "https":
        WEB[HTTPS_URL] = png(width, height)
        return HTTPS_URL
    if kind == "base64":
        return b64(width, height)
    if kind == "data_uri":
        return data_uri(width, height)
    if kind == "url_object_data_uri":
        return {"url": data_uri(width, height)}
    if kind == "url_object_https":
        WEB[HTTPS_URL] = png(width, height)
        return {"url": HTTPS_URL}
    raise AssertionError(kind)


SPEC_KINDS = ["https", "base64", "data_uri", "url_object_data_uri", "url_object_https"]


@pytest.mark.parametrize("kind", SPEC_KINDS)
@pytest.mark.parametrize("field", ["image_url", "image_b64", "images"])
def test_loose_image_fields_accept_every_spec(monkeypatch, hub, web, kind, field):
    serve(monkeypatch)
    spec = _spec(kind, 24, 18)
    out = call({"task": "caption", field: [spec] if field == "images" else spec})
    assert out.get("response") == "ok", out
    (image,) = sent_images()
    assert image.mode == "RGB" and image.size == (24, 18)
    assert (HTTPS_URL in web) == ("https" in kind)


def _block(form: str, spec):
    if form == "image_url_object":
        return {"type": "image_url", "image_url": {"url": spec}}
    if form == "image_url_string":
        return {"type": "image_url", "image_url": spec}
    if form == "image_spec":
        return {"type": "image", "image": spec}
    if form == "image_object":
        return {"type": "image", "image": {"url": spec}}
    raise AssertionError(form)


@pytest.mark.parametrize("kind", ["https", "base64", "data_uri"])
@pytest.mark.parametrize("form", ["image_url_object", "image_url_string", "image_spec", "image_object"])
def test_message_image_blocks_accept_every_form(monkeypatch, hub, form, kind):
    serve(monkeypatch)
    block = _block(form, _spec(kind, 30, 20))
    out = call({"messages": [{"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}]})
    assert out.get("response") == "ok", out
    assert out["image_count"] == 1
    assert [im.size for im in sent_images()] == [(30, 20)]
    assert hub.templates[-1] == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is it?"}]}]


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_images_of_other_modes_become_rgb(monkeypatch, mode):
    serve(monkeypatch)
    out = call(caption(b64(20, 20, mode=mode)))
    assert out["response"] == "ok"
    (image,) = sent_images()
    assert image.mode == "RGB" and image.size == (20, 20)


def test_jpeg_images_are_accepted(monkeypatch):
    serve(monkeypatch)
    call(caption(b64(32, 16, fmt="JPEG")))
    assert [im.size for im in sent_images()] == [(32, 16)]


def test_several_images_in_one_message_keep_their_order(monkeypatch, hub):
    serve(monkeypatch)
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_uri(10, 10)}},
        {"type": "text", "text": "with"},
        {"type": "image", "image": b64(20, 10)},
        {"type": "image", "image": {"url": data_uri(30, 10)}},
    ]
    out = call({"messages": [{"role": "user", "content": content}]})
    assert out["image_count"] == 3
    assert [im.size for im in sent_images()] == [(10, 10), (20, 10), (30, 10)]
    assert hub.templates[-1][0]["content"] == [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
        {"type": "image"}, {"type": "image"},
    ]


def test_loose_images_come_in_field_order_image_url_image_b64_images(monkeypatch):
    serve(monkeypatch)
    out = call({"task": "caption", "images": [b64(30, 10), b64(40, 10)], "image_b64": b64(20, 10),
                "image_url": data_uri(10, 10)})
    assert out["image_count"] == 4
    assert [im.size for im in sent_images()] == [(10, 10), (20, 10), (30, 10), (40, 10)]


def test_loose_images_in_a_chat_go_before_the_first_user_message(monkeypatch, hub):
    serve(monkeypatch)
    out = call({
        "image_url": data_uri(12, 12),
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is this?"},
            {"role": "assistant", "content": "A square."},
            {"role": "user", "content": "Which colour?"},
        ],
    })
    assert out["image_count"] == 1
    messages = hub.templates[-1]
    assert messages[1] == {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    assert messages[3] == {"role": "user", "content": [{"type": "text", "text": "Which colour?"}]}


def test_plain_http_is_fetched_or_refused_naming_the_field(monkeypatch, hub):
    serve(monkeypatch)
    WEB["http://images.example.com/cat.png"] = png(16, 16)
    out = call({"task": "caption", "image_url": "http://images.example.com/cat.png"})
    if "error" in out:  # the URL policy may refuse plain http by default
        assert_error(out, "image_url")
        assert not hub.models
    else:
        assert [im.size for im in sent_images()] == [(16, 16)]


def test_an_unreachable_url_is_a_clean_error_naming_the_field(monkeypatch, hub):
    serve(monkeypatch)
    out = call({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "https://images.example.com/missing.png"}},
    ]}]})
    assert_error(out, "messages[0].content[1].image_url.url")
    assert out["code"]
    assert not hub.models


def test_a_url_that_is_not_an_image_is_refused(monkeypatch):
    serve(monkeypatch)
    WEB[HTTPS_URL] = b"<html>not an image</html>"
    out = call({"task": "caption", "image_url": HTTPS_URL})
    assert_error(out, "image_url")


@pytest.mark.parametrize("payload, param, code", [
    ({"image_b64": "!!!not base64!!!"}, "image_b64", "invalid_base64"),
    ({"image_b64": "AAAAA"}, "image_b64", "invalid_base64"),
    ({"image_b64": "QUJD=QUJD"}, "image_b64", "invalid_base64"),
    ({"image_b64": base64.b64encode(b"definitely not an image, just text").decode()}, "image_b64",
     "invalid_image_format"),
    ({"image_url": "data:image/png;base64," + base64.b64encode(b"garbage bytes!").decode()}, "image_url",
     "invalid_image_format"),
    ({"image_url": "data:image/png," + "abc"}, "image_url", None),  # not base64
    ({"image_url": {"href": "https://images.example.com/a.png"}}, "image_url", "invalid_image"),
    ({"image_url": {"url": "!!!"}}, "image_url.url", None),
    ({"image_url": 42}, "image_url", "invalid_image"),
    ({"image_url": ""}, "image_url", "invalid_image"),
    ({"image_url": "   "}, "image_url", "invalid_image"),
    ({"images": "not-a-list"}, "images", "invalid_request"),
    ({"images": [b64(), 7]}, "images[1]", "invalid_image"),
    ({"image_b64": base64.b64encode(png(16, 12)[:40]).decode()}, "image_b64", "invalid_image_format"),
])
def test_bad_images_are_refused_naming_the_field(monkeypatch, hub, payload, param, code):
    serve(monkeypatch)
    out = call(dict({"task": "caption"}, **payload))
    assert_error(out, param, code)
    assert out["code"]
    assert not hub.models


@pytest.mark.parametrize("block, param", [
    ({"type": "image_url", "image_url": {"url": "%%%"}}, "messages[0].content[1].image_url.url"),
    ({"type": "image_url", "image_url": "%%%"}, "messages[0].content[1].image_url"),
    ({"type": "image", "image": "%%%"}, "messages[0].content[1].image"),
    ({"type": "image", "image": {"url": "%%%"}}, "messages[0].content[1].image.url"),
    ({"type": "image", "image": None}, "messages[0].content[1].image"),
    ({"type": "image_url"}, "messages[0].content[1].image_url"),
    ({"type": "image"}, "messages[0].content[1].image"),
])
def test_bad_image_blocks_name_their_path(monkeypatch, hub, block, param):
    serve(monkeypatch)
    out = call({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, block]}]})
    assert_error(out, param)
    assert not hub.models


def test_too_many_loose_images(monkeypatch, hub):
    serve(monkeypatch, VLM_MAX_IMAGES=2)
    out = call({"task": "caption", "images": [b64(), b64(), b64()]})
    assert_error(out, "images[2]", "too_many_images")  # the first image over the limit
    assert "2" in out["error"]


def test_too_many_images_in_messages_names_the_first_extra_block(monkeypatch):
    serve(monkeypatch, VLM_MAX_IMAGES=2)
    blocks = [{"type": "image", "image": b64()} for _ in range(3)]
    out = call({"messages": [{"role": "user", "content": blocks}]})
    assert_error(out, "messages[0].content[2].image", "too_many_images")


def test_images_at_the_limit_are_accepted(monkeypatch):
    serve(monkeypatch, VLM_MAX_IMAGES=2)
    assert call({"task": "caption", "images": [b64(), b64()]})["image_count"] == 2


def test_total_pixels_over_the_limit(monkeypatch, hub):
    serve(monkeypatch, VLM_MAX_TOTAL_PIXELS=500)
    out = call({"task": "caption", "images": [b64(16, 16), b64(16, 16)]})  # 512 pixels
    assert "error" in out and out["code"] == "image_too_large"
    assert not hub.models
    assert call({"task": "caption", "images": [b64(16, 16)]})["image_count"] == 1


def test_text_over_the_limit(monkeypatch, hub):
    serve(monkeypatch, VLM_MAX_TEXT_CHARS=10)
    out = call(chat("x" * 11))
    assert "error" in out and out["code"] == "text_too_long"
    assert call(chat("x" * 10))["response"] == "ok"


# =================================================================================================
# Messages
# =================================================================================================


@pytest.mark.parametrize("messages, param", [
    ("hello", "messages"),
    ([], "messages"),
    ({"role": "user", "content": "hi"}, "messages"),
    (["hello"], "messages[0]"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "video", "video": "x"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "messages[1].role"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": [{"type": "image", "image": "IMG"}]},
      {"role": "user", "content": "and?"}], "messages[1].content"),
    ([{"role": "system", "content": [{"type": "image", "image": "IMG"}]},
      {"role": "user", "content": "hi"}], "messages[0].content"),
])
def test_bad_messages_name_the_field(monkeypatch, hub, messages, param):
    serve(monkeypatch)
    if isinstance(messages, list):
        messages = json.loads(json.dumps(messages).replace('"IMG"', json.dumps(b64())))
    out = call({"messages": messages})
    assert_error(out, param, "invalid_request")
    assert not hub.models


def test_too_many_messages(monkeypatch):
    serve(monkeypatch, VLM_MAX_MESSAGES=2)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    assert_error(call({"messages": messages}), "messages", "invalid_request")
    assert call({"messages": messages[:1]})["response"] == "ok"


def test_string_content_and_text_blocks_are_the_same(monkeypatch, hub):
    serve(monkeypatch)
    call({"messages": [{"role": "user", "content": "same words"}]})
    call({"messages": [{"role": "user", "content": [{"type": "text", "text": "same words"}]}]})
    assert hub.templates[0] == hub.templates[1] == [
        {"role": "user", "content": [{"type": "text", "text": "same words"}]}]


# =================================================================================================
# Family adapters
# =================================================================================================

IMG_A, IMG_B = (20, 10), (10, 20)


def conversation():
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": b64(*IMG_A)},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A red box."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image_url", "image_url": {"url": data_uri(*IMG_B)}}]},
    ]


NATIVE_CONVERSATION = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A red box."}]},
    {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]},
]


@pytest.mark.parametrize("model_id", NATIVE_FAMILY_MODELS)
def test_native_families_template_the_whole_conversation(monkeypatch, hub, model_id):
    hub.reply = "A blue box."
    serve(monkeypatch, model_id)
    out = call({"messages": conversation()})
    assert out["response"] == "A blue box." and out["image_count"] == 2
    assert hub.templates == [NATIVE_CONVERSATION]
    kwargs = hub.template_kwargs[0]
    assert kwargs["add_generation_prompt"] is True and kwargs["tokenize"] is False
    processor_call = hub.processor_calls[0]
    assert processor_call["text"] == [render(NATIVE_CONVERSATION, True)]
    assert processor_call["padding"] is True and processor_call["return_tensors"] == "pt"
    assert [im.size for im in sent_images()] == [IMG_A, IMG_B]


def test_native_text_only_chat_sends_no_images(monkeypatch, hub):
    serve(monkeypatch, LLAVA_NEXT)
    call(chat("Just text"))
    assert not sent_images()
    assert hub.prefills[-1]["pixel_dtype"] is None


def test_minicpm_chat_gets_msgs_system_prompt_and_sampling(monkeypatch, hub):
    hub.reply = "A blue box."
    serve(monkeypatch, MINICPM)
    out = call({"messages": conversation(), "max_new_tokens": 50})
    assert out["response"] == "A blue box." and out["image_count"] == 2
    (chat_call,) = hub.chat_calls
    assert chat_call["image"] is None
    assert chat_call["tokenizer"] is hub.processors[0]  # the AutoTokenizer it loaded
    msgs = chat_call["msgs"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    first, answer, second = (m["content"] for m in msgs)
    assert isinstance(first[0], Image.Image) and first[0].size == IMG_A and first[1] == "What is this?"
    assert answer == ["A red box."]
    assert second[0] == "And this?" and isinstance(second[1], Image.Image) and second[1].size == IMG_B
    kwargs = chat_call["kwargs"]
    assert kwargs["system_prompt"] == "Be brief."
    assert kwargs["max_new_tokens"] == 50 and kwargs["do_sample"] is False


def test_minicpm_without_system_message_sends_no_system_prompt(monkeypatch, hub):
    serve(monkeypatch, MINICPM)
    call(caption(do_sample=True, temperature=0.4, top_p=0.8))
    kwargs = hub.chat_calls[0]["kwargs"]
    assert "system_prompt" not in kwargs
    assert kwargs["do_sample"] is True and kwargs["temperature"] == 0.4 and kwargs["top_p"] == 0.8
    assert hub.chat_calls[0]["msgs"][0]["content"][-1] == handler.TASK_PROMPTS["caption"]


@pytest.mark.parametrize("model_id", [MINICPM, INTERNVL])
@pytest.mark.parametrize("max_new_tokens, reason", [(6, "length"), (7, "stop")])
def test_remote_code_finish_reason_counts_tokens(monkeypatch, hub, model_id, max_new_tokens, reason):
    hub.reply = "abcdef"
    serve(monkeypatch, model_id)
    out = call(caption(max_new_tokens=max_new_tokens))
    assert out["response"] == "abcdef"
    assert out["finish_reason"] == reason and out["usage"]["completion_tokens"] == 6


def test_phi3_numbers_image_placeholders_across_turns(monkeypatch, hub):
    hub.reply = "A blue box."
    serve(monkeypatch, PHI3)
    out = call({"messages": conversation(), "max_new_tokens": 40})
    assert out["response"] == "A blue box." and out["image_count"] == 2
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<|image_1|>\nWhat is this?"},
        {"role": "assistant", "content": "A red box."},
        {"role": "user", "content": "And this?\n<|image_2|>"},
    ]
    assert hub.templates == [expected]
    assert hub.template_kwargs[0]["add_generation_prompt"] is True and hub.template_kwargs[0]["tokenize"] is False
    processor_call = hub.processor_calls[0]
    assert processor_call["text"] == [render(expected, True)]
    assert [im.size for im in processor_call["images"]] == [IMG_A, IMG_B]
    (generate,) = hub.generate_calls
    # The card's end token and the generation config's (<|end|>) both end the answer.
    assert sorted(generate["eos_token_id"]) == [EOS, END] and generate["max_new_tokens"] == 40
    assert out["usage"] == {"prompt_tokens": len(encode(render(expected, True))), "completion_tokens": 11}
    assert out["finish_reason"] == "stop"


def test_phi3_text_only_passes_no_images_and_reports_length(monkeypatch, hub):
    hub.reply = "a long answer"
    serve(monkeypatch, PHI3)
    out = call(chat("hi", max_new_tokens=4))
    assert hub.processor_calls[0]["images"] is None
    assert out["response"] == "a lo" and out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("size, tiles", [
    ((448, 448), 1),  # one tile, no thumbnail
    ((64, 64), 1),
    ((896, 448), 3),  # 2x1 grid + thumbnail
    ((20, 10), 3),  # aspect ratio decides, not size
    ((300, 1200), 5),  # 1x4 + thumbnail
    ((1000, 1000), 10),  # large enough for 3x3 + thumbnail
])
def test_internvl_tiles_each_image_as_its_card_does(monkeypatch, hub, size, tiles):
    serve(monkeypatch, INTERNVL)
    out = call(caption(b64(*size)))
    assert out["response"] == "ok"
    (chat_call,) = hub.chat_calls
    assert chat_call["num_patches_list"] == [tiles]
    values = chat_call["pixel_values"]
    assert values.dims == (tiles, 3, 448, 448)
    assert values.tiles == [(448, 448)] * tiles and values.normalized
    assert values._dtype is F32  # the model's dtype (fp32 on CPU)
    assert chat_call["question"] == "<image>\n" + handler.TASK_PROMPTS["caption"]
    assert chat_call["history"] is None


def test_internvl_history_question_and_patches(monkeypatch, hub):
    hub.reply = "A blue box."
    serve(monkeypatch, INTERNVL)
    out = call({"messages": conversation(), "max_new_tokens": 33})
    assert out["response"] == "A blue box." and out["image_count"] == 2
    (chat_call,) = hub.chat_calls
    assert chat_call["history"] == [("Be brief.\n<image>\nWhat is this?", "A red box.")]
    assert chat_call["question"] == "And this?\n<image>"
    assert chat_call["num_patches_list"] == [3, 3]
    assert chat_call["pixel_values"].dims[0] == 6
    assert chat_call["generation_config"]["max_new_tokens"] == 33
    assert chat_call["generation_config"]["do_sample"] is False
    assert chat_call["tokenizer"] is hub.processors[0]


def test_internvl_text_only_sends_no_pixels(monkeypatch, hub):
    serve(monkeypatch, INTERNVL)
    call(chat("Just text"))
    (chat_call,) = hub.chat_calls
    assert chat_call["pixel_values"] is None and chat_call["num_patches_list"] is None
    assert chat_call["question"] == "Just text"


# =================================================================================================
# Boxes
# =================================================================================================


@pytest.mark.parametrize("text, box", [
    ("[10, 20, 30, 40]", [10, 20, 30, 40]),
    ("The dog is at [10.5,20,30.25,40].", [10.5, 20, 30.25, 40]),
    ('{"bbox": [30, 40, 10, 20]}', [10, 20, 30, 40]),  # corners are ordered
    ('```json\n[{"bbox_2d": [1.5, 2, 3, 4], "label": "dog"}]\n```', [1.5, 2, 3, 4]),
    ('{"bbox_2d" : [ 5 , 6 , 7 , 8 ]}', [5, 6, 7, 8]),
    ("<|box_start|>(100,200),(300,400)<|box_end|>", [100, 200, 300, 400]),
    ("<|object_ref_start|>dog<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>", [1, 2, 3, 4]),
    ("(100, 200), (300, 400)", [100, 200, 300, 400]),
    ("(100,200)(300,400)", [100, 200, 300, 400]),
    ("box: 1, 2, 3, 4", [1, 2, 3, 4]),
    ("-5, 10, 20, 30", [-5, 10, 20, 30]),
    ('{"bbox": [1, 2, 3, 4]} or maybe [50, 60, 70, 80]', [1, 2, 3, 4]),  # the first, JSON first
    ("no box here", None),
    ("", None),
    (None, None),
    ("[1, 2, 3]", None),
    ("(1, 2)", None),
])
def test_parse_bbox(text, box):
    assert handler.parse_bbox(text) == box


@pytest.mark.parametrize("box, system, size, input_size, expected", [
    ([0, 0, 1000, 1000], "qwen-1000", (640, 480), None, [0, 0, 640, 480]),
    ([500, 500, 750, 1000], "qwen-1000", (640, 480), None, [320, 240, 480, 480]),
    ([100, 200, 300, 400], "qwen-abs-pixels", (640, 480), (1280, 960), [50, 100, 150, 200]),
    ([100, 200, 300, 400], "qwen-abs-pixels", (640, 480), None, [100, 200, 300, 400]),
    ([0.1, 0.25, 0.5, 1.0], None, (200, 100), None, [20, 25, 100, 100]),  # normalised
    ([10, 20, 30, 40], None, (200, 100), None, [10, 20, 30, 40]),  # pixels
    ([-50, -10, 5000, 5000], None, (200, 100), None, [0, 0, 200, 100]),  # clamped
    ([-100, 0, 1200, 1100], "qwen-1000", (100, 50), None, [0, 0, 100, 50]),
])
def test_box_to_pixels(box, system, size, input_size, expected):
    pixels = handler.box_to_pixels(box, system, size, input_size)
    assert pixels == expected
    assert all(isinstance(v, int) for v in pixels)


def grounding(target="the dog", image=None, **extra):
    return dict({"task": "grounding", "image_b64": image or b64(640, 480), "target": target}, **extra)


def test_qwen2_vl_grounding_returns_a_box_in_image_pixels(monkeypatch, hub):
    hub.reply = "<|object_ref_start|>the dog<|object_ref_end|><|box_start|>(100,250),(500,750)<|box_end|>"
    serve(monkeypatch, QWEN)
    out = call(grounding("  the dog "))
    assert out["task"] == "grounding" and out["supports_grounding"] is True
    assert out["bbox"] == [64, 120, 320, 360]
    assert "bbox_warning" not in out
    assert "<|box_start|>" not in out["response"]
    (messages,) = hub.templates
    assert messages[0]["content"][0] == {"type": "image"}
    assert "the dog" in user_text(messages) and "  the dog " not in user_text(messages)


def test_qwen25_vl_grounding_reads_json_boxes(monkeypatch, hub):
    # 560x420 is a multiple of 28 inside Qwen's pixel bounds: its model input is the image itself.
    hub.reply = '```json\n[{"bbox_2d": [56, 42, 280, 210], "label": "dog"}]\n```'
    serve(monkeypatch, QWEN25)
    out = call(grounding(image=b64(560, 420)))
    assert out["supports_grounding"] is True and out["bbox"] == [56, 42, 280, 210]
    assert "the dog" in user_text(hub.templates[0])


def test_grounding_box_is_scaled_to_the_first_image(monkeypatch, hub):
    hub.reply = "<|box_start|>(0,0),(500,500)<|box_end|>"
    serve(monkeypatch, QWEN)
    out = call({"task": "grounding", "images": [b64(200, 100), b64(640, 480)], "target": "x"})
    assert out["bbox"] == [0, 0, 100, 50]


def test_an_unparsable_grounding_answer_warns(monkeypatch, hub):
    hub.reply = "I cannot see a dog."
    serve(monkeypatch, QWEN)
    out = call(grounding())
    assert out["bbox"] is None and out["supports_grounding"] is True
    assert out["bbox_warning"]
    assert out["response"] == "I cannot see a dog."


@pytest.mark.parametrize("model_id, family", [(LLAVA, "llava"), (MINICPM, "minicpm-v"), (GENERIC, None)])
def test_grounding_on_a_family_without_boxes_warns(monkeypatch, hub, model_id, family):
    hub.reply = "[10, 20, 30, 40]"  # even a box-looking answer is not trusted
    serve(monkeypatch, model_id)
    out = call(grounding())
    assert out["supports_grounding"] is False and out["bbox"] is None
    assert out["bbox_warning"] and (family is None or family in out["bbox_warning"])
    assert out["response"] == "[10, 20, 30, 40]"
    prompt = user_text(hub.templates[0]) if hub.templates else hub.chat_calls[0]["msgs"][0]["content"][-1]
    assert "the dog" in prompt


def test_grounding_fields_only_on_grounding(monkeypatch, hub):
    hub.reply = "<|box_start|>(1,2),(3,4)<|box_end|>"
    serve(monkeypatch, QWEN)
    out = call(caption())
    assert "bbox" not in out and "supports_grounding" not in out


# =================================================================================================
# Batching
# =================================================================================================


def echo(prompt: str) -> str:
    return "echo:" + last_user_text(prompt)


def batch(*items, job_id="job-7", **extra) -> dict:
    out = handler.handler({"id": job_id, "input": dict({"requests": list(items)}, **extra)})
    json.dumps(out)
    return out


def test_batch_envelope_and_order(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch, QWEN)
    out = batch(chat("first"), {"task": "vqa", "image_b64": b64(), "question": "second"}, chat("third"))
    assert set(out) == {"model", "count", "id", "results"}
    assert out["model"] == QWEN and out["count"] == 3 and out["id"] == "job-7"
    assert [r["response"] for r in out["results"]] == ["echo:first", "echo:second", "echo:third"]
    assert [r["task"] for r in out["results"]] == ["chat", "vqa", "chat"]


def test_native_items_with_the_same_sampling_share_one_padded_batch(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch, QWEN)
    out = batch(caption(b64(16, 16)), chat("short"), {"task": "vqa", "images": [b64(20, 10), b64(30, 10)],
                                                       "question": "a much longer question here"})
    assert [r["response"] for r in out["results"]] == [
        "echo:" + handler.TASK_PROMPTS["caption"], "echo:short", "echo:a much longer question here"]
    (processor_call,) = hub.processor_calls
    assert len(processor_call["text"]) == 3
    assert [[im.size for im in images] for images in processor_call["images"]] == [[(16, 16)], [], [(20, 10), (30, 10)]]
    prompts = processor_call["text"]
    assert [r["usage"]["prompt_tokens"] for r in out["results"]] == [len(encode(p)) for p in prompts]


def test_a_bad_item_becomes_an_error_at_its_index(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("a"), chat("b", temperature=9), "not an object", chat("d", model=LLAVA), chat("e"),
                {"task": "caption"})
    results = out["results"]
    assert out["count"] == 6 and len(results) == 6
    assert results[0]["response"] == "echo:a" and results[4]["response"] == "echo:e"
    assert_error(results[1], "requests[1].temperature", "invalid_request")
    assert_error(results[2], "requests[2]", "invalid_request")
    assert_error(results[3], "requests[3].model", "model_mismatch")
    assert_error(results[5], "requests[5].image_url", "missing_image")


def test_unknown_fields_in_a_batch_item_name_the_item(monkeypatch):
    serve(monkeypatch)
    out = batch(chat("a", foo=1))
    assert_error(out["results"][0], "requests[0].foo", "invalid_request")


def test_bad_images_in_a_batch_item_name_the_item(monkeypatch):
    serve(monkeypatch)
    out = batch(chat("a"), {"messages": [{"role": "user", "content": [{"type": "image", "image": "AAAAA"}]}]})
    assert "response" in out["results"][0]
    assert_error(out["results"][1], "requests[1].messages[0].content[0].image", "invalid_base64")


def test_a_batch_of_only_bad_items_loads_nothing(monkeypatch, hub):
    serve(monkeypatch, QWEN)
    out = batch({"task": "caption"}, chat("x", top_p=0))
    assert out["model"] == QWEN and out["count"] == 2
    assert all("error" in r for r in out["results"])
    assert not hub.models


@pytest.mark.parametrize("payload, param, code", [
    ({"requests": []}, "requests", "invalid_request"),
    ({"requests": "x"}, "requests", "invalid_request"),
    ({"requests": {"task": "caption"}}, "requests", "invalid_request"),
    ({"requests": [{"task": "caption"}], "task": "caption"}, "task", "invalid_request"),
    ({"requests": [chat("a")] * 3}, "requests", "too_many_requests"),
])
def test_batch_envelope_errors(monkeypatch, hub, payload, param, code):
    serve(monkeypatch, VLM_MAX_BATCH_REQUESTS=2)
    out = handler.handler({"id": "j", "input": payload})
    assert_error(out, param, code)
    assert "results" not in out
    assert not hub.models


def test_greedy_and_sampled_items_share_one_batch_each_row_keeping_its_settings(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("A"), chat("B", do_sample=True, temperature=0.7), chat("C"),
                chat("D", do_sample=True, temperature=0.9, top_p=0.5), chat("E", do_sample=True, temperature=0.7))
    assert [r["response"] for r in out["results"]] == ["echo:A", "echo:B", "echo:C", "echo:D", "echo:E"]
    (processor_call,) = hub.processor_calls  # one batch for all five
    assert [last_user_text(p) for p in processor_call["text"]] == ["A", "B", "C", "D", "E"]
    (decoded,) = hub.decode_calls
    assert decoded["rows"] == 5
    assert decoded["do_sample"] == [False, True, False, True, True]
    assert decoded["temperature"] == [0.0, 0.7, 0.0, 0.9, 0.7]
    assert decoded["top_p"] == [1.0, 1.0, 1.0, 0.5, 1.0]
    assert not hub.generate_calls


def test_items_are_batched_by_max_new_tokens_and_answer_in_input_order(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch, VLM_MAX_BATCH_SIZE=2)
    budgets = [50, 5, 40, 10, 30]
    out = batch(*[chat(f"q{i}", max_new_tokens=n) for i, n in enumerate(budgets)])
    expected = [("echo:" + f"q{i}")[:n] for i, n in enumerate(budgets)]
    assert [r["response"] for r in out["results"]] == expected
    groups = [[last_user_text(p) for p in c["text"]] for c in hub.processor_calls]
    assert groups == [["q1", "q3"], ["q4", "q2"], ["q0"]]  # shortest budgets first
    assert [d["max_new_tokens"] for d in hub.decode_calls] == [[5, 10], [30, 40], [50]]


def test_a_tiny_top_p_samples_like_greedy_and_a_wide_one_really_samples(monkeypatch, hub):
    # The fake model's logits: 10 for its answer, 5 for a filler, 0 elsewhere. At temperature 2
    # the answer has ~40% of the mass: top_p=1 strays from it (seeded noise), top_p=0.01 cannot.
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("greedy"), chat("narrow", do_sample=True, temperature=2.0, top_p=0.01),
                chat("wide", do_sample=True, temperature=2.0, top_p=1.0), chat("greedy too"))
    greedy, narrow, wide, greedy_too = (r["response"] for r in out["results"])
    assert len(hub.processor_calls) == 1  # all four rows decoded together
    assert greedy == "echo:greedy" and greedy_too == "echo:greedy too"
    assert narrow == "echo:narrow"
    assert wide != "echo:wide"


def test_min_new_tokens_is_per_row_in_a_mixed_batch(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("a", min_new_tokens=10), chat("b", do_sample=True, temperature=0.5, top_p=0.5),
                chat("c"), chat("d", do_sample=True, temperature=0.5, top_p=0.5, min_new_tokens=9))
    a, b, c, d = out["results"]
    assert len(hub.processor_calls) == 1
    assert hub.decode_calls[0]["min_new_tokens"] == [10, 0, 0, 9]
    assert b["response"] == "echo:b" and b["usage"]["completion_tokens"] == 6
    assert c["response"] == "echo:c" and c["usage"]["completion_tokens"] == 6
    assert a["response"].startswith("echo:a") and a["usage"]["completion_tokens"] == 10
    assert d["response"].startswith("echo:d") and d["usage"]["completion_tokens"] == 9
    assert all(r["finish_reason"] == "stop" for r in (a, b, c, d))


def test_repetition_penalty_from_the_generation_config_is_applied(monkeypatch, hub):
    # The fake's answer scores 10 and its filler "~" 5: a penalty of 2.5 drops a repeated token
    # (or one of the prompt's) to 4, under the filler, as transformers' processor would.
    hub.reply = "QQ"
    serve(monkeypatch)
    assert call(chat("x"))["response"] == "QQ"  # no penalty configured
    handler.reset_engine()
    hub.repetition_penalty = 2.5
    assert call(chat("x"))["response"] == "Q~"  # "Q" once chosen is penalized
    hub.reply = "xQ"
    assert call(chat("x"))["response"] == "~Q"  # so is every token of the prompt
    handler.reset_engine()
    hub.repetition_penalty = 1.0  # 1.0 means none
    assert call(chat("x"))["response"] == "xQ"


def test_decoding_stops_early_once_every_row_has_ended(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("a", max_new_tokens=200), chat("b", max_new_tokens=200))
    assert [r["response"] for r in out["results"]] == ["echo:a", "echo:b"]
    assert hub.decode_steps <= 16  # ended after 7 tokens: the end is looked for every 16 steps
    hub.decode_steps = 0
    handler.reset_engine()
    out = batch(chat("a", max_new_tokens=200), chat("b" * 40, max_new_tokens=200))
    assert [r["response"] for r in out["results"]] == ["echo:a", "echo:" + "b" * 40]
    assert 45 <= hub.decode_steps <= 64  # one row still talking keeps the batch going
    hub.decode_steps = 0
    hub.reply = "never ends " * 10
    handler.reset_engine()
    out = call(chat("x", max_new_tokens=30))
    assert out["finish_reason"] == "length" and hub.decode_steps == 29  # the budget, not the check


def test_a_row_at_its_own_budget_counts_as_ended(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch)
    # "x" talks on past 4 tokens but may say only 4; "b" ends after 7 of its 200: nothing is left.
    out = batch(chat("x" * 40, max_new_tokens=4), chat("b", max_new_tokens=200))
    assert out["results"][0]["finish_reason"] == "length" and out["results"][1]["response"] == "echo:b"
    assert hub.decode_steps <= 16


def test_filler_rows_of_the_compiled_path_never_hold_a_batch_open(monkeypatch, hub):
    hub.reply, hub.cuda_available, hub.device = echo, True, "cuda:0"
    serve(monkeypatch, QWEN, VLM_COMPILE="true")
    out = batch(chat("a", max_new_tokens=200), chat("b", max_new_tokens=200))  # 2 rows padded to 4
    assert [r["response"] for r in out["results"]] == ["echo:a", "echo:b"]
    assert hub.decode_calls[-1]["rows"] == 4 and hub.decode_steps <= 16
    (processed,) = hub.processor_calls
    assert len(processed["text"]) == 4


def test_end_tokens_past_the_vocabulary_are_ignored(monkeypatch, hub):
    hub.reply, hub.extra_eos = "fine", [VOCAB + 7]
    serve(monkeypatch)
    assert call(chat("x"))["response"] == "fine"


def test_max_batch_size_limits_rows_per_model_call(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch, VLM_MAX_BATCH_SIZE=2)
    out = batch(*[chat(f"q{i}") for i in range(5)])
    assert [r["response"] for r in out["results"]] == [f"echo:q{i}" for i in range(5)]
    sizes = [len(c["text"]) for c in hub.processor_calls]
    assert max(sizes) <= 2 and sum(sizes) == 5


def test_each_item_keeps_its_own_max_new_tokens_in_a_shared_batch(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("aaaaaaaaaa", max_new_tokens=3), chat("bb", max_new_tokens=40))
    first, second = out["results"]
    assert first["response"] == "ech" and first["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 3
    assert second["response"] == "echo:bb" and second["finish_reason"] == "stop"
    assert len(hub.processor_calls) == 1  # still one batch


def test_a_failing_item_does_not_sink_its_batch(monkeypatch, hub):
    def reply(prompt):
        if "boom" in prompt:
            raise RuntimeError("CUDA out of memory: secret-detail-123")
        return echo(prompt)

    hub.reply = reply
    serve(monkeypatch)
    out = batch(chat("one"), chat("boom"), chat("three"))
    results = out["results"]
    assert results[0]["response"] == "echo:one" and results[2]["response"] == "echo:three"
    assert results[1]["code"] == "generation_failed" and "response" not in results[1]
    assert "secret-detail-123" not in json.dumps(out) and "Traceback" not in json.dumps(out)


def test_batch_quantize_comes_from_the_first_item_that_sets_one(monkeypatch, hub):
    serve(monkeypatch)
    out = batch(chat("a"), chat("b", quantize="8bit"), chat("c", quantize="4bit"))
    assert model_load()[2]["quantization_config"].kwargs.get("load_in_8bit") is True
    first, second, third = out["results"]
    assert "quantize_warning" not in first and "quantize_warning" not in second
    assert third["quantize"] == "8bit" and "4bit" in third["quantize_warning"]


@pytest.mark.parametrize("model_id", [MINICPM, INTERNVL, PHI3])
def test_remote_code_families_answer_batches_item_by_item(monkeypatch, hub, model_id):
    hub.reply = lambda prompt: "echo:" + (last_user_text(prompt) if "<|user|>" in prompt else prompt)
    serve(monkeypatch, model_id)
    out = batch(chat("one"), chat("two"), chat("three"))
    assert [r["response"] for r in out["results"]] == ["echo:one", "echo:two", "echo:three"]
    assert len(hub.chat_calls) + len(hub.generate_calls) == 3


def test_batch_images_echo_is_per_item(monkeypatch):
    serve(monkeypatch)
    out = batch(chat("a", batch_images=True), chat("b"))
    assert out["results"][0]["batch_images"] is True and "batch_images" not in out["results"][1]


def test_batch_without_a_job_id(monkeypatch):
    serve(monkeypatch)
    out = handler.handler({"input": {"requests": [chat("a")]}})
    assert out["id"] is None and out["count"] == 1


# =================================================================================================
# The compiled (CUDA) path, faked: same answers, padded rows dropped
# =================================================================================================


def test_compiled_path_answers_like_the_eager_one(monkeypatch, hub):
    hub.reply = echo
    items = [chat("one"), caption(b64(16, 16)), chat("three", max_new_tokens=2)]
    serve(monkeypatch, QWEN, VLM_COMPILE="false")
    eager = batch(*items)["results"]
    handler.reset_engine()
    hub.reset()
    hub.reply, hub.cuda_available, hub.device = echo, True, "cuda:0"
    serve(monkeypatch, QWEN, VLM_COMPILE="true")
    compiled = batch(*items)["results"]
    assert [r["response"] for r in compiled] == [r["response"] for r in eager]
    assert [r["finish_reason"] for r in compiled] == [r["finish_reason"] for r in eager]
    assert [r["usage"]["completion_tokens"] for r in compiled] == [r["usage"]["completion_tokens"] for r in eager]
    assert hub.models[0].compiled_calls > 0  # the compiled forward really ran


def test_compiled_path_is_never_used_with_bitsandbytes(monkeypatch, hub):
    hub.reply, hub.cuda_available, hub.device = echo, True, "cuda:0"
    serve(monkeypatch, QWEN, VLM_QUANTIZE="4bit", VLM_COMPILE="true")
    out = batch(chat("a"), chat("b"))
    assert [r["response"] for r in out["results"]] == ["echo:a", "echo:b"]
    assert hub.models[0].compiled_calls == 0


def test_sampling_on_the_compiled_path(monkeypatch, hub):
    hub.reply, hub.cuda_available, hub.device = echo, True, "cuda:0"
    serve(monkeypatch, QWEN)
    out = batch(chat("x", do_sample=True, temperature=0.5), chat("y", do_sample=True, temperature=0.5))
    assert [r["response"] for r in out["results"]] == ["echo:x", "echo:y"]
    (decoded,) = hub.decode_calls
    # Padded to the bucket with short greedy filler rows, which never hold the batch open.
    assert decoded["rows"] == 4
    assert decoded["do_sample"] == [True, True, False, False] and decoded["max_new_tokens"][2:] == [1, 1]
    assert [g.captured for g in hub.graphs] == [True]  # the sampling variant of the step


def compiled_engine(monkeypatch, hub, **env):
    hub.reply, hub.cuda_available, hub.device = echo, True, "cuda:0"
    serve(monkeypatch, QWEN, **dict({"VLM_COMPILE": "true"}, **env))


def captured() -> int:
    return sum(g.captured for g in HUB.graphs)


def replays() -> int:
    return sum(g.replays for g in HUB.graphs)


def test_compiled_path_captures_one_graph_per_bucket_and_variant_then_replays(monkeypatch, hub):
    compiled_engine(monkeypatch, hub, VLM_MAX_BATCH_SIZE=4)
    assert call(chat("a"))["response"] == "echo:a"
    assert (hub.capture_attempts, captured(), replays()) == (1, 1, 0)  # recorded after the first batch
    steps = hub.decode_steps
    assert call(chat("again"))["response"] == "echo:again"
    assert hub.capture_attempts == 1
    assert replays() == hub.decode_steps - steps > 0  # every step of the second batch is a replay
    assert call(chat("s", do_sample=True, temperature=0.5, top_p=0.5))["response"] == "echo:s"
    assert (hub.capture_attempts, captured()) == (2, 2)  # the sampling variant
    assert call(chat("t", do_sample=True, temperature=0.5, top_p=0.5))["response"] == "echo:t"
    assert hub.capture_attempts == 2
    out = batch(chat("p"), chat("q"), chat("r"))  # 3 rows: the 4-row bucket
    assert [r["response"] for r in out["results"]] == ["echo:p", "echo:q", "echo:r"]
    assert (hub.capture_attempts, captured()) == (3, 3)
    before = replays()
    out = batch(chat("u"), chat("v"))  # 2 rows: the same 4-row bucket, replayed
    assert [r["response"] for r in out["results"]] == ["echo:u", "echo:v"]
    assert hub.capture_attempts == 3 and replays() > before
    assert len(hub.compiles) == 1 and hub.compiles[0]["dynamic"] is False  # one compiled forward


def test_a_failed_graph_capture_falls_back_to_plain_steps(monkeypatch, hub, caplog):
    compiled_engine(monkeypatch, hub)
    hub.capture_failures = 1
    assert call(chat("a"))["response"] == "echo:a"
    assert hub.capture_attempts == 1 and captured() == 0
    assert "CUDA graph capture failed" in caplog.text
    calls = hub.models[0].compiled_calls
    out = call(chat("b" * 20))
    assert out["response"] == "echo:" + "b" * 20 and out["finish_reason"] == "stop"
    assert hub.capture_attempts == 1 and replays() == 0  # not retried for that bucket
    assert hub.models[0].compiled_calls - calls >= 20  # the steps ran through the compiled forward


def test_warm_up_records_every_bucket_and_variant(monkeypatch, hub):
    compiled_engine(monkeypatch, hub, VLM_MAX_BATCH_SIZE=4)
    engine = handler.get_engine()
    assert engine.warm_up() >= 0.0
    assert [d["rows"] for d in hub.decode_calls] == [1, 1, 1, 1, 4, 4, 4, 4]
    assert [d["do_sample"][0] for d in hub.decode_calls] == [False, False, True, True] * 2
    assert (hub.capture_attempts, captured()) == (4, 4)
    out = batch(chat("a"), chat("b", do_sample=True, temperature=0.5, top_p=0.5))
    assert [r["response"] for r in out["results"]] == ["echo:a", "echo:b"]
    assert hub.capture_attempts == 4 and replays() > 0  # nothing left to record for a request


def test_warm_up_does_nothing_off_the_gpu(monkeypatch, hub):
    serve(monkeypatch, QWEN)
    assert handler.get_engine().warm_up() == 0.0
    assert not hub.decode_calls and not hub.graphs and not hub.compiles


def test_compiled_replays_answer_like_the_eager_path(monkeypatch, hub):
    hub.reply, hub.repetition_penalty = echo, 1.1
    items = [chat("one", min_new_tokens=8), chat("two", do_sample=True, temperature=0.6, top_p=0.3),
             chat("three", max_new_tokens=4)]
    serve(monkeypatch, QWEN, VLM_COMPILE="false")
    eager = batch(*items)["results"]
    handler.reset_engine()
    hub.reset()
    compiled_engine(monkeypatch, hub)
    hub.repetition_penalty = 1.1
    batch(*items)  # captures the graph
    compiled = batch(*items)["results"]  # replays it
    assert replays() > 0
    for key in ("response", "finish_reason", "usage"):
        assert [r[key] for r in compiled] == [r[key] for r in eager]


# =================================================================================================
# The handler never raises
# =================================================================================================


@pytest.mark.parametrize("job", [None, "text", 5, [], {}, {"input": None}, {"input": "text"}, {"input": []},
                                 {"input": 3}])
def test_malformed_jobs_get_an_error_naming_input(monkeypatch, hub, job):
    serve(monkeypatch)
    out = handler.handler(job)
    assert_error(out, "input", "invalid_request")
    assert not hub.models


def test_an_exception_inside_generation_is_a_clean_error(monkeypatch, hub):
    def reply(prompt):
        raise RuntimeError("CUDA error: device-side assert, secret-detail-456")

    hub.reply = reply
    serve(monkeypatch)
    out = call(caption())
    assert out["code"] == "generation_failed" and "response" not in out
    text = json.dumps(out)
    assert "secret-detail-456" not in text and "Traceback" not in text and "RuntimeError" not in text
    hub.reply = "recovered"
    assert call(caption())["response"] == "recovered"  # the worker keeps serving


@pytest.mark.parametrize("model_id", [MINICPM, INTERNVL, PHI3])
def test_an_exception_inside_remote_code_is_a_clean_error(monkeypatch, hub, model_id):
    def reply(prompt):
        raise ValueError("remote code blew up: secret-detail-789")

    hub.reply = reply
    serve(monkeypatch, model_id)
    out = call(caption())
    assert out["code"] == "generation_failed"
    assert "secret-detail-789" not in json.dumps(out) and "Traceback" not in json.dumps(out)


def test_an_unexpected_internal_failure_is_reported_not_raised(monkeypatch, hub):
    serve(monkeypatch)
    call(caption())  # loaded

    def broken(*args, **kwargs):
        raise KeyError("secret-detail-000")

    monkeypatch.setattr(handler, "format_output", broken)  # a bug after generation, outside any guard
    out = call(caption())
    assert out["code"] == "internal_error" and "response" not in out
    assert "secret-detail-000" not in json.dumps(out) and "Traceback" not in json.dumps(out)


# =================================================================================================
# The stubbed API list is exactly what the handler exercises
# =================================================================================================


def test_stubbed_api_is_exactly_what_the_handler_uses(monkeypatch, hub):
    USED.clear()
    # 1. Native family on a (fake) GPU: auto dtype, compiled decode loop with repetition penalty,
    #    min_new_tokens, images; then sampling, and a second identical batch (cache reuse).
    hub.cuda_available, hub.device, hub.repetition_penalty, hub.reply = True, "cuda:0", 1.2, echo
    serve(monkeypatch, QWEN)
    assert call(caption(min_new_tokens=2))["response"]
    assert call(caption(min_new_tokens=2))["response"]
    assert call(chat("s", do_sample=True, temperature=0.5))["response"] == "echo:s"
    # 2. Phi-3-vision, 4-bit, explicit dtype.
    handler.reset_engine()
    hub.reset()
    serve(monkeypatch, PHI3, VLM_QUANTIZE="4bit", VLM_DTYPE="fp16")
    assert call(caption())["response"] == "ok"
    # 3. MiniCPM-V and 4. InternVL2, on CPU.
    for model_id in (MINICPM, INTERNVL):
        handler.reset_engine()
        hub.reset()
        serve(monkeypatch, model_id)
        assert call(caption())["response"] == "ok"
    assert USED == STUBBED_API, (
        f"listed but not exercised: {sorted(STUBBED_API - USED)}; exercised but not listed: {sorted(USED - STUBBED_API)}"
    )


def test_a_sampled_neighbours_min_new_tokens_does_not_lengthen_an_answer(monkeypatch, hub):
    # Regression: sampled items shared one generate() call whose min_new_tokens was the batch's
    # largest, so an item that asked for none was padded out with filler tokens.
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("a", do_sample=True, temperature=0.5),
                chat("b", do_sample=True, temperature=0.5, min_new_tokens=12))
    first, second = out["results"]
    assert first["response"] == "echo:a" and first["usage"]["completion_tokens"] == 6
    assert second["usage"]["completion_tokens"] >= 12 and second["response"].startswith("echo:b")


def test_greedy_neighbours_keep_their_own_min_new_tokens(monkeypatch, hub):
    hub.reply = echo
    serve(monkeypatch)
    out = batch(chat("a"), chat("b", min_new_tokens=12))
    first, second = out["results"]
    assert first["response"] == "echo:a" and first["usage"]["completion_tokens"] == 6
    assert second["usage"]["completion_tokens"] >= 12
