"""A packed vision tower's passes replayed as CUDA graphs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL). Eagerly, one 448x448
image is about 700 kernel launches through Python, ~20 ms of the engine thread for ~3.5 ms of GPU work, and several
times that while other threads take the GIL between launches; compiled, a pass of
many images still costs the host about as much. A graph launches them at once.

A graph has fixed shapes, so a pass is padded: its patches to a multiple of STEP (of LARGE_STEP beyond
`COMPILED_FROM_PATCHES`), the padding one more image (attending only to itself, its features dropped). What the tower
computes from its images' grid with host syncs (where each image starts, each patch's row and column, Qwen2.5-VL's
windows, Qwen3-VL's interpolation) is computed for the padded grid by transformers' own helpers, as its exporters
precompute them, and handed to the tower, so that nothing in the recorded pass reads the grid. The lists of starts
are padded with empty images to a power of two. The first pass of a shape runs padded, eagerly (or compiled), and
asks for its graph, recorded while the engine is idle (`StepGraphs.capture_one_ahead`). Every shape reads its
pixels from one buffer of MOST_PATCHES rows."""

from __future__ import annotations

import collections
import contextlib
import threading
import types
import warnings
import weakref

from runpod_vlm.engine import varlen
from runpod_vlm.engine.compile import COMPILED_FROM_PATCHES
from runpod_vlm.engine.host_copies import copy_into, to_device
from runpod_vlm.engine.prefill_graphs import ShapeGraphs, bucket
from runpod_vlm.engine.vision_attention import NAME

GRAPHED_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # towers whose pass reads the grid only through the helpers
MAX_GRAPHS = 24
HELD_GRIDS = 64  # padded grids whose helpers are kept: 0.3-1.4 ms of host work a pass, the same for same-sized images
# Patches padded to a multiple of STEP (SMALLEST at least): padded to powers of two, three 448x448 images (3,072
# patches) replayed at 4,096 took 24 ms where their eager pass took 19
# (bench/results/vision-graphs-powers-of-two-5d0d981.json).
SMALLEST, STEP, LARGE_STEP = 256, 512, 1024
MOST_PATCHES = 32768  # a step's default budget of 8,192 tokens (prefill_graphs.GRAPH_TOKENS), each of 2x2 patches


def padded_patches(patches: int) -> int:
    step = STEP if patches <= COMPILED_FROM_PATCHES else LARGE_STEP
    return max(SMALLEST, -(-patches // step) * step)


def tower(model):
    """The model's vision tower, if its passes can be recorded (it attends through the packed kernel), else None."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    packed = getattr(getattr(visual, "config", None), "_attn_implementation", None) == NAME
    return visual if packed and model.config.model_type in GRAPHED_TYPES else None


class VisionGraphs(ShapeGraphs):
    """The graphs of one vision tower's padded passes, one per shape; installed as the tower's forward, used on the
    thread inside `engaged()` (the engine's, while it prefills) and eager anywhere else."""

    kind = "vision pass"

    def __init__(self, visual, record: bool = True):
        """`record`: recorded as CUDA graphs (on the GPU); False: every pass runs padded, eagerly (the CPU tests)."""
        with warnings.catch_warnings():  # its import touches torch.jit.script, deprecated in torch 2.14
            warnings.simplefilter("ignore", FutureWarning)
            from transformers.exporters.utils import precompute_export_inputs

        super().__init__()
        self.visual, self.record = visual, record
        self.precompute = precompute_export_inputs
        self.unit = visual.spatial_merge_size**2  # patches merged into one feature
        self.entries: dict = {}  # shape -> its buffers and its pass's output
        self.pixels = None  # every shape's pixels: the first rows of one buffer (made at the first pass)
        self.grids: collections.OrderedDict = collections.OrderedDict()  # (grid, padded) -> helpers, last used last
        self.passes = self.replays = 0  # passes through here, and of them those replayed (benchmarks)
        self._engaged: int | None = None  # the thread whose passes go through here
        visual.forward = _through(weakref.ref(self), visual)

    @contextlib.contextmanager
    def engaged(self):
        """The calling thread's passes through the tower go through here while inside."""
        self._engaged = threading.get_ident()
        try:
            yield
        finally:
            self._engaged = None

    def pass_through(self, hidden_states, grid_thw, **kwargs):
        """The tower's pass: padded and replayed (or run padded, its graph asked for), else its own forward."""
        patches = hidden_states.shape[0]
        plain = kwargs in ({}, {"return_dict": True})  # as Qwen2-VL and Qwen3-VL call it: their output class
        graphable = plain and varlen.takes(hidden_states) and padded_patches(patches) <= MOST_PATCHES
        if not graphable or self._engaged != threading.get_ident() or self.failures >= 3:
            return self._unrecorded(hidden_states, grid_thw, kwargs)
        padded = padded_patches(patches)
        helpers = self._helpers(grid_thw.cpu(), patches, padded)
        shape = (padded, *((name, len(value)) for name, value in helpers.items() if name.startswith("cu_")))
        shape += tuple((name, value) for name, value in helpers.items() if name.startswith("max_"))
        entry = self.entries.get(shape)
        if entry is None:
            if len(self.entries) >= MAX_GRAPHS:
                return self._unrecorded(hidden_states, grid_thw, kwargs)
            entry = self.entries[shape] = self._buffers(hidden_states, helpers, padded)
        self._fill(entry, hidden_states, helpers)
        self.passes += 1
        graph = self.graphs.get(shape)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._forward(shape)
            if self.record and shape not in self.wanted:
                self.wanted.append(shape)
        return _unpadded(entry.output, padded, patches, self.unit)

    def _unrecorded(self, hidden_states, grid_thw, kwargs: dict):
        """The tower's own pass. A grid on the host (the decoder keeps it there) goes in as the helpers computed from
        it, on the tower's device without waiting for the GPU: the tower would read them back from a grid there."""
        if grid_thw is None or grid_thw.device == hidden_states.device:
            return type(self.visual).forward(self.visual, hidden_states, grid_thw, **kwargs)
        return self.through_helpers(hidden_states, grid_thw, kwargs)

    def through_helpers(self, hidden_states, grid_thw, kwargs: dict):
        import torch

        patches = hidden_states.shape[0]
        helpers = self._helpers(grid_thw.cpu(), patches, patches)
        moved = {
            name: to_device(value, hidden_states.device) if torch.is_tensor(value) else value
            for name, value in helpers.items()
        }
        return type(self.visual).forward(self.visual, hidden_states, None, **moved, **kwargs)

    def _helpers(self, grid, patches: int, padded: int) -> dict:
        """What the tower would compute from the padded grid (host tensors and ints, never written): the images',
        then the padding's image of 1 x merge x rest patches; lists of starts padded with empty images to a power of
        two. Kept for the last HELD_GRIDS grids."""
        key = (tuple(grid.flatten().tolist()), padded)
        found = self.grids.get(key)
        if found is None:
            found = self.grids[key] = self.computed_helpers(grid, patches, padded)
            if len(self.grids) > HELD_GRIDS:
                self.grids.popitem(last=False)
        self.grids.move_to_end(key)
        return found

    def computed_helpers(self, grid, patches: int, padded: int) -> dict:
        import torch

        merge = self.visual.spatial_merge_size
        if padded > patches:
            grid = torch.cat([grid, torch.tensor([[1, merge, (padded - patches) // merge]], dtype=grid.dtype)])
        found = {"grid_thw": grid}
        self.precompute(self.visual, found)
        del found["grid_thw"]
        for name, value in found.items():
            if name.startswith("cu_"):
                entries = bucket(len(value), 8)
                found[name] = torch.cat([value, value[-1:].expand(entries - len(value))])
            elif name.startswith("max_") and value is not None:
                found[name] = min(bucket(int(value), 64), padded)  # an upper bound: the kernel takes any
        return found

    def _buffers(self, hidden_states, helpers: dict, padded: int) -> types.SimpleNamespace:
        import torch

        device = hidden_states.device
        if self.pixels is None:
            self.pixels = torch.zeros(
                (MOST_PATCHES, *hidden_states.shape[1:]), dtype=hidden_states.dtype, device=device
            )
        pixels = self.pixels[:padded]
        tensors = {name: to_device(value, device) for name, value in helpers.items() if torch.is_tensor(value)}
        ints = {name: value for name, value in helpers.items() if not torch.is_tensor(value)}
        return types.SimpleNamespace(pixels=pixels, tensors=tensors, ints=ints, output=None)

    def _fill(self, entry, hidden_states, helpers: dict) -> None:
        # The padding's rows keep an earlier pass's pixels: that image attends only to itself, its features dropped.
        entry.pixels[: hidden_states.shape[0]].copy_(hidden_states, non_blocking=True)
        for name, buffer in entry.tensors.items():
            copy_into(buffer, helpers[name])

    def _ready(self, shape: tuple) -> bool:
        return shape in self.entries

    def _forward(self, shape: tuple) -> None:
        """The tower's pass over the shape's buffers; its output (kept in the entry) is read back after each replay."""
        entry = self.entries[shape]
        grid = None  # read only through the helpers, which take them from the kwargs
        entry.output = type(self.visual).forward(self.visual, entry.pixels, grid, **entry.tensors, **entry.ints)


def _through(graphs, visual):
    """The tower's forward: through its graphs while they live. The model does not keep them alive: the decoder owns
    them, and frees them before its graphs' memory pool, as it does its prefill graphs (decoder.py)."""

    def forward(hidden_states, grid_thw, **kwargs):
        live = graphs()
        if live is None:
            return type(visual).forward(visual, hidden_states, grid_thw, **kwargs)
        return live.pass_through(hidden_states, grid_thw, **kwargs)

    return forward


def _unpadded(output, padded: int, patches: int, unit: int):
    """`output` (the tower's, over `padded` patches) for the first `patches`: each tensor by patch or by merged
    feature cut to the images' own, and copied (the next pass overwrites the recorded output)."""
    import torch

    def cut(value):
        if torch.is_tensor(value) and value.ndim and value.shape[0] in (padded, padded // unit):
            return value[: patches if value.shape[0] == padded else patches // unit].clone()
        if isinstance(value, (list, tuple)):
            return type(value)(cut(part) for part in value)
        return value

    return type(output)(**{name: cut(value) for name, value in output.items()})
