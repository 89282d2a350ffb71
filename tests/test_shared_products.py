"""Projections that read the same input as one product in the compiled decode step (engine/projections.py): their
weights share one tensor, eager answers do not change, and the compiled step's graphs hold one linear product for
a layer's query, key and value and one for its gate and up, with the eager engine's tokens."""

from __future__ import annotations

import pickle

import torch

from runpod_vlm.engine.compile import decoder_layers
from runpod_vlm.engine.projections import one_product_per_input, share_weights
from test_compile_cache import compile_in_background
from test_prefill_compile import JOBS, answers
from test_vision_compile import wait_for

LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}


def through_the_pass(products: list, is_product):
    """A torch.compile backend that runs each graph through `OneProductPerInput`, appending to `products` how many of
    its nodes `is_product` before and after."""

    def backend(graph, example_inputs):
        traced = sum(map(is_product, graph.graph.nodes))
        one_product_per_input()(graph.graph)
        graph.recompile()
        products.append((traced, sum(map(is_product, graph.graph.nodes))))
        return graph.forward

    return backend


def test_a_groups_weights_share_a_tensor_and_the_compiled_step_computes_one_product_a_group(
    tiny_model, serve, monkeypatch
):
    engine = serve(tiny_model("qwen2-vl"), VLM_COMPILE="false", VLM_MAX_BATCH_SIZE="8", VLM_MAX_BATCH_TOKENS="256")
    eager = answers(JOBS)
    layers = decoder_layers(engine.model)
    weights = sum(p.numel() for p in engine.model.parameters())
    assert share_weights(engine.model) == 2 * len(layers)
    attention, mlp = layers[0].self_attn, layers[0].mlp
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # rows of one tensor
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    assert up.data_ptr() == gate.data_ptr() + gate.numel() * gate.element_size()
    assert sum(p.numel() for p in engine.model.parameters()) == weights  # nothing held twice
    assert answers(JOBS) == eager  # eager code reads the same numbers

    products = []  # per graph: linear products traced, then kept by the pass
    compile_in_background(engine, monkeypatch, [8], through_the_pass(products, lambda node: node.target in LINEAR))
    view = engine.compiler.forward.get_decoder().layers[0]
    assert (
        type(view.self_attn.k_proj).__name__ == "SliceOfProduct" and type(view.mlp.up_proj).__name__ == "SliceOfProduct"
    )
    assert attention.k_proj.forward.__self__ is attention.k_proj  # the engine's own model keeps its projections
    # One shape, four graphs around the paged attention: the layer, then its attention with q, k and v; after the
    # attention, o; then the layer's gate, up and down.
    assert sorted(products) == [(0, 0), (1, 1), (3, 1), (3, 2)]
    engine.wake_up()  # the engine thread switches to the compiled step at its next step (here: at once)
    assert wait_for(lambda: engine.decoder is not None and engine.decoder.steps_only_with(engine.compiler.forward))
    assert answers(JOBS) == eager
    assert len(products) == 4  # traced once, on the compile thread


def test_the_graph_pass_pickles_as_inductors_cache_keys_need():
    # torch 2.11 pickles inductor's options, this pass included, into the key of every compiled graph: on the H200
    # a pass of a function's own class failed it ("Can't pickle local object"), and no graph was cached.
    graph_pass = one_product_per_input()
    again = pickle.loads(pickle.dumps(graph_pass))
    assert type(again) is type(graph_pass) and again.uuid() == graph_pass.uuid()
