"""LongRoPE's factors chosen per row (Phi-4-multimodal), as generate() means them for one sequence alone.

transformers' LongRoPE rotary takes the long factors for a whole forward once its highest position passes the
original context (`longrope_frequency_update`), and Phi-4's generate() is meant to recompute the cache when a sequence
first passes it (`prepare_inputs_for_generation`, transformers PR #33129): a sequence's keys are all short-factor
ones while it holds at most the original context, all long-factor ones after. A decode step of many rows would
switch them all with its longest. So in a decode step (`by_position`) each token takes the factors of its own
position; a prefill holds one prompt, whose forward chooses for it as the model's own; and a row reaching the
original context is prefilled again, whole, with the long factors (`Scheduler.recompute_at`). Hand-written:
transformers has no per-row choice of these factors."""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

_steps = threading.local()  # whether this thread runs a decode step (the compile thread runs its own)


@contextlib.contextmanager
def by_position():
    """Within it (a decode step), each token takes the long factors iff its position + 1 passes the original context;
    outside, a forward takes them as the model's own rotary does."""
    previous = getattr(_steps, "on", False)
    _steps.on = True
    try:
        yield
    finally:
        _steps.on = previous


def per_row_long_rope(model) -> Optional[int]:
    """Give the text model's LongRoPE rotary (if it has one) the choice by position in decode steps; its original
    context (where a row is recomputed), or None."""
    text, rotary = _rotary(model)
    if not chooses_by_row(model):
        if getattr(rotary, "rope_type", None) != "longrope":
            return None
        text.rotary_emb = rotary = _long_rope_by_row(rotary)
    return rotary.original


def chooses_by_row(model) -> bool:
    """Whether the text model's rotary chooses by position in a decode step (`per_row_long_rope` made it so)."""
    return getattr(_rotary(model)[1], "by_row", False)


def _rotary(model) -> tuple:
    """The text model and its rotary embedding (None where it has none)."""
    text = model.get_decoder() if hasattr(model, "get_decoder") else None
    return text, getattr(text, "rotary_emb", None)


def _long_rope_by_row(rotary):
    """The model's LongRoPE `rotary`, each token's factors chosen by its own position inside `by_position`."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    class LongRopeByRow(torch.nn.Module):
        by_row = True

        def __init__(self):
            super().__init__()
            self.whole = rotary  # the model's own: one choice a forward
            self.original = rotary.config.rope_parameters["original_max_position_embeddings"]
            device = rotary.original_inv_freq.device
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, device, seq_len=self.original + 1)
            self.short_inv_freq = torch.nn.Buffer(rotary.original_inv_freq.clone(), persistent=False)
            self.long_inv_freq = torch.nn.Buffer(long, persistent=False)

        def forward(self, x, position_ids):
            if not getattr(_steps, "on", False):
                return self.whole(x, position_ids=position_ids)
            long = position_ids + 1 > self.original
            # As transformers computes them (a float32 product, autocast off), for both sets; then each token's. No
            # host sync (the model's own reads the highest position back): the step replays as a CUDA graph.
            with torch.autocast(device_type=x.device.type if x.device.type != "mps" else "cpu", enabled=False):
                positions = position_ids[:, None, :].float()
                short, longer = (
                    (inv[None, :, None].expand(position_ids.shape[0], -1, 1).float() @ positions).transpose(1, 2)
                    for inv in (self.short_inv_freq, self.long_inv_freq)
                )
                emb = torch.where(long[..., None], longer, short).repeat(1, 1, 2)
                scaling = self.whole.attention_scaling
                cos, sin = emb.cos() * scaling, emb.sin() * scaling
            return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    return LongRopeByRow()
