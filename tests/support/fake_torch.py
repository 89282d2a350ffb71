"""A tiny pure-Python torch for the stubbed suite: nested-list tensors with broadcasting, the ops and the cuda calls
the engine uses."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import types

from runpod_vlm.families.remote import InternVL2Adapter
from support.stubbed_api import _use

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
        _hub().protocol_errors.append(f"an op mixed tensors on {sorted(devices)}")
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
        self._data = _map(self._data, lambda v: _hub().rng.expovariate(lambd))
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
    _hub().compiles.append(dict(kwargs, dynamic=dynamic))
    owner = getattr(fn, "__self__", None)

    def compiled(*args, **kw):
        if owner is not None:
            owner.compiled_calls += 1
        return fn(*args, **kw)

    return compiled


def dynamo_config_patch(**changes):
    """The compile's settings for a block (`torch._dynamo.config.patch`): nothing compiles here."""
    _use("torch._dynamo.config.patch")
    return contextlib.nullcontext()


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
    return _hub().stream


@contextlib.contextmanager
def _stream_cm(stream):
    previous, _hub().stream = _hub().stream, stream
    try:
        yield stream
    finally:
        _hub().stream = previous


def cuda_stream(stream):
    _use("torch.cuda.stream")
    return _stream_cm(stream)


@contextlib.contextmanager
def _inference_mode_cm():
    _hub().inference_depth += 1
    try:
        yield
    finally:
        _hub().inference_depth -= 1


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
    return types.SimpleNamespace(total_memory=_hub().gpu_memory)


def cuda_get_per_process_memory_fraction(device=None):
    _use("torch.cuda.get_per_process_memory_fraction")
    return _hub().memory_fraction


def cuda_mem_get_info(device=None):
    _use("torch.cuda.mem_get_info")
    return _hub().gpu_memory - _hub().gpu_used, _hub().gpu_memory


def cuda_memory_allocated(device=None):
    _use("torch.cuda.memory_allocated")
    return _hub().gpu_used


def cuda_memory_reserved(device=None):
    _use("torch.cuda.memory_reserved")
    return _hub().gpu_used


def enable_cudnn_sdp(enabled: bool):
    _use("torch.backends.cuda.enable_cudnn_sdp")
    _hub().cudnn_sdp = enabled


def cuda_is_available():
    _use("torch.cuda.is_available")
    return _hub().cuda_available


def cuda_is_bf16_supported(*args, **kwargs):
    _use("torch.cuda.is_bf16_supported")
    return _hub().bf16_supported


def tv_to_tensor(picture):
    _use("torchvision.transforms.functional.to_tensor")
    width, height = picture.size
    return FakeImageTensor((3, height, width), [picture.size])


def tv_normalize(tensor, mean, std, inplace=False):
    _use("torchvision.transforms.functional.normalize")
    if tuple(mean) != InternVL2Adapter.mean or tuple(std) != InternVL2Adapter.std:
        _hub().protocol_errors.append(f"InternVL tiles normalised with {mean}/{std}")
    return FakeImageTensor(tensor.dims, tensor.tiles, tensor._dtype, tensor._device, normalized=True)


def _hub():
    """The scripted hub's state (support.fake_hub imports this module: looked up when called)."""
    from support.fake_hub import HUB

    return HUB
