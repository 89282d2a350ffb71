"""Attention over the paged KV pool, as a transformers attention implementation of the text model.

Outside a paged forward it is transformers' own SDPA (a prefill into a scratch cache). Inside one, each
layer writes its new keys/values into the pool at the step's slots, then attends: a decode step on the
GPU through `decode_kernel` (each row reads its own blocks), new prompts packed into one sequence on the
GPU through `varlen.causal` (each within its own span; a short prefill's prompts reading their keys back from the
pool, a cached prefix's too: `prefill_graphs`), a longer prompt chunk (and any step on the CPU) by
gathering the slots each query row reads and running SDPA on them, each key/value head repeated for its
query heads (with a mask, only SDPA's math kernel takes grouped heads: 2.0 s of chunks on the H200 against 0.8 s).
Hand-written: transformers' paged implementations repeat K/V per head (`paged|sdpa`: 708 tok/s for 64
prompts on the H200, text only) or need a flash-attn kernel that does not install from the registry."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

NAME = "vlm_paged"
_active = threading.local()  # the paged step of this thread's forward (the compile thread runs its own)


@dataclass
class PagedStep:
    """What one forward's attention reads: `slots` [tokens] where each new token's K/V goes (row-major
    over query rows, then positions); then either `index` [query rows, length] the slots each row attends
    to and `visible` [query rows, 1, query length, length] which of them it may see, or (a decode step
    through the kernel) `table` [rows, columns] each row's blocks and `seen` [rows] how many of its
    tokens it attends to, or (new prompts packed into one query row) `starts` [prompts + 1] where each
    begins and `longest` the longest's length: each attends causally to its own keys, all new; or, with
    `key_slots` [keys] the pool slots of each prompt's keys (its cached prefix, then its new tokens) packed
    likewise (`key_starts`, `longest_keys`), to those.

    `limits`, per layer, (window, chunk): a sliding-window layer's row attends to its last `window` tokens only, a
    chunked-attention layer's to its new token's chunk only (0: no limit). Kernel steps apply them from `seen`,
    gathering ones from `query_positions` [query rows, query length] (each query's position in its row, the
    gathered keys being the row's tokens from its first); packed prompts come only within every limit."""

    keys: list  # per layer [pool slots, kv heads, head dim]
    values: list
    slots: Any
    index: Any = None
    visible: Any = None
    table: Any = None
    seen: Any = None
    block_size: int = 0
    starts: Any = None
    longest: int = 0
    key_slots: Any = None
    key_starts: Any = None
    longest_keys: int = 0
    limits: Any = None
    query_positions: Any = None


def attention_limits(text_config) -> list[tuple[int, int]]:
    """Per layer, (window, chunk) as `PagedStep.limits`: Gemma 3's sliding-window layers, Llama 4's chunked ones."""
    window = getattr(text_config, "sliding_window", None) or 0
    chunk = getattr(text_config, "attention_chunk_size", None) or 0
    kinds = getattr(text_config, "layer_types", None) or (
        ["sliding_attention" if window else "full_attention"] * text_config.num_hidden_layers
    )
    return [(window * (kind == "sliding_attention"), chunk * (kind == "chunked_attention")) for kind in kinds]


@contextlib.contextmanager
def paged(step: PagedStep):
    previous = getattr(_active, "step", None)
    _active.step = step
    try:
        yield
    finally:
        _active.step = previous


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    step = getattr(_active, "step", None)
    if step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return _paged_attention(module.layer_idx, step, query, key, value, scaling)


def _paged_attention(layer: int, step: PagedStep, query, key, value, scaling):
    import torch

    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    pool_keys, pool_values = step.keys[layer], step.values[layer]
    pool_keys.index_copy_(0, step.slots, key.transpose(1, 2).reshape(-1, kv_heads, dim).to(pool_keys.dtype))
    pool_values.index_copy_(0, step.slots, value.transpose(1, 2).reshape(-1, kv_heads, dim).to(pool_values.dtype))
    window, chunk = step.limits[layer] if step.limits else (0, 0)
    if step.starts is not None:
        from runpod_vlm.engine import varlen

        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
        if step.key_slots is not None:  # its keys read back from the pool (else its own new ones, as the queries)
            k, v = pool_keys[step.key_slots], pool_values[step.key_slots]
        output = varlen.causal(q, k, v, step.starts, step.longest, scaling, step.key_starts, step.longest_keys)
        return output.unsqueeze(0), None
    if step.index is None:
        from runpod_vlm.engine.decode_kernel import paged_decode_attention

        scale = dim**-0.5 if scaling is None else scaling
        output = paged_decode_attention(
            query, pool_keys, pool_values, step.table, step.seen, step.block_size, scale, window, chunk
        )
        return output.transpose(1, 2).contiguous(), None
    keys = pool_keys[step.index].transpose(1, 2)  # [rows, kv heads, length, dim]
    values = pool_values[step.index].transpose(1, 2)
    if heads != kv_heads:
        keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
    visible = step.visible
    if window or chunk:
        visible = visible & _within(step.query_positions, step.index.shape[1], window, chunk)
    output = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def _within(query_positions, keys: int, window: int, chunk: int):
    """[rows, 1, query length, keys]: which of a row's first `keys` tokens each query may see under the limits."""
    import torch

    key = torch.arange(keys, device=query_positions.device)
    query = query_positions[:, None, :, None]
    seen = torch.ones((), dtype=torch.bool, device=key.device)
    if window:
        seen = seen & (key > query - window)
    if chunk:
        seen = seen & (key // chunk == query // chunk)
    return seen


def _mask(*args, **kwargs):
    """transformers' SDPA mask for a scratch-cache prefill; none in a paged forward (`visible` is the mask)."""
    if getattr(_active, "step", None) is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def use_paged_attention(model) -> bool:
    """Make the text model attend through the pool (the vision tower keeps its own attention); False when
    the model does not take it."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    # Run eagerly inside compiled decoder layers: the gather's length changes step to step (a recompile each).
    AttentionInterface.register(NAME, torch.compiler.disable(_attention))
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)
    try:
        # A flat config (Phi-4-multimodal's) is its own text config: set on the whole model, where the vision
        # tower's attention, never inside a paged step, stays transformers' SDPA.
        flat = model.config.get_text_config(decoder=True) is model.config
        model.set_attn_implementation(NAME if flat else {"text_config": NAME})
    except Exception:
        return False
    return model.config.get_text_config(decoder=True)._attn_implementation == NAME
