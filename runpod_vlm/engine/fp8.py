"""FP8 weights for the language model (`VLM_QUANTIZE=fp8`): each linear layer of its decoder layers holds its weight in
float8 e4m3 with one scale per output channel and multiplies through `torch._scaled_mm`, its input quantized per
token as it comes; the vision tower, the projector, the embeddings and the head keep the model's dtype. A decode step
reads half the weight bytes, and the cards with FP8 multiply it at twice bf16's rate. Imported only when asked for.

A product of a few rows (a decode step's, up to `FEW_ROWS`) runs a Triton kernel that reads the float8 weight and
multiplies it by the bf16 input as it is (`weight_only_matmul`): no input quantization, one launch. `_scaled_mm`'s
row-wise kernel took 9.9 us a product at 1 row on the H200, where the bytes of most need 1-3
(bench/results/profile-graph-step-fp8-a4c4597.txt).

Hand-written (one module, one function): torchao's float8 layers come with a torchao release pinned to each torch
release, which the worker image would have to pin beside its torch."""

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
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def weight_only(
        x,  # [rows, K], rows <= BLOCK_M
        weight,  # [N, K] float8 e4m3
        scale,  # [N] float32
        out,  # [rows, N]
        rows,
        N,
        K,
        stride_x,
        stride_out,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        row = tl.arange(0, BLOCK_M)
        column = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            held = (row[:, None] < rows) & (k[None, :] < K)
            a = tl.load(x + row[:, None] * stride_x + k[None, :], mask=held, other=0)
            inside = (column[None, :] < N) & (k[:, None] < K)
            w = tl.load(weight + column[None, :] * K + k[:, None], mask=inside)  # no `other`: no cast to float8
            acc += tl.dot(a, tl.where(inside, w.to(a.dtype), 0))
        acc *= tl.load(scale + column, mask=column < N, other=0)[None, :]
        mask = (row[:, None] < rows) & (column[None, :] < N)
        tl.store(out + row[:, None] * stride_out + column[None, :], acc.to(out.dtype.element_ty), mask=mask)

    return weight_only


def _multiprocessors(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def tiles(rows: int, N: int, device) -> tuple[int, int, int]:
    """`weight_only_matmul`'s tiles (columns and K a program reads each step) and pipeline stages for `rows` x `N`.
    Enough programs to keep every multiprocessor reading: wide outputs (an MLP's gate and up) in 64 columns,
    narrow ones (attention's projections, the MLP's down) in 16 with longer strides of K each."""
    if N >= 64 * _multiprocessors(device):
        return 64, 128, 3
    return 16, 512 if rows <= 16 else 256, 3


def weight_only_matmul(x, weight, scale, config=None):
    """`x` [rows <= FEW_ROWS, K] times the float8 `weight` [N, K] transposed, each output column times its `scale`
    [N] (float32), in `x`'s dtype: the weight is read once, each tile turned to `x`'s dtype on chip. `config`
    overrides `tiles` (bench/fp8_matmul.py sweeps it)."""
    rows, K = x.shape
    N = weight.shape[0]
    block_n, block_k, stages = config or tiles(rows, N, x.device)
    block_m = max(16, 1 << (rows - 1).bit_length())  # tl.dot takes 16 rows at least
    out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    _kernel()[(-(-N // block_n),)](
        x, weight, scale, out, rows, N, K, x.stride(0), out.stride(0), block_m, block_n, block_k, num_stages=stages
    )
    return out


@torch.library.custom_op("runpod_vlm::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """`x` [rows, K] times the float8 `weight` [N, K] with its scales [1, N]: few rows through `weight_only_matmul`,
    more with `x` quantized per row through `_scaled_mm` (its scales in the product where `rowwise`, after it
    elsewhere). One opaque op to the compiler: a decode step's shapes are known, so it takes one path."""
    if x.is_cuda and x.shape[0] <= FEW_ROWS:
        return weight_only_matmul(x.contiguous(), weight, weight_scale.reshape(-1))
    quantized, scale = quantized_rows(x)
    if rowwise:
        return torch._scaled_mm(quantized, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=x.dtype)
    unit = torch.ones((), device=x.device)
    out = torch._scaled_mm(quantized, weight.t(), scale_a=unit, scale_b=unit, out_dtype=x.dtype)
    return (out * scale * weight_scale).to(x.dtype)


@fp8_linear.register_fake
def _(x, weight, weight_scale, rowwise):
    return x.new_empty((x.shape[0], weight.shape[0]))


class Fp8Linear(torch.nn.Module):
    """A linear layer whose weight is float8 e4m3 with a scale per output channel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantized_rows(linear.weight.detach())
        self.register_buffer("weight", weight)  # [out, in]: its transpose is the column-major operand _scaled_mm takes
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        # Hopper's _scaled_mm scales rows and columns in its epilogue; Ada's takes one scale a tensor (PyTorch's
        # row-wise kernel is written for sm_90), so there the scales multiply its output.
        self.rowwise = weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (9, 0)

    def forward(self, x):
        out = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.rowwise)
        out = out if self.bias is None else out + self.bias  # added here: some row-wise kernels take no bias
        return out.reshape(*x.shape[:-1], self.out_features)

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
                    setattr(parent, name, Fp8Linear(child))
                    replaced += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the weights in the model's dtype, let go of
    log.info("%d linear layers of the language model hold float8 weights", replaced)
    return replaced
