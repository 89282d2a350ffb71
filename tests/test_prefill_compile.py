"""The decoder layers compiled with dynamic shapes for prefills (engine/background_compile.py, engine/compile.py):
traced once on the compile thread for every prompt length, packed prefills and chunks alike, then run by the engine
thread, which never compiles; every answer stays the eager engine's."""

from __future__ import annotations

import asyncio
import collections
import threading

import torch

import handler
from runpod_vlm.engine import compile as compile_module
from runpod_vlm.engine.compile import decoder_layers, run_layers_compiled
from test_compile_cache import compile_in_background
from test_vision_compile import wait_for
from tools.sample_images import data_uri, striped


def vqa(size: tuple, question: str, tokens: int) -> dict:
    image = data_uri(striped(size))
    return {"task": "vqa", "image_url": image, "question": question, "max_new_tokens": tokens, "min_new_tokens": tokens}


JOBS = [
    vqa((64, 48), "What?", 6),
    vqa((96, 64), "What is in the picture, and why is it there?", 10),
    vqa((48, 80), "Say.", 4),
    # Over the token budget below: it enters in chunks while the others decode.
    {
        "messages": [{"role": "user", "content": "Tell me. " + " ".join(f"w{n}" for n in range(90))}],
        "max_new_tokens": 5,
    },
]


def answers(jobs: list) -> list:
    async def together():
        return await asyncio.gather(
            *(handler.local_test_answer({"id": str(n), "input": j}) for n, j in enumerate(jobs))
        )

    return asyncio.run(together())


def served() -> list:
    """The jobs at once (one packed prefill, one prompt in chunks), then the first alone again (its prompt's
    cached blocks read, the rest through the chunk path)."""
    return answers(JOBS) + answers(JOBS[:1])


def test_prefills_run_one_dynamic_trace_of_the_layers_compiled_in_the_background_and_give_the_eager_tokens(
    tiny_model, serve, monkeypatch
):
    engine = serve(tiny_model("qwen2-vl"), VLM_COMPILE="false", VLM_MAX_BATCH_SIZE="8", VLM_MAX_BATCH_TOKENS="256")
    eager = served()
    assert engine.timings["chunk_s"] > 0 and engine.timings["prefix_cached_tokens"] > 0  # both paths were taken
    assert not engine.compiler.compiles_prefill  # on the CPU prefills stay eager
    monkeypatch.setattr(engine.compiler, "compiles_prefill", True)  # as on the GPU
    monkeypatch.setattr(compile_module, "COMPILED_PREFILL_FROM_TOKENS", 0)  # the tiny prompts compiled too
    traces, runs, first_of_prefill = [], collections.Counter(), []

    def backend(graph, example_inputs):  # runs each graph as traced, counting its runs
        number = len(traces)
        traces.append(graph)
        return lambda *args: runs.update([number]) or graph.forward(*args)

    compile_prefill = engine.compiler.compile_prefill_layers
    monkeypatch.setattr(
        engine.compiler,
        "compile_prefill_layers",
        lambda options: first_of_prefill.append(len(traces)) or compile_prefill(options),
    )
    layers = decoder_layers(engine.model)
    try:
        compile_in_background(engine, monkeypatch, [8], backend)
        prefill_graphs = range(first_of_prefill[0], len(traces))
        # Packed prompts and two chunks of another length: one trace, the layer and its attention before and after
        # the paged attention (run eagerly), symbolic in the tokens.
        assert len(prefill_graphs) == 4 and any("mlp" in traces[n].code for n in prefill_graphs)
        engine.wake_up()  # the engine thread switches at its next step (here: at once, being idle)
        assert wait_for(
            lambda: all(getattr(layer.forward, "func", None) is compile_module.compiled_or_eager for layer in layers)
        )
        traced = len(traces)
        assert served() == eager and len(traces) == traced  # other lengths: the same trace, never traced here
        # Every layer of every prefill ran it: the packed one, the long prompt's chunks, the repeat's rest.
        assert all(runs[n] >= 3 * len(layers) for n in prefill_graphs)
        # Fewer tokens than COMPILED_PREFILL_FROM_TOKENS: eager (the host's time is the same either way).
        ran = sum(runs[n] for n in prefill_graphs)
        monkeypatch.setattr(compile_module, "COMPILED_PREFILL_FROM_TOKENS", 10**6)  # more than any prefill here
        run_layers_compiled(layers, {type(layers[0]): layers[0].forward.args[0]})
        assert served() == eager and sum(runs[n] for n in prefill_graphs) == ran
        monkeypatch.setattr(compile_module, "COMPILED_PREFILL_FROM_TOKENS", 0)
        run_layers_compiled(layers, {type(layers[0]): layers[0].forward.args[0]})
        # A call the warm-up did not meet (outside inference mode: dynamo guards on it) runs eagerly, untraced.
        embeds = torch.randn(1, 7, engine.model.config.get_text_config().hidden_size)
        with torch.no_grad():
            compiled = engine.model.get_decoder()(inputs_embeds=embeds).last_hidden_state
        for layer in layers:
            del layer.forward
        with torch.no_grad():
            assert torch.equal(compiled, engine.model.get_decoder()(inputs_embeds=embeds).last_hidden_state)
        assert len(traces) == traced
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)


def test_a_family_that_prefills_padded_keeps_eager_layers(tiny_model, serve, monkeypatch):
    # PaliGemma's prefix attends both ways: its prompts go through the whole model padded, which the packed
    # prefill's trace would not serve.
    engine = serve(tiny_model("paligemma"), VLM_COMPILE="false")
    traces = []
    compile_ = torch.compile
    backend = lambda graph, example_inputs: traces.append(graph) or graph.forward  # noqa: E731
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, **options: compile_(fn, dynamic=dynamic, backend=backend))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    try:
        assert engine.compiler.compile_prefill_layers({}) == {} and traces == []
    finally:
        torch._dynamo.reset()
    assert not any("forward" in vars(layer) for layer in decoder_layers(engine.model))


def test_the_language_models_inputs_are_caught_on_their_own_thread_only(tiny_model, serve, monkeypatch):
    """While the engine thread catches a prompt's inputs at the language model (a hook on the module), the compile
    thread's shadow decoder runs the same module: its forward goes through, as the engine's own does after."""
    engine = serve(tiny_model("qwen2-vl"))
    decoder = engine.start_decoder()
    language_model = engine.model.get_decoder()
    embedding = language_model.get_input_embeddings()
    real = embedding.forward
    other_thread: list = []

    def embed_then_run_the_language_model_elsewhere(ids):
        def run():
            try:
                with torch.inference_mode():
                    other_thread.append(language_model(inputs_embeds=real(ids[:, :4]), use_cache=False))
            except BaseException as error:
                other_thread.append(error)

        if not other_thread:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        return real(ids)

    monkeypatch.setattr(embedding, "forward", embed_then_run_the_language_model_elsewhere)
    item = handler.read_job_item(JOBS[0], engine.settings, engine.model_id, None)[1]
    inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)
    with torch.inference_mode():
        chunked = decoder.prompts.begin_chunks(inputs, 0, item.params)
    assert chunked is not None and chunked.length == inputs["input_ids"].shape[1]
    assert len(other_thread) == 1 and not isinstance(other_thread[0], BaseException), other_thread
