"""PyTorch's variable-length FlashAttention (what `torch.nn.attention.varlen` runs on the GPU), for sequences packed
into one: the vision towers' images, and a prefill's prompts, each attending within its own span (`cu_seqlens`)."""

from __future__ import annotations

_found: list = []  # not functools.cache: dynamo, tracing the compiled vision blocks, warned at each call through it


def kernel():
    """`varlen_attn`'s FlashAttention called straight (`flash`), or None (a torch without `varlen_attn`); asked in
    every layer."""
    if not _found:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            _found.append(None)
        else:
            _found.append(flash)
    return _found[0]


def flash(
    query, key, value, cu_seq_q, cu_seq_k, max_q: int, max_k: int, scale=None, window_size=(-1, -1), enable_gqa=True
):
    """What `varlen_attn` runs on the GPU, FlashAttention, called without its Python custom-op wrapper (0.2 ms of the
    engine thread a call in a burst's prefills, with a `torch.zeros` launch for an unread random state; later
    torches also hand long sequences to cuDNN, which plans each new shape anew). `window_size`: (-1, -1) all keys,
    (-1, 0) causal. Grouped key/value heads go in as they are: FlashAttention takes them."""
    import torch

    if window_size[0] != -1 or window_size[1] not in (-1, 0):
        raise ValueError(f"window_size {window_size}: only (-1, -1) and (-1, 0)")
    causal = window_size[1] == 0
    outputs = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return outputs[0]


def takes(query) -> bool:
    """Whether `query` can go through the kernel: on the GPU, in half precision."""
    import torch

    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and kernel() is not None


def causal(query, key, value, cu_seqlens, longest: int, scale=None, key_starts=None, longest_keys=None):
    """Causal attention within each packed sequence: query [tokens, heads, dim], key and value [keys, kv heads,
    dim] -> [tokens, heads, dim]. Where a sequence has more keys (`key_starts`, `longest_keys`: a prefix already in
    the cache) than queries, its queries are its last tokens (the kernel's causal mask aligns them to its keys'
    end)."""
    if key_starts is None:
        key_starts, longest_keys = cu_seqlens, longest
    options = {"window_size": (-1, 0), "enable_gqa": query.shape[1] != key.shape[1]}
    return kernel()(query, key, value, cu_seqlens, key_starts, longest, longest_keys, scale=scale, **options)
