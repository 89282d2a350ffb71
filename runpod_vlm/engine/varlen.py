"""PyTorch's variable-length FlashAttention (`torch.nn.attention.varlen`), for sequences packed into one: the
vision towers' images, and a prefill's prompts, each attending within its own span (`cu_seqlens`)."""

from __future__ import annotations

import functools
import inspect

_found: list = []  # not functools.cache: dynamo, tracing the compiled vision blocks, warned at each call through it


def kernel():
    """`varlen_attn`, or None (a torch without it); asked in every layer."""
    if not _found:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        _found.append(varlen_attn)
    return _found[0]


def takes(query) -> bool:
    """Whether `query` can go through the kernel: on the GPU, in half precision."""
    import torch

    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and kernel() is not None


@functools.cache
def _parameters(function) -> frozenset:
    return frozenset(inspect.signature(function).parameters)


def causal(query, key, value, cu_seqlens, longest: int, scale=None, key_starts=None, longest_keys=None):
    """Causal attention within each packed sequence: query [tokens, heads, dim], key and value [keys, kv heads,
    dim] (grouped heads repeated where the kernel does not take them) -> [tokens, heads, dim]. Where a sequence
    has more keys (`key_starts`, `longest_keys`: a prefix already in the cache) than queries, its queries are
    its last tokens (the kernel's causal mask aligns them to its keys' end)."""
    function = kernel()
    parameters = _parameters(function)
    # torch 2.10 took `is_causal`; later ones a window, (-1, 0) being causal.
    options = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    if key_starts is None:
        key_starts, longest_keys = cu_seqlens, longest
    return function(query, key, value, cu_seqlens, key_starts, longest, longest_keys, scale=scale, **options)
