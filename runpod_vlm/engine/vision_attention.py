"""One attention call per layer for a vision tower that packs its images into one sequence (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, GLM-4.1V: `cu_seqlens` marks where each image or window starts).

transformers runs such a tower's SDPA once per image (per window in Qwen2.5-VL) in every layer, after a
GPU sync that reads the lengths; unless the attention implementation's name says "flash", when it hands the
packed sequence and its `cu_seqlens` to the implementation. This one, registered under such a name, runs
PyTorch's own variable-length FlashAttention (`torch.nn.attention.varlen`) on the GPU, and on the CPU (or
a torch without it) transformers' per-image SDPA, exactly as before."""

from __future__ import annotations

from runpod_vlm.engine import varlen

NAME = "vlm_flash_varlen"  # "flash" in the name: transformers then passes the packed sequence


def _attention(
    module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None, max_length_q=None, **kwargs
):
    """query, key, value [1, heads, tokens, dim] -> [1, tokens, heads, dim], as transformers' implementations."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if varlen.takes(query):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
        cu = cu_seq_lens_q.to(torch.int32)
        output = varlen.kernel()(q, k, v, cu, cu, max_length_q, max_length_q, scale=scaling)
        return output.unsqueeze(0), None
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    parts = zip(*(torch.split(t, lengths, dim=2) for t in (query, key, value)))
    outputs = [sdpa_attention_forward(module, q, k, v, None, scaling=scaling, is_causal=False)[0] for q, k, v in parts]
    return torch.cat(outputs, dim=1), None


def use_packed_vision_attention(model) -> bool:
    """Make the vision tower attend through `_attention`; False when the model does not take it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return False
    try:
        model.set_attn_implementation({"vision_config": NAME})
    except Exception:
        return False
    return vision._attn_implementation == NAME
