"""FP8 weights for the language model (`VLM_QUANTIZE=fp8`): each linear layer of its decoder layers holds its weight in
float8 e4m3 with one scale per output channel and multiplies through `torch._scaled_mm`, its input quantized per
token as it comes; the vision tower, the projector, the embeddings and the head keep the model's dtype. A decode step
reads half the weight bytes, and the cards with FP8 multiply it at twice bf16's rate. Imported only when asked for.

A product of a few rows (a decode step's, up to `FEW_ROWS`) runs a Triton kernel that reads the float8 weight and
multiplies it by the bf16 input as it is (`weight_only_matmul`): no input quantization, one launch. `_scaled_mm`'s
row-wise kernel took 9.9 us a product at 1 row on the H200, where the bytes of most need 1-3
(bench/results/profile-graph-step-fp8-a4c4597.txt).

Hand-written: torchao's float8 layers come with a torchao release pinned to each torch release, which the worker
image would have to pin beside its torch; float8 weight-only kernels for a few rows (Marlin's) ship inside vLLM's own
CUDA build."""

from __future__ import annotations

import functools
import logging

import torch

from runpod_vlm.engine.memory import text_model

log = logging.getLogger("runpod-vlm")

E4M3_MAX = 448.0  # the largest float8 e4m3 (fn) value
MIN_CAPABILITY = (8, 9)  # Ada (L40S, RTX 4090) and Hopper (H100, H200) multiply float8
FEW_ROWS = 64  # products of up to this many rows read the weight through `weight_only_matmul`


def fp8_supported(device) -> bool:
    """Whether `device` multiplies float8: a CUDA GPU of compute capability 8.9 or later."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def quantized_rows(values):
    """`values` [rows, columns] as float8 e4m3 and each row's scale [rows, 1] (its largest magnitude maps to 448)."""
    scale = values.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (values.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def weight_only(
        x,  # [rows, K], rows <= BLOCK_M
        weight,  # [N, K] float8 e4m3
        scale,  # [N] float32
        out,  # [rows, N], or with SPLITS > 1 float32 partial sums [SPLITS, rows, N]
        rows,
        N,
        K,
        per_split,  # K's elements each split reads, a multiple of BLOCK_K
        stride_x,
        stride_out,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        split = tl.program_id(1)
        row = tl.arange(0, BLOCK_M)
        column = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = split * per_split
        for start in range(first, tl.minimum(first + per_split, K), BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            held = (row[:, None] < rows) & (k[None, :] < K)
            a = tl.load(x + row[:, None] * stride_x + k[None, :], mask=held, other=0)
            inside = (column[None, :] < N) & (k[:, None] < K)
            w = tl.load(weight + column[None, :] * K + k[:, None], mask=inside)  # no `other`: no cast to float8
            acc += tl.dot(a, tl.where(inside, w.to(a.dtype), 0))
        acc *= tl.load(scale + column, mask=column < N, other=0)[None, :]
        mask = (row[:, None] < rows) & (column[None, :] < N)
        if SPLITS == 1:
            tl.store(out + row[:, None] * stride_out + column[None, :], acc.to(out.dtype.element_ty), mask=mask)
        else:
            tl.store(out + split * rows * N + row[:, None] * N + column[None, :], acc, mask=mask)

    @triton.jit
    def sum_splits(partial, out, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < size
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            acc += tl.load(partial + split * size + offsets, mask=inside, other=0)
        tl.store(out + offsets, acc.to(out.dtype.element_ty), mask=inside)

    return weight_only, sum_splits


def _multiprocessors(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


SPLIT_MIN_K = 1024  # K's elements a split reads at least: fewer would cost more in partial sums than they save


def tiles(rows: int, N: int, K: int, device) -> tuple[int, int, int, int]:
    """`weight_only_matmul`'s tiles (the columns and the stretch of K a program reads each step), pipeline stages and
    splits of K for `rows` x `N` x `K`. Wide outputs (an MLP's gate and up) take 32 or 64 columns a program, narrow
    ones (attention's projections, the MLP's down) 16; up to 16 rows, the long K of a narrow one (the down
    projection's) is read in splits, enough programs for four a multiprocessor, whose partial sums a second kernel
    adds (on an H100: 16 us against 22 at 1 row; at 64 rows 31 against 28, unsplit). The fastest tiles of
    bench/fp8_matmul.py's sweep on an H100 (results/fp8-matmul-h100-2a5a24c.json, fp8-matmul-h100-2fb4f45.json; at 7B's
    shapes fp8-matmul-7b-h100-8b0d85c.json)."""
    multiprocessors = _multiprocessors(device)
    if N >= 64 * multiprocessors:
        return (32, 128, 3, 1) if rows <= 16 else (64, 128, 2, 1)
    if N > 2048:  # 7B's attention projections and down, in 4 splits (fp8-matmul-7b-h100-8b0d85c.json)
        return (32, 256, 3, 4) if rows <= 16 else (64, 128, 4, 4)
    if rows > 16:
        return 16, 256, 3, 1
    splits = max(1, min(8, -(-4 * multiprocessors // -(-N // 16)), K // SPLIT_MIN_K))
    return 16, 256, 4, splits


def weight_only_matmul(x, weight, scale, config=None):
    """`x` [rows <= FEW_ROWS, K] times the float8 `weight` [N, K] transposed, each output column times its `scale`
    [N] (float32), in `x`'s dtype: the weight is read once, each tile turned to `x`'s dtype on chip. `config`
    overrides `tiles` (bench/fp8_matmul.py sweeps it)."""
    rows, K = x.shape
    N = weight.shape[0]
    block_n, block_k, stages, splits = config or tiles(rows, N, K, x.device)
    block_m = max(16, 1 << (rows - 1).bit_length())  # tl.dot takes 16 rows at least
    per_split = -(-K // (splits * block_k)) * block_k
    out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    partial = out if splits == 1 else torch.empty((splits, rows, N), dtype=torch.float32, device=x.device)
    weight_only, sum_splits = _kernels()
    weight_only[(-(-N // block_n), splits)](
        x, weight, scale, partial, rows, N, K, per_split, x.stride(0), out.stride(0), block_m, block_n, block_k, splits,
        num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        sum_splits[(-(-rows * N // 1024),)](partial, out, rows * N, splits, 1024)
    return out


@torch.library.custom_op("runpod_vlm::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """`x` [..., K] times the float8 `weight` [N, K] with its scales [1, N]: a few rows through `weight_only_matmul`,
    more with `x` quantized per row through `_scaled_mm` (its scales in the product where `rowwise`, after it
    elsewhere). One op to the compiler, so that the pass of engine/projections.py finds a group's repeated products."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda and flat.shape[0] <= FEW_ROWS:
        out = weight_only_matmul(flat.contiguous(), weight, weight_scale.reshape(-1))
    else:
        quantized, scale = quantized_rows(flat)
        if rowwise:
            out = torch._scaled_mm(quantized, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=x.dtype)
        else:
            unit = torch.ones((), device=x.device)
            out = torch._scaled_mm(quantized, weight.t(), scale_a=unit, scale_b=unit, out_dtype=x.dtype)
            out = (out * scale * weight_scale).to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@fp8_linear.register_fake
def _(x, weight, weight_scale, rowwise):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class Fp8Linear(torch.nn.Module):
    """A linear layer whose weight is float8 e4m3 [out, in] with a scale per output channel [1, out]."""

    def __init__(self, weight, weight_scale, bias=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # its transpose is the column-major operand _scaled_mm takes
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        # Hopper's _scaled_mm scales rows and columns in its epilogue; Ada's takes one scale a tensor (PyTorch's
        # row-wise kernel is written for sm_90), so there the scales multiply its output.
        self.rowwise = weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (9, 0)

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> Fp8Linear:
        weight, scale = quantized_rows(linear.weight.detach())
        return cls(weight, scale.t().contiguous(), None if linear.bias is None else linear.bias.detach())

    @classmethod
    def joined(cls, members: list, slices: list[slice]) -> Fp8Linear | None:
        """One layer over `members`' weights, one after the other (engine/projections.py's groups), each member's
        weight, scales and bias becoming views of its `slices` rows; None where they do not join (inputs or biases
        differ)."""
        first = members[0]
        if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None) for m in members):
            return None
        with torch.no_grad():
            weight = torch.cat([m.weight for m in members])
            scale = torch.cat([m.weight_scale for m in members], dim=1)
            bias = None if first.bias is None else torch.cat([m.bias for m in members])
        for member, rows in zip(members, slices):
            member.weight, member.weight_scale = weight[rows], scale[:, rows]
            if bias is not None:
                member.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
        return cls(weight, scale, bias)

    def forward(self, x):
        out = fp8_linear(x, self.weight, self.weight_scale, self.rowwise)
        return out if self.bias is None else out + self.bias  # added here: some row-wise kernels take no bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn"


def quantize_language_model(model) -> int:
    """Every `nn.Linear` of the decoder layers as an `Fp8Linear`, but those of sizes `_scaled_mm` does not take (not
    multiples of 16); returns how many."""
    replaced = 0
    for layer in text_model(model).layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0:
                    setattr(parent, name, Fp8Linear.of(child))
                    replaced += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the weights in the model's dtype, let go of
    log.info("%d linear layers of the language model hold float8 weights", replaced)
    return replaced
