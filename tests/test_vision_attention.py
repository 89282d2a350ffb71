"""The Qwen-style vision towers attend through engine/vision_attention.py: one call a layer over the packed
images, giving the tower's own features (its SDPA per image) on the CPU path and on the GPU path's layout."""

from __future__ import annotations

import pytest
import torch

from runpod_vlm.engine import varlen, vision_attention
from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn
from sample_images import striped

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
