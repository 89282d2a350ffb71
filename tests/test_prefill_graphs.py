"""Short prefills as CUDA graphs (engine/prefill_graphs.py) on the CPU: the padded forward a graph records, and its
replays from buffers filled anew, give every job its solo `generate()` tokens, new prompts packed and a prompt's
last chunk after its cached prefix alike. Recording a real graph needs a GPU: here a stand-in replays the padded
forward from the same buffers (bench/paged.py checks the GPU's)."""

from __future__ import annotations

import contextlib
import time
import types

import pytest
import torch

from runpod_vlm.answers import generate_all
from runpod_vlm.engine import engine as engine_module
from runpod_vlm.engine import prefill_graphs as prefill_graphs_module
from runpod_vlm.engine import varlen
from runpod_vlm.engine.decoder_graphs import StepGraphs
from runpod_vlm.engine.prefill_graphs import KEY_BUCKETS, PrefillGraphs, bucket, key_bucket
from test_paged_engine import items_of, language_model_inputs, packed_prefill_jobs, solo_generate
from test_prefill_compile import vqa
from test_vision_compile import wait_for


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1), enable_gqa=False):
    """varlen_attn's result, sequence by sequence: with more keys than queries, the queries are its last tokens
    (the causal mask aligned to the keys' end); a query that sees no key gets zeros, as the kernel gives them."""
    output = torch.zeros_like(q)
    for b in range(len(cu_q) - 1):
        q_start, q_end, k_start, k_end = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        queries, keys = q_end - q_start, k_end - k_start
        if queries == 0 or keys == 0:
            continue
        mask = torch.ones(queries, keys, dtype=torch.bool)
        if window_size == (-1, 0):
            mask = torch.arange(keys)[None, :] <= torch.arange(queries)[:, None] + (keys - queries)
        parts = (q[q_start:q_end], k[k_start:k_end], v[k_start:k_end])
        query, key, value = (t.transpose(0, 1) for t in parts)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
        output[q_start:q_end] = torch.where(mask.any(dim=1)[:, None, None], out, 0)
    return output


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The GPU's prefill path on the CPU: varlen through the reference, the decoder using graphs, each recording a
    stand-in whose replay runs the padded forward from the buffers (decode steps stay eager). Returns the shapes
    replayed."""
    replayed: list = []

    def record(self, shape, pool):
        return types.SimpleNamespace(replay=lambda: replayed.append(shape) or self._forward(shape))

    monkeypatch.setattr(varlen, "takes", lambda query: True)
    monkeypatch.setattr(varlen, "kernel", lambda: varlen_reference)
    monkeypatch.setattr(PrefillGraphs, "_record", record)
    monkeypatch.setattr(prefill_graphs_module, "BURST_FROM", 10**9)  # a burst's shapes: seconds each on the CPU
    monkeypatch.setattr(StepGraphs, "_capture", lambda self, bucket, span: None)
    monkeypatch.setattr(StepGraphs, "memory", lambda self: None)
    return replayed


def with_graphs(engine) -> PrefillGraphs:
    decoder = engine.start_decoder()
    decoder.step_graphs.enabled = decoder.prompts.packs = True
    return decoder.prefill_graphs


def test_new_prompts_padded_to_a_graphs_shape_get_their_solo_tokens_run_eagerly_then_replayed(
    tiny_model, serve, monkeypatch, graphs_on_cpu
):
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="1024", VLM_PREFIX_CACHING="false")
    graphs = with_graphs(engine)
    items = items_of(engine, packed_prefill_jobs())
    solo = solo_generate(engine, items)
    tokens = sum(outcome.prompt_tokens for outcome in solo)
    shapes = language_model_inputs(monkeypatch, engine)
    assert generate_all(engine, items) == solo
    padded = bucket(tokens)
    assert tokens < padded and shapes[0][:2] == (1, padded)  # the four prompts and their padding, at once
    shape = (padded, KEY_BUCKETS[0], 8)  # four prompts and the padding's sequence: eight starts' room
    assert wait_for(lambda: shape in graphs.graphs)  # recorded while the engine was idle
    assert graphs_on_cpu == []
    reordered = items_of(engine, packed_prefill_jobs()[::-1])  # the same prompts in another order: the same shape
    assert generate_all(engine, reordered) == solo[::-1]
    assert graphs_on_cpu == [shape]
    decoder = engine.start_decoder()
    assert decoder.pool.free == decoder.pool.capacity


def test_prefills_beyond_the_powers_of_two_pad_to_a_multiple_of_the_step_up_to_the_budget_then_run_unpadded(
    tiny_model, serve, monkeypatch, graphs_on_cpu
):
    """Past POWERS_UP_TO tokens a prefill's graph holds the next multiple of TOKEN_STEP (not the next power of two,
    up to twice the GPU's work); a prefill whose bucket is past the step's token budget runs unpadded."""
    monkeypatch.setattr(prefill_graphs_module, "POWERS_UP_TO", 64)
    monkeypatch.setattr(prefill_graphs_module, "TOKEN_STEP", 40)
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="1024", VLM_PREFIX_CACHING="false")
    graphs = with_graphs(engine)
    items = items_of(engine, packed_prefill_jobs())
    solo = solo_generate(engine, items)
    tokens = sum(outcome.prompt_tokens for outcome in solo)
    padded = -(-tokens // 40) * 40
    assert 64 < tokens < padded <= 1024 and padded != bucket(tokens)
    shapes = language_model_inputs(monkeypatch, engine)
    assert generate_all(engine, items) == solo
    assert shapes[0][:2] == (1, padded)
    assert wait_for(lambda: (padded, KEY_BUCKETS[0], 8) in graphs.graphs)
    assert generate_all(engine, items) == solo and graphs_on_cpu == [(padded, KEY_BUCKETS[0], 8)]

    graphs.most_tokens = padded - 40  # the budget's own bucket below this prefill's
    shapes.clear()
    assert generate_all(engine, items) == solo
    assert shapes[0][:2] == (1, tokens) and len(graphs_on_cpu) == 1

    graphs.most_tokens = 1024
    assert wait_for(lambda: not graphs.wanted)  # the single prompts' shapes asked for ahead, once idle a while
    monkeypatch.setattr(prefill_graphs_module, "MAX_GRAPHS", len(graphs.graphs))
    shapes.clear()  # a shape new when no more graphs may be asked for: unpadded, not padded for nothing
    assert generate_all(engine, items[1:]) == solo[1:]
    assert shapes[0][:2] == (1, tokens - solo[0].prompt_tokens) and not graphs.wanted


def test_a_bursts_shapes_are_recorded_ahead_after_a_pass_over_the_padding_alone(
    tiny_model, serve, monkeypatch, graphs_on_cpu
):
    """The shapes of a burst's groups are asked for with the decoder and recorded after its first prefill (which
    makes their buffers), each after a pass of its own shape that writes only block 0: a cached prompt's blocks (the
    buffers' last prefill) answer as before. A worker idle before its first request keeps them asked for (it dropped
    them once its KV pool was made at boot: 64 mixed jobs 3,926 -> 3,683 tokens/s on the H200, bench/README.md)."""
    monkeypatch.setattr(prefill_graphs_module, "POWERS_UP_TO", 64)
    monkeypatch.setattr(prefill_graphs_module, "TOKEN_STEP", 400)
    monkeypatch.setattr(prefill_graphs_module, "BURST_FROM", 400)
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="1024")
    graphs = with_graphs(engine)
    ahead = [(tokens, key_bucket(tokens), sequences) for tokens in (400, 800, 1200) for sequences in (16, 32)]
    engine.start_thread()
    time.sleep(4 * engine_module.RECORD_AHEAD_AFTER_IDLE_S)
    assert graphs.wanted[5:] == ahead and not graphs.graphs
    items = items_of(engine, [vqa((64, 48), "What is in the picture, and why? Say it in many words.", 8)])
    solo = solo_generate(engine, items)
    warmed: list = []
    real = PrefillGraphs._forward
    monkeypatch.setattr(PrefillGraphs, "_forward", lambda self, shape: warmed.append(shape) or real(self, shape))
    assert generate_all(engine, items) == solo
    assert wait_for(lambda: set(ahead) <= set(graphs.graphs))  # `wanted` empties as the last recording starts
    assert set(ahead) <= set(warmed)
    assert generate_all(engine, items) == solo  # its prompt read back from its cached blocks
    assert engine.timings["prefix_cached_tokens"] > 0


def test_a_shape_met_is_recorded_at_the_first_idle_moment_and_those_asked_for_ahead_after_a_quiet_one(
    tiny_model, serve, monkeypatch, graphs_on_cpu
):
    """A single prompt's graph is recorded as soon as the engine is idle after its first pass, before the shapes asked
    for ahead of need, which wait until the engine has had nothing to do for RECORD_AHEAD_AFTER_IDLE_S: a client
    sending its next request on each answer would meet one of their recordings each time."""
    monkeypatch.setattr(engine_module, "RECORD_AHEAD_AFTER_IDLE_S", 3.0)
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="1024", VLM_PREFIX_CACHING="false")
    graphs = with_graphs(engine)
    items = items_of(engine, [vqa((64, 48), "What?", 2)])
    solo = solo_generate(engine, items)
    assert generate_all(engine, items) == solo
    (met,) = graphs.met
    assert wait_for(lambda: met in graphs.graphs, timeout=2.0)
    time.sleep(0.2)
    assert list(graphs.graphs) == [met] and len(graphs.wanted) == 4  # the other single prompts' shapes wait
    assert wait_for(lambda: not graphs.wanted)
    assert generate_all(engine, items) == solo and graphs_on_cpu == [met]


def test_no_prefill_graph_is_recorded_while_a_shape_compiles_and_the_shapes_asked_for_wait(
    tiny_model, serve, monkeypatch, graphs_on_cpu
):
    """A worker's first request meets the background compile: while it holds the GPU nothing is recorded, and the
    shapes asked for stay wanted (before, they were dropped: a burst's shapes asked for ahead would be lost), the
    engine thread waiting, not spinning, until the compile lets go and wakes it."""
    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_BATCH_TOKENS="1024")  # no burst's shapes: long on the CPU
    graphs = with_graphs(engine)
    wanted = list(graphs.wanted)
    items = items_of(engine, [vqa((64, 48), "What?", 2)])
    tries: list = []
    real = engine.start_decoder().step_graphs.capture_one_ahead
    monkeypatch.setattr(engine.start_decoder().step_graphs, "capture_one_ahead", lambda *a: tries.append(1) or real(*a))
    with engine.compiler.capture_lock:
        assert generate_all(engine, items) == solo_generate(engine, items)
        time.sleep(0.3)
        assert not graphs.graphs and set(wanted) <= set(graphs.wanted) and len(tries) < 5
        engine.start_decoder().step_graphs.capture_pass()  # the compile took the GPU after the engine thread looked
        assert set(wanted) <= set(graphs.wanted)
    engine.wake_up()  # as the compile does when it is done
    assert wait_for(lambda: set(wanted) <= set(graphs.graphs))


def test_a_prompts_last_chunk_after_its_cached_prefix_attends_to_the_prefix_through_the_graphs_path(
    tiny_model, serve, monkeypatch, graphs_on_cpu
):
    """The same prompt again reads its cached blocks and runs only its last tokens, which attend to the cached keys
    too, through the graph of its shape (a single prompt's, recorded after the first prefill). The padding's sequence
    attends to no more keys than it has tokens, not to the rest of the keys' bucket (1,024 here)."""
    engine = serve(tiny_model("qwen2-vl"))
    graphs = with_graphs(engine)
    items = items_of(engine, [vqa((64, 48), "What is in the picture, and why? Say it in many words.", 8)])
    solo = solo_generate(engine, items)
    runs: list = []
    real = PrefillGraphs.run

    paddings: list = []  # (tokens, keys) of the padding's sequence

    def run(self, embeds, positions, slots, key_slots, lengths, key_lengths):
        runs.append((lengths, key_lengths))
        hidden = real(self, embeds, positions, slots, key_slots, lengths, key_lengths)
        query_starts, key_starts = self.buffers.starts[:, 1:3].tolist()  # one sequence, then the padding's
        paddings.append((query_starts[1] - query_starts[0], key_starts[1] - key_starts[0]))
        return hidden

    monkeypatch.setattr(PrefillGraphs, "run", run)
    for _ in range(3):
        assert generate_all(engine, items) == solo
        assert wait_for(lambda: not graphs.wanted)
    prompt = solo[0].prompt_tokens
    (new,), (keys,) = runs[1]
    assert runs[0] == ([prompt], [prompt]) and keys == prompt and 0 < new < prompt  # the second read its prefix
    assert runs[2] == runs[1] and graphs_on_cpu == [(bucket(new), KEY_BUCKETS[0], 2)] * 2
    assert engine.timings["prefix_cached_tokens"] == 2 * (prompt - new)
    assert paddings == [(bucket(prompt) - prompt,) * 2] + [(bucket(new) - new,) * 2] * 2


def test_a_shape_that_cannot_be_recorded_runs_eagerly_and_three_failures_end_the_graphs(
    tiny_model, serve, monkeypatch, graphs_on_cpu, caplog
):
    """Recording fails (a capture error, memory): the prefill still answers, eagerly; after three failures
    prefills stop asking for graphs and run as they did before them."""
    engine = serve(tiny_model("qwen2-vl"), VLM_PREFIX_CACHING="false")
    graphs = with_graphs(engine)

    def record(self, shape, pool):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(PrefillGraphs, "_record", record)
    padded: list = []
    real = PrefillGraphs._forward
    monkeypatch.setattr(PrefillGraphs, "_forward", lambda self, shape: padded.append(shape) or real(self, shape))
    jobs = [dict(job, max_new_tokens=4, min_new_tokens=4) for job in packed_prefill_jobs()[1:3]]
    items = items_of(engine, jobs)
    solo = solo_generate(engine, items)
    assert generate_all(engine, items[:1]) == solo[:1]
    assert wait_for(lambda: graphs.failures == 3)  # the shapes asked for at the first prefill
    assert "CUDA graph capture of a prefill failed" in caplog.text
    before = len(padded)
    assert generate_all(engine, items) == solo
    assert len(padded) == before and not graphs.graphs  # the prefills ran the unpadded path


class AllocatorStandIn:
    """PyTorch 2.11's allocators as a recording sees them (read in its CUDAGraph.cpp and CachingHostAllocator.h, seen
    on the H200): capture_begin has the GPU's and the page-locked allocator each take the pool for the graph, and only
    a capture_end that succeeds gives both back; Python can end only the GPU's (`_cuda_endAllocateToPool`). A pool
    still taken by either refuses the next capture_begin, and their entries hold the graph."""

    def __init__(self):
        self.taken: dict = {}  # pool -> the graph recording into it, the GPU's caching allocator
        self.taken_page_locked: dict = {}  # the same, the page-locked host allocator
        self.fail_begin = False

    def graph_class(self):
        allocator = self

        class CUDAGraph:
            def __init__(self):
                self.pool, self.voided, self.captured = None, False, False

            def capture_begin(self, pool, capture_error_mode="global"):
                for taken in (allocator.taken, allocator.taken_page_locked):
                    if pool in taken:
                        raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                    taken[pool] = self
                self.pool = pool
                if allocator.fail_begin:  # as cudaStreamBeginCapture failing after the pool was taken
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

            def capture_end(self):
                if self.voided:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                del allocator.taken[self.pool], allocator.taken_page_locked[self.pool]
                self.captured = True

        return CUDAGraph

    def end_allocate_to_pool(self, device, pool):
        if pool not in self.taken:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        del self.taken[pool]


def test_a_voided_recording_keeps_its_graph_and_the_next_recordings_go_to_a_new_pool(monkeypatch):
    """On the H200 a recording voided by a synchronize left its pool taken: every later recording into the shared
    pool failed, and the process died of a segmentation fault soon after (likely the allocators' filters, which
    point at the dropped graph)."""
    import gc
    import weakref

    allocator = AllocatorStandIn()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", allocator.graph_class())
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "capture stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    pools = iter(range(1, 100))
    monkeypatch.setattr(torch.cuda, "MemPool", lambda: types.SimpleNamespace(id=(next(pools), 0)))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", allocator.end_allocate_to_pool)
    monkeypatch.setattr(prefill_graphs_module, "_capture_stream", None)
    monkeypatch.setattr(prefill_graphs_module, "voided_recordings", [])
    monkeypatch.setattr(prefill_graphs_module, "_stuck_pools", set())
    step_graphs = types.SimpleNamespace(pool=None)  # the memory pool every graph records into
    pool = StepGraphs.memory(step_graphs)
    graph = torch.cuda.CUDAGraph()
    prefill_graphs_module.record(graph, pool, lambda: None)
    assert graph.captured and StepGraphs.memory(step_graphs) == pool  # recorded: the same pool next
    graphs = [torch.cuda.CUDAGraph()]
    with pytest.raises(RuntimeError, match="previous error during capture"):
        prefill_graphs_module.record(graphs[0], pool, lambda: setattr(graphs[0], "voided", True))
    kept = weakref.ref(graphs.pop())
    gc.collect()
    assert kept() is not None and not allocator.taken  # the graph kept; the GPU's allocator has its pool back
    with pytest.raises(RuntimeError, match="already recording"):  # the page-locked allocator's is taken for good
        prefill_graphs_module.record(torch.cuda.CUDAGraph(), pool, lambda: None)
    assert not allocator.taken  # (here the GPU's allocator takes it first): it holds no pool afterwards
    new_pool = StepGraphs.memory(step_graphs)
    assert new_pool != pool
    graph = torch.cuda.CUDAGraph()
    prefill_graphs_module.record(graph, new_pool, lambda: None)
    assert graph.captured and StepGraphs.memory(step_graphs) == new_pool
    allocator.fail_begin = True  # a capture_begin that fails after taking the pool: the same
    with pytest.raises(RuntimeError, match="stream is capturing"):
        prefill_graphs_module.record(torch.cuda.CUDAGraph(), new_pool, lambda: None)
    assert not allocator.taken and len(prefill_graphs_module.voided_recordings) == 3
    assert StepGraphs.memory(step_graphs) not in (pool, new_pool)
    allocator.fail_begin = False

    def fails(message: str):
        raise torch.OutOfMemoryError(message)

    pool = StepGraphs.memory(step_graphs)
    with pytest.raises(torch.OutOfMemoryError):  # a recording that failed but ended: nothing to give back or keep
        prefill_graphs_module.record(torch.cuda.CUDAGraph(), pool, lambda: fails("a stand-in"))
    assert not allocator.taken and len(prefill_graphs_module.voided_recordings) == 3
    assert StepGraphs.memory(step_graphs) == pool
