"""FP8 weights for the language model (`VLM_QUANTIZE=fp8`): each linear layer of its decoder layers holds its weight in
float8 e4m3 with one scale per output channel and multiplies through `torch._scaled_mm`, its input quantized per
token as it comes; the vision tower, the projector, the embeddings and the head keep the model's dtype. A decode step
reads half the weight bytes, and the cards with FP8 multiply it at twice bf16's rate. Imported only when asked for.

Hand-written (one module, one function): torchao's float8 layers come with a torchao release pinned to each torch
release, which the worker image would have to pin beside its torch."""

from __future__ import annotations

import logging

import torch

from runpod_vlm.engine.memory import text_model

log = logging.getLogger("runpod-vlm")

E4M3_MAX = 448.0  # the largest float8 e4m3 (fn) value
MIN_CAPABILITY = (8, 9)  # Ada (L40S, RTX 4090) and Hopper (H100, H200) multiply float8


def fp8_supported(device) -> bool:
    """Whether `device` multiplies float8: a CUDA GPU of compute capability 8.9 or later."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def quantized_rows(values):
    """`values` [rows, columns] as float8 e4m3 and each row's scale [rows, 1] (its largest magnitude maps to 448)."""
    scale = values.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (values.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(torch.nn.Module):
    """A linear layer whose weight is float8 e4m3 with a scale per output channel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantized_rows(linear.weight.detach())
        self.register_buffer("weight", weight)  # [out, in]: its transpose is the column-major operand _scaled_mm takes
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        self.register_buffer("unit", torch.ones((), device=weight.device))
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        # Hopper's _scaled_mm scales rows and columns in its epilogue; Ada's takes one scale a tensor (PyTorch's
        # row-wise kernel is written for sm_90), so there the scales multiply its output.
        self.rowwise = weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (9, 0)

    def forward(self, x):
        flat = x.reshape(-1, self.in_features)
        quantized, scale = quantized_rows(flat)
        if self.rowwise:
            out = torch._scaled_mm(
                quantized, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype
            )
        else:
            out = torch._scaled_mm(quantized, self.weight.t(), scale_a=self.unit, scale_b=self.unit, out_dtype=x.dtype)
            out = (out * scale * self.weight_scale).to(x.dtype)
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
