"""FP8 weights (`VLM_QUANTIZE=fp8`, engine/fp8.py) on the CPU: a layer's product through `torch._scaled_mm` (which
torch runs on the CPU too), with its scales inside the product or after it, is that of its float8 operands,
within e4m3's error of the original; the few-rows kernel (under Triton's interpreter) is the dequantized product;
only the decoder layers' linear layers are quantized, and their q/k/v and gate/up join into one product each in the
compiled step; cards without FP8 are refused naming the setting. Greedy
agreement with the unquantized model is not asserted: the tiny models are built to be sensitive to any change, and
their greedy tokens part within a few steps under fp8 (tokens/s and agreement on real shapes: bench/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from runpod_vlm.engine import loading
from runpod_vlm.engine.compile import model_view
from runpod_vlm.engine.fp8 import E4M3_MAX, Fp8Linear, quantize_language_model
from runpod_vlm.engine.projections import share_weights, with_shared_products
from runpod_vlm.settings import Settings, SettingsError
from test_shared_products import through_the_pass


def dequantized_rows(values):
    scale = values.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return (values / scale).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("rowwise", [True, False], ids=["scales in the product (Hopper)", "scales after it (Ada)"])
def test_an_fp8_layer_multiplies_its_float8_operands_and_stays_within_e4m3s_error_of_the_original(rowwise):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    layer = Fp8Linear.of(linear)
    layer.rowwise = rowwise  # on the CPU torch's _scaled_mm takes both
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (1, 48)
    x = torch.randn(3, 5, 64)
    expected = dequantized_rows(x.reshape(-1, 64)) @ dequantized_rows(linear.weight.detach()).t() + linear.bias
    out = layer(x)
    assert torch.allclose(out, expected.reshape(3, 5, 48), atol=1e-4)
    with torch.no_grad():
        exact = linear(x)
    assert 0 < float((out - exact).norm() / exact.norm()) < 0.05  # e4m3 keeps 3 bits of mantissa


def linears(module) -> int:
    return sum(type(m) is torch.nn.Linear for m in module.modules())


def test_only_the_decoder_layers_linear_layers_take_fp8_weights(tiny_model):
    model = transformers.AutoModelForImageTextToText.from_pretrained(tiny_model("qwen2-vl"), dtype=torch.float32)
    layers = model.get_decoder().layers
    vision, before = linears(model.model.visual), linears(layers)
    ids = torch.tensor([[5, 9, 40, 41, 42, 7]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    assert quantize_language_model(model) == before > 0
    assert linears(layers) == 0 and linears(model.model.visual) == vision and type(model.lm_head) is torch.nn.Linear
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0) > 0.9


def test_fp8_is_refused_off_a_gpu_that_multiplies_float8(tiny_model, monkeypatch):
    settings = Settings(model=str(tiny_model("qwen2-vl")), quantize="fp8", device_map="cpu", allow_any=True)
    with pytest.raises(SettingsError, match="VLM_QUANTIZE=fp8 needs a CUDA GPU"):
        loading.load_model(settings, "fp8")
    monkeypatch.setattr(loading, "_on_cuda", lambda settings: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SettingsError, match=r"compute capability 8.9\+.*A100-SXM4-80GB is 8.0"):
        loading.load_model(settings, "fp8")


def test_the_few_rows_kernel_multiplies_the_float8_weight_as_its_dequantized_product_does():
    """Triton's interpreter runs the kernel on the CPU (tests/support/interpreted_kernel.py), in float32."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("support") / "interpreted_kernel.py"
    done = subprocess.run([sys.executable, str(script), "fp8"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    assert {case["rows"] for case in cases} >= {1, 16, 17, 64} and any(case["N"] >= 128 for case in cases)
    assert {case["splits"] for case in cases} == {1, 2, 3}
    for case in cases:
        assert case["max_abs_diff"] < 1e-3, case


def test_fp8_projections_join_as_bf16s_do_and_the_compiled_step_computes_one_product_a_group(tiny_model):
    model = transformers.AutoModelForImageTextToText.from_pretrained(tiny_model("qwen2-vl"), dtype=torch.float32)
    ids = torch.tensor([[5, 9, 40, 41, 42, 7]])
    quantize_language_model(model)
    with torch.no_grad():
        apart = model(input_ids=ids).logits
    layers = model.get_decoder().layers
    assert share_weights(model) == 2 * len(layers)
    attention = layers[0].self_attn
    q, k = attention.q_proj, attention.k_proj
    assert k.weight.data_ptr() == q.weight.data_ptr() + q.weight.numel()  # rows of one float8 tensor
    assert k.weight_scale.data_ptr() == q.weight_scale.data_ptr() + 4 * q.out_features
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, apart)  # eager code reads the same numbers

    view = model_view(model)
    assert with_shared_products(view) == 2 * len(layers)
    products = []  # FP8 products traced, then kept by the pass
    backend = through_the_pass(products, lambda node: node.target is torch.ops.runpod_vlm.fp8_linear.default)

    hidden = torch.randn(1, 6, model.config.text_config.hidden_size)
    rotary = model.model.language_model.rotary_emb(hidden, torch.arange(6).expand(3, 1, 6))
    with torch.no_grad():
        expected = layers[0](hidden, position_embeddings=rotary)
        got = torch.compile(view.get_decoder().layers[0], backend=backend, fullgraph=True)(
            hidden, position_embeddings=rotary
        )
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    assert products == [(7, 4)]  # q, k, v, o, gate, up, down -> q+k+v, o, gate+up, down
    assert torch.allclose(first(got), first(expected), atol=1e-5)
