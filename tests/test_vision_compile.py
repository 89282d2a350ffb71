"""A packed vision tower's blocks compiled (engine/compile.py, engine/background_compile.py): one trace for every
block, traced on the compile thread for one image and for several, then run by the engine thread without ever
compiling there; the features are the eager tower's."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import handler
from runpod_vlm.engine import compile as compile_module
from runpod_vlm.engine import varlen
from runpod_vlm.engine.compile import dynamic_forwards, run_blocks_compiled, vision_blocks
from test_compile_cache import compile_in_background
from test_vision_attention import image_features
from tools.sample_images import data_uri, striped


def block_diagonal_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1), enable_gqa=False):
    """varlen_attn's result on [tokens, heads, dim] with tensor ops only, so dynamo traces each block whole on
    the CPU as it does the GPU's kernel (the tower's own CPU path splits by `.tolist()`); causal with the
    window (-1, 0), as a prefill's prompts take it."""
    positions = torch.arange(q.shape[0])
    image = torch.searchsorted(cu_q[1:], positions, right=True)
    mask = image[:, None] == image[None, :]
    if window_size == (-1, 0):
        mask &= positions[None, :] <= positions[:, None]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    output = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return output.transpose(0, 1)


@pytest.fixture
def traces(monkeypatch):
    """The graphs dynamo hands its backend (which runs them as traced: features stay exact)."""
    graphs = []
    compile_ = torch.compile
    backend = lambda graph, example_inputs: graphs.append(graph) or graph.forward  # noqa: E731
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, **options: compile_(fn, dynamic=dynamic, backend=backend))
    monkeypatch.setattr(varlen, "takes", lambda query: True)
    monkeypatch.setattr(varlen, "kernel", lambda: block_diagonal_varlen)
    yield graphs
    torch._dynamo.reset()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


ONE, TWO, THREE = [(64, 48)], [(96, 64), (48, 80)], [(80, 64), (64, 64), (48, 96)]


def test_every_block_and_image_set_runs_the_one_trace_and_the_engine_thread_never_traces(
    tiny_model, serve, traces, monkeypatch
):
    monkeypatch.setattr(compile_module, "COMPILED_FROM_PATCHES", 0)  # the tiny images' few patches compiled too
    engine = serve(tiny_model("qwen2-vl"))
    eager = {len(sizes): image_features(engine, sizes) for sizes in (ONE, TWO, THREE)}
    blocks = vision_blocks(engine.model)
    assert len(blocks) == engine.model.config.vision_config.depth >= 2
    forwards = dynamic_forwards(blocks)
    try:
        run_blocks_compiled(blocks, forwards, recompile=True)  # the compile thread's warm-up
        assert torch.equal(image_features(engine, TWO), eager[2])
        assert len(traces) == 1  # every block ran the first block's trace
        for sizes in (THREE, ONE):  # other counts and sizes: symbolic, the same trace
            assert torch.equal(image_features(engine, sizes), eager[len(sizes)]) and len(traces) == 1
        run_blocks_compiled(blocks, forwards)  # as the engine thread runs them
        # A call the warm-up did not meet (here outside inference mode: dynamo guards on it) runs eagerly.
        assert torch.equal(image_features(engine, TWO, torch.no_grad), eager[2]) and len(traces) == 1
        assert torch.equal(image_features(engine, THREE), eager[3]) and len(traces) == 1
        calls = []
        counted = {kind: lambda *a, _f=f, **k: calls.append(1) or _f(*a, **k) for kind, f in forwards.items()}
        run_blocks_compiled(blocks, counted)
        assert torch.equal(image_features(engine, TWO), eager[2]) and len(calls) == len(blocks)
        patches = sum(w * h for w, h in TWO) // engine.model.config.vision_config.patch_size**2
        monkeypatch.setattr(compile_module, "COMPILED_FROM_PATCHES", patches + 1)  # fewer patches: eager
        run_blocks_compiled(blocks, counted)
        assert torch.equal(image_features(engine, TWO), eager[2]) and len(calls) == len(blocks)
    finally:
        for block in blocks:
            del block.forward


def test_the_background_compile_compiles_the_vision_blocks_and_the_engine_switches_to_them(
    tiny_model, serve, traces, monkeypatch
):
    engine = serve(tiny_model("qwen2-vl"), VLM_COMPILE="false", VLM_MAX_BATCH_SIZE="8")
    jobs = [
        {"task": "vqa", "image_url": data_uri(striped(size)), "question": "What?", "max_new_tokens": 6}
        for size in ((64, 48), (96, 64), (48, 80))
    ]

    async def answers():
        return await asyncio.gather(*(handler.local_test_answer({"id": "j", "input": job}) for job in jobs))

    eager = asyncio.run(answers())
    assert not engine.compiler.compiles_vision  # on the CPU the tower attends per image: left eager
    monkeypatch.setattr(engine.compiler, "compiles_vision", True)  # as on the GPU
    blocks = vision_blocks(engine.model)
    try:
        compile_in_background(engine, monkeypatch, [8], lambda graph, inputs: traces.append(graph) or graph.forward)
        assert engine.view().compiled_row_buckets == (8,) and any(
            "qkv" in graph.code for graph in traces
        )  # a vision block
        warmed = len(traces)
        engine.wake_up()  # the engine thread switches to both at its next step (here: at once, being idle)
        assert wait_for(
            lambda: all(getattr(b.forward, "func", None) is compile_module.compiled_or_eager for b in blocks)
        )
        assert asyncio.run(answers()) == eager and len(traces) == warmed
    finally:
        for block in blocks:
            vars(block).pop("forward", None)
