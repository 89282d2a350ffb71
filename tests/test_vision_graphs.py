"""The vision tower's small passes as CUDA graphs (engine/vision_graphs.py) on the CPU: the padded pass a graph
records, and its replays from buffers filled anew, give the tower's own features for every packed family, and every
job its solo `generate()` tokens. The attention runs the GPU path's layout through a reference of the varlen kernel;
recording a real graph needs a GPU: here a stand-in replays the padded pass into the recorded output's memory, as a
graph does (bench/gpu_smoke.py checks the GPU's)."""

from __future__ import annotations

import gc
import threading
import types
import weakref

import pytest
import torch

from runpod_vlm.answers import generate_all
from runpod_vlm.engine import varlen
from runpod_vlm.engine import vision_graphs as vision_graphs_module
from runpod_vlm.engine.compile import model_view
from runpod_vlm.engine.vision_graphs import VisionGraphs, padded_patches, tower
from test_paged_engine import items_of, solo_generate
from test_prefill_compile import vqa
from test_prefill_graphs import graphs_on_cpu, varlen_reference, with_graphs  # noqa: F401 (a fixture)
from test_vision_attention import PACKED_FAMILIES, image_features
from test_vision_compile import wait_for
from tools.sample_images import striped


def replayed_in_place(self, shape, pool):
    """A graph's stand-in: each replay runs the padded pass and writes its output where the recorded one is."""
    entry = self.entries[shape]

    def replay():
        recorded = entry.output
        self._forward(shape)
        fresh, entry.output = entry.output, recorded
        for name, value in recorded.items():
            for old, new in zip(*(v if isinstance(v, (list, tuple)) else [v] for v in (value, fresh[name]))):
                old.copy_(new)

    self._forward(shape)
    return types.SimpleNamespace(replay=replay)


@pytest.fixture
def gpu_layout(monkeypatch):
    """The vision attention's GPU path (varlen over the packed images) on the CPU, through the kernel's reference."""
    monkeypatch.setattr(varlen, "takes", lambda query: True)
    monkeypatch.setattr(varlen, "kernel", lambda: varlen_reference)
    monkeypatch.setattr(VisionGraphs, "_record", replayed_in_place)


def graphed(engine) -> VisionGraphs:
    return VisionGraphs(tower(engine.model), record=False)


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_a_padded_pass_gives_the_towers_own_features(tiny_model, serve, gpu_layout, family):
    """Three images of other sizes padded to a graph's size with one more image: the same features (Qwen2.5-VL's
    windows and Qwen3-VL's interpolated positions computed for the padded grid too)."""
    engine = serve(tiny_model(family))
    sizes = [(64, 48), (96, 64), (48, 80)]
    expected = image_features(engine, sizes)
    graphs = graphed(engine)
    with graphs.engaged():
        padded = image_features(engine, sizes)
    assert graphs.passes == 1 and graphs.replays == 0
    ((shape, _),) = graphs.entries.items()
    patches = expected.shape[0] * graphs.unit  # a feature merges `unit` patches
    assert shape[0] == padded_patches(patches) > patches
    assert torch.allclose(padded, expected, atol=1e-5)


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_a_large_pass_pads_to_a_coarser_step_and_one_past_the_most_patches_runs_unrecorded(
    tiny_model, serve, gpu_layout, monkeypatch, family
):
    """Beyond COMPILED_FROM_PATCHES a pass pads to a multiple of LARGE_STEP, its pixels in the shared buffer's first
    rows, and gives the tower's own features (Qwen2.5-VL's windows, Qwen3-VL's positions too); one whose padded
    patches pass MOST_PATCHES is not recorded."""
    engine = serve(tiny_model(family))
    sizes = [(64, 48), (96, 64), (48, 80)]
    expected = image_features(engine, sizes)
    patches = expected.shape[0] * 4  # 2x2 patches a feature
    monkeypatch.setattr(vision_graphs_module, "COMPILED_FROM_PATCHES", 32)
    monkeypatch.setattr(vision_graphs_module, "LARGE_STEP", 40)
    monkeypatch.setattr(vision_graphs_module, "SMALLEST", 8)
    padded = -(-patches // 40) * 40
    assert 32 < patches < padded < vision_graphs_module.STEP
    monkeypatch.setattr(vision_graphs_module, "MOST_PATCHES", padded)
    graphs = graphed(engine)
    with graphs.engaged():
        features = image_features(engine, sizes)
    ((shape, entry),) = graphs.entries.items()
    assert shape[0] == padded and entry.pixels.data_ptr() == graphs.pixels.data_ptr()
    assert torch.allclose(features, expected, atol=1e-5)

    monkeypatch.setattr(vision_graphs_module, "MOST_PATCHES", padded - 40)
    through = []
    monkeypatch.setattr(graphs, "_unrecorded", lambda *args: through.append(1) or graphs.through_helpers(*args))
    with graphs.engaged():
        assert torch.allclose(image_features(engine, sizes), expected, atol=1e-5)
    assert through and graphs.passes == 1


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_a_pass_not_recorded_takes_a_host_grid_through_the_helpers(tiny_model, serve, gpu_layout, family, monkeypatch):
    """On the GPU the decoder keeps the grid on the host, and a pass not recorded (too big, or off the engine thread)
    gets the helpers computed from it: the tower's own features (Qwen2.5-VL's windows, Qwen3-VL's positions too)."""
    engine = serve(tiny_model(family))
    sizes = [(64, 48), (96, 64), (48, 80)]
    expected = image_features(engine, sizes)
    graphs = graphed(engine)
    through = []
    monkeypatch.setattr(graphs, "_unrecorded", lambda *args: through.append(1) or graphs.through_helpers(*args))
    assert torch.allclose(image_features(engine, sizes), expected, atol=1e-5)
    assert through and not graphs.entries  # off the engine thread: nothing padded


def test_replays_refill_the_buffers_and_hand_out_copies(tiny_model, serve, gpu_layout):
    """The same sizes again replay the shape's graph with the new images' pixels, from the grid's helpers kept;
    features handed out earlier are copies, which a later replay leaves as they were."""
    engine = serve(tiny_model("qwen2-vl"))
    sizes = [(64, 48), (96, 64)]
    graphs = VisionGraphs(tower(engine.model))
    first_images = image_features(engine, sizes)
    with graphs.engaged():
        first = image_features(engine, sizes)
        assert graphs.wanted and not graphs.passes - 1
        with torch.inference_mode():  # as the engine thread records
            graphs.capture_one(pool=None)
        assert not graphs.wanted
        other = [striped(size).rotate(180) for size in sizes]
        computed = graphs.computed_helpers
        graphs.computed_helpers = lambda *args: pytest.fail("the grid's helpers computed again")
        second = features_of_images(engine, other)
        third = image_features(engine, sizes)
        graphs.computed_helpers = computed
    assert graphs.replays == 2 and len(graphs.grids) == 1
    expected = features_of_images(engine, other)
    assert not torch.allclose(expected, first_images, atol=1e-3)
    assert torch.allclose(second, expected, atol=1e-5)
    assert torch.allclose(first, first_images, atol=1e-5) and torch.allclose(third, first_images, atol=1e-5)


def features_of_images(engine, images):
    from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn

    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=1)
    item = GenerationRequest("vqa", [Turn("user", [*images, "Describe."])], params)
    inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", engine.dtype)
    with torch.inference_mode():
        features = engine.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return torch.cat(list(features.pooler_output))


def test_passes_on_other_threads_and_the_compiles_view_run_the_towers_own_forward(tiny_model, serve, gpu_layout):
    engine = serve(tiny_model("qwen2-vl"))
    graphs = graphed(engine)
    sizes = [(64, 48)]
    expected = image_features(engine, sizes)
    found: list = []
    with graphs.engaged():
        elsewhere = threading.Thread(target=lambda: found.append(image_features(engine, sizes)))
        elsewhere.start()
        elsewhere.join()
    assert graphs.passes == 0 and torch.equal(found[0], expected)
    view = model_view(engine.model)
    assert "forward" in vars(engine.model.model.visual) and "forward" not in vars(view.model.visual)


@pytest.mark.usefixtures("graphs_on_cpu")  # the decoder's other graphs recorded and replayed on the CPU too
def test_jobs_through_the_engine_get_their_solo_tokens_eagerly_then_replayed(tiny_model, serve, gpu_layout):
    """The decoder's own graphs: the first pass of a shape padded eagerly, its graph recorded while the engine is
    idle, the same jobs again replayed, each job's tokens its solo `generate()`'s every time."""
    engine = serve(tiny_model("qwen2-vl"), VLM_PREFIX_CACHING="false", VLM_IMAGE_CACHE_MB="0")  # every pass encodes
    with_graphs(engine)
    decoder = engine.start_decoder()
    graphs = decoder.vision_graphs = graphed(engine)
    graphs.record = True
    jobs = [vqa((64, 48), "What?", 6), vqa((96, 64), "What is in the picture, and why is it there?", 10)]
    items = items_of(engine, jobs)
    solo = solo_generate(engine, items)
    assert generate_all(engine, items) == solo
    assert graphs.passes >= 1 and graphs.replays == 0
    assert wait_for(lambda: not graphs.wanted and set(graphs.graphs) == set(graphs.entries))
    assert generate_all(engine, items) == solo
    assert graphs.replays >= 1
    assert decoder.pool.free == decoder.pool.capacity


def test_images_encoded_one_at_a_time_each_keep_their_own_features(tiny_model, serve, gpu_layout):
    """Out of memory, a long prompt's images are encoded one by one and joined afterwards: two images of one size
    replay one graph, and the first's features are not the second's (the recorded output is copied out)."""
    engine = serve(tiny_model("qwen2-vl"))
    images = [striped((64, 48)), striped((64, 48)).rotate(180)]
    expected = features_of_images(engine, images)
    graphs = VisionGraphs(tower(engine.model))
    with graphs.engaged():
        features_of_images(engine, images[:1])
        with torch.inference_mode():
            graphs.capture_one(pool=None)
        with engine.adapter.images_one_at_a_time(engine.model):
            one_by_one = features_of_images(engine, images)
    assert graphs.replays == 2
    assert torch.allclose(one_by_one, expected, atol=1e-5)


def test_the_tower_does_not_keep_its_graphs_alive(tiny_model, serve, gpu_layout):
    """The decoder owns its graphs and frees them before its graphs' memory pool: the model does not keep them alive.
    Once they are gone, the tower runs its own forward."""
    engine = serve(tiny_model("qwen2-vl"))
    expected = image_features(engine, [(64, 48)])
    graphs = graphed(engine)
    gone = weakref.ref(graphs)
    del graphs
    gc.collect()
    assert gone() is None
    assert torch.equal(image_features(engine, [(64, 48)]), expected)
