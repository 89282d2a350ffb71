"""The Qwen-style vision towers attend through engine/vision_attention.py: one call a layer over the packed
images, giving the tower's own features (its SDPA per image) on the CPU path and on the GPU path's layout."""

from __future__ import annotations

import pytest
import torch

from runpod_vlm.engine import varlen, vision_attention
from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn
from tools.sample_images import striped

PACKED_FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]


def image_features(engine, sizes, mode=torch.inference_mode):
    """The vision tower's features for images of `sizes`, run under `mode` (the engine's: inference mode)."""
    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=1)
    turn = Turn("user", [*(striped(size) for size in sizes), "Describe."])
    inputs, _ = engine.adapter.batch_inputs(
        engine.processor, [GenerationRequest("vqa", [turn], params)], "cpu", engine.dtype
    )
    with mode():
        features = engine.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    embeds = getattr(features, "pooler_output", features)
    return torch.cat(list(embeds) if isinstance(embeds, (tuple, list)) else [embeds])


def with_towers_own_attention(engine, sizes):
    engine.model.set_attn_implementation({"vision_config": "sdpa"})
    try:
        return image_features(engine, sizes)
    finally:
        engine.model.set_attn_implementation({"vision_config": vision_attention.NAME})


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_a_qwen_vision_tower_attends_packed_and_gives_its_own_features(tiny_model, serve, family):
    engine = serve(tiny_model(family))
    assert engine.packed_vision and engine.model.config.vision_config._attn_implementation == vision_attention.NAME
    sizes = [(64, 48), (96, 64), (48, 80)]  # three images of other sizes: three sequences in one
    assert torch.equal(image_features(engine, sizes), with_towers_own_attention(engine, sizes))


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
    """What torch.nn.attention.varlen.varlen_attn computes (non-causal), on [tokens, heads, dim], by hand."""
    outputs = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        part = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        outputs.append(torch.nn.functional.scaled_dot_product_attention(*part, scale=scale).transpose(0, 1))
    return torch.cat(outputs)


def test_the_gpu_path_hands_varlen_the_packed_layout_and_takes_its_output_back(tiny_model, serve, monkeypatch):
    engine = serve(tiny_model("qwen2.5-vl"))  # window attention too: many sequences a layer
    sizes = [(64, 48), (112, 80)]
    expected = with_towers_own_attention(engine, sizes)
    calls = []
    monkeypatch.setattr(varlen, "takes", lambda query: True)
    monkeypatch.setattr(varlen, "kernel", lambda: lambda *a, **k: calls.append(1) or reference_varlen(*a, **k))
    assert torch.allclose(image_features(engine, sizes), expected, atol=1e-5)
    assert len(calls) == engine.model.config.vision_config.depth  # one call a layer


def test_other_families_keep_their_vision_attention(tiny_model, serve):
    engine = serve(tiny_model("llava"))
    assert not engine.packed_vision
    assert engine.model.config.vision_config._attn_implementation != vision_attention.NAME


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention runs on the GPU")
@pytest.mark.parametrize("head_dim", [80, 128])  # the towers' and the language models'
@pytest.mark.parametrize("causal", [False, True])
def test_flash_called_straight_gives_varlen_attn_output(causal, head_dim):
    """The kernel called without varlen_attn's wrapper, grouped heads as they are, against varlen_attn itself on
    repeated heads; causal with a cached prefix (more keys than queries) as a prefill's chunk has it."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    torch.manual_seed(0)
    lengths_q = [5, 130, 64, 1]
    lengths_k = [5, 200, 64, 33] if causal else lengths_q
    q = torch.randn(sum(lengths_q), 12, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (
        torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32) for lengths in (lengths_q, lengths_k)
    )
    window = (-1, 0) if causal else (-1, -1)
    ours = varlen.flash(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), 0.1, window, enable_gqa=True)
    options = (
        {"window_size": window} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": causal}
    )
    repeated = [t.repeat_interleave(6, dim=1) for t in (k, v)]
    theirs = varlen_attn(q, *repeated, cu_q, cu_k, max(lengths_q), max(lengths_k), scale=0.1, **options)
    assert torch.equal(ours, theirs), (ours.float() - theirs.float()).abs().max()
