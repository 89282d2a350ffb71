"""Prefills replayed as CUDA graphs: new prompts packed together, or a prompt's last chunk after its cached prefix,
of up to `GRAPH_TOKENS` tokens (the step's default token budget). Run eagerly, a prefill costs the host 25-32 ms
whatever its size up to 4,000 tokens (the decoder's kernels launched one by one through Python, or a compiled layer's
four graphs: bench/results/profile-prefill-layers-a387304.json), and two to three times that in a burst, where the
reading and intake threads take the GIL between its launches; a graph launches them all at once.

A graph has fixed shapes, so a prefill is padded to buckets: its tokens to a power of two up to `POWERS_UP_TO`, to a
multiple of `TOKEN_STEP` beyond (the padding one more sequence, whose keys and values go to block 0, never handed out;
it attends to as many keys as it has tokens), the keys it reads back from the pool to one of `KEY_BUCKETS`, its
sequences' starts to a power of two (zero-length ones at the end). The first prefill of a shape runs the same padded
forward eagerly and asks for its graph, which the decoder records while the engine is idle
(`StepGraphs.capture_one_ahead`); a single prompt's shapes of up to 1,024 keys are asked for at the first prefill. All
graphs share one memory pool: it holds the largest one's work memory, which the KV pool's sizing sets aside
(`memory.measured_work_memory`)."""

from __future__ import annotations

import logging
import types

from runpod_vlm.engine.paged_attention import PagedStep

GRAPH_TOKENS = 8192  # settings.max_batch_tokens' default; from 3,072 tokens the recorded layers are the compiled ones
POWERS_UP_TO, TOKEN_STEP = 2048, 1024  # beyond 2,048 tokens a power of two would pad up to twice the GPU's work
# Few, so that a chat's turns share their graphs: reading back a whole bucket of slots (block 0's past the keys) costs
# little beside the layers (16,384 slots: 16 MB a layer at the 2B's shapes).
KEY_BUCKETS = (1024, 4096, 16384)  # a longer cached prefix's last chunk runs eagerly
MAX_GRAPHS = 48  # shapes recorded at most; others run unpadded
# Groups of new prompts as a burst brings them (3,072 tokens up to the budget; 8 to 31 prompts) are asked for at the
# first prefill too: a worker started by load meets a burst at once, and a shape's first pass runs padded, eagerly.
BURST_FROM, BURST_SEQUENCES = 3072, (16, 32)
SMALLEST = 64


log = logging.getLogger("runpod-vlm")

_capture_stream = None  # the one side stream every graph is recorded on, as torch.cuda.graph keeps one
# Graphs whose recording failed: PyTorch's allocators still hold filters that point at them.
voided_recordings: list = []
_stuck_pools: set = set()  # pools a voided recording left taken by the page-locked allocator


def record(graph, pool, forward) -> None:
    """Record `forward` into `graph`, its memory from `pool` (a pool id, not None): torch.cuda.graph's steps but for
    its release of the page-locked host cache (`torch._C._host_emptyCache`), after which the next copies to the GPU
    each allocate anew (2.3 ms each). The caller gives the GPU's free blocks back
    first (`StepGraphs.memory`).

    A voided capture (a synchronize during it, say) makes `capture_end` raise before it tells the allocators that the
    capture is over, which PyTorch 2.11 does not undo: the pool stays taken, so every later recording into it fails
    ("already recording to mempool_id", on the H200), and the allocators keep a filter that points at the graph,
    freed with it. Here the graph is kept, and the pool given back to the GPU's caching allocator; the page-locked
    allocator's hold on it has no Python binding to end it, so the pool is left for good (`usable`). So too where
    `capture_begin` failed after taking the pool."""
    import contextlib

    import torch

    global _capture_stream
    if _capture_stream is None:
        _capture_stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # no work of another stream still running into the capture
    ended = False
    with torch.cuda.stream(_capture_stream):
        try:
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                forward()
            finally:
                graph.capture_end()
                ended = True
        except Exception:
            if not ended:
                voided_recordings.append(graph)
                _stuck_pools.add(pool)
                with contextlib.suppress(RuntimeError):  # failed before taking the pool, or after giving it back
                    torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
            raise


def usable(pool) -> bool:
    """Whether graphs can still be recorded into `pool`: no recording into it was voided (`record`)."""
    return pool not in _stuck_pools


def bucket(count: int, smallest: int = SMALLEST) -> int:
    """The power of two (at least `smallest`) that holds `count`."""
    size = smallest
    while size < count:
        size *= 2
    return size


def token_bucket(tokens: int) -> int:
    """The tokens of the graph that holds a prefill of `tokens`."""
    return bucket(tokens) if tokens <= POWERS_UP_TO else -(-tokens // TOKEN_STEP) * TOKEN_STEP


def key_bucket(keys: int) -> int:
    return next((size for size in KEY_BUCKETS if size >= keys), keys)


def _starts(lengths: list[int], padded: int, entries: int) -> list[int]:
    """Where each sequence starts, then the padding's sequence (to `padded`), then empty ones: `entries` in all."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return starts + [padded] * (entries - len(starts))


class ShapeGraphs:
    """CUDA graphs of a padded pass, one per shape met: each shape's first pass runs eagerly (`_forward`) and asks for
    its graph, recorded later while the engine is idle (`capture_one`); after three failed recordings none is asked
    for again, and passes run as they did before graphs."""

    kind = "pass"

    def __init__(self):
        self.graphs: dict = {}
        self.wanted: list = []  # shapes to record
        self.failures, self.capture_s = 0, 0.0  # recording seconds (benchmarks)

    def _forward(self, shape: tuple) -> None:
        raise NotImplementedError

    def _ready(self, shape: tuple) -> bool:
        """Whether a pass of `shape` ran (its buffers exist)."""
        raise NotImplementedError

    def _warm_up(self, shape: tuple) -> None:
        """Before recording `shape`: a pass of it, if none ran (a shape asked for ahead)."""

    def demanded(self) -> list:
        """The wanted shapes a pass met (every one here), whose graphs pay at the next pass of that shape, against
        those asked for ahead of need."""
        return list(self.wanted)

    def recordable(self) -> list:
        """The wanted shapes that can be recorded now: a prefill's asked for ahead wait for its buffers, which the
        first prefill makes."""
        return [shape for shape in self.wanted if self._ready(shape)]

    def capture_one(self, pool) -> None:
        """Record a wanted shape's graph into the memory `pool`: the first one met, else the first recordable one."""
        import time

        shape = (self.demanded() or self.recordable())[0]
        self.wanted.remove(shape)
        if shape in self.graphs:
            return
        started = time.perf_counter()
        try:
            self._warm_up(shape)
            self.graphs[shape] = self._record(shape, pool)
        except Exception:
            self.failures += 1
            if self.failures == 3:
                self.wanted.clear()
            raise
        finally:
            seconds = time.perf_counter() - started
            self.capture_s += seconds
            log.debug("recording the %s graph of shape %s took %.0f ms", self.kind, shape, 1000 * seconds)

    def _record(self, shape: tuple, pool):
        """No warm-up runs: each would cost the engine as much as the recording (the host's time), and the kernels
        are loaded (the shape's eager pass ran before its graph was asked for, or `_warm_up`'s)."""
        import torch

        graph = torch.cuda.CUDAGraph()
        record(graph, pool, lambda: self._forward(shape))
        return graph


class PrefillGraphs(ShapeGraphs):
    """The graphs of one decoder's short prefills, one per (tokens, keys, sequences) bucket, over shared buffers."""

    kind = "prefill"

    def __init__(self, decoder, rows: int, tokens: int = GRAPH_TOKENS):
        """`tokens`: the most a recorded prefill takes (the step's token budget, GRAPH_TOKENS at most)."""
        super().__init__()
        self.decoder = decoder  # the PagedDecoder whose pool and language model the prefills run
        self.most_tokens = token_bucket(min(tokens, GRAPH_TOKENS))
        self.sequences = bucket(rows + 1, 2)  # the most starts a prefill takes, its padding's included
        # a single prompt's shapes of 64 to 1,024 tokens and up to 1,024 keys, a burst's, then those met
        self.wanted = [(SMALLEST * 2**n, KEY_BUCKETS[0], 2) for n in range(5)]
        self.wanted += [
            (size, key_bucket(size), sequences)
            for size in range(BURST_FROM, self.most_tokens + 1, TOKEN_STEP)
            for sequences in BURST_SEQUENCES
            if sequences <= self.sequences
        ]
        self.met: set = set()  # shapes whose pass ran (their kernels loaded)
        self.buffers = None

    def demanded(self) -> list:
        return [shape for shape in self.wanted if shape in self.met]

    def shape(self, tokens: int, keys: int, sequences: int) -> tuple:
        """The graph's shape that holds a prefill of `tokens` new tokens reading `keys` keys, of `sequences`."""
        return token_bucket(tokens), key_bucket(keys), bucket(sequences + 1, 2)

    def fits(self, tokens: int, keys: int, sequences: int) -> bool:
        """Whether a prefill of this size has its graph, or may ask for one (others run unpadded)."""
        shape = self.shape(tokens, keys, sequences)
        known = shape in self.graphs or shape in self.wanted or len(self.graphs) + len(self.wanted) < MAX_GRAPHS
        return (
            self.failures < 3
            and shape[0] <= self.most_tokens
            and keys <= KEY_BUCKETS[-1]
            and sequences < self.sequences
            and known
        )

    def run(self, embeds, positions, slots, key_slots, lengths: list[int], key_lengths: list[int]):
        """The language model's last hidden states [1, tokens, hidden] for `embeds` [1, tokens, hidden] at
        `positions` [..., 1, tokens]: sequences of `lengths` tokens packed, their keys and values written at
        `slots`; each attends causally to its `key_lengths` keys, read back at `key_slots` (its cached prefix, then
        its new tokens)."""

        tokens = len(slots)
        shape = self.shape(tokens, len(key_slots), len(lengths))
        padded_tokens, padded_keys, sequences = shape
        held = self._buffers(embeds, positions)
        held.embeds[0, :tokens].copy_(embeds[0])
        held.embeds[0, tokens:padded_tokens].zero_()
        held.positions[..., :tokens].copy_(positions)
        held.positions[..., tokens:padded_tokens].zero_()
        self.fill(shape, slots, key_slots, lengths, key_lengths)
        graph = self.graphs.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self._forward(shape)
            self.met.add(shape)
            if shape not in self.wanted:
                self.wanted.append(shape)
        return held.hidden[:, :tokens]

    def _warm_up(self, shape: tuple) -> None:
        """A pass of a shape asked for ahead, before its recording loads its kernels: over the padding alone (one
        sequence of every token, reading and writing block 0's first slot, never handed out), not over the buffers'
        last prefill, whose slots are a live row's or a cached prefix's."""
        import torch

        if shape in self.met:
            return
        held = self.buffers
        self.fill(shape, held.slots[:0], held.key_slots[:0], [], [])
        self._forward(shape)
        self.met.add(shape)
        if held.slots.is_cuda:  # its work memory back to the GPU, as before any recording (`StepGraphs.memory`)
            torch.cuda.empty_cache()

    def fill(self, shape: tuple, slots, key_slots, lengths: list[int], key_lengths: list[int]) -> None:
        """The buffers' slots and starts for a prefill of `shape`: its sequences', then the padding's (one more
        sequence, whose keys and values go to block 0)."""
        import torch

        padded_tokens, padded_keys, sequences = shape
        held = self.buffers
        for buffer, value, padded in ((held.slots, slots, padded_tokens), (held.key_slots, key_slots, padded_keys)):
            buffer[: len(value)].copy_(value)
            buffer[len(value) : padded].zero_()
        # Not the rest of the keys' bucket: FlashAttention walks a sequence's keys in one loop per block of its
        # queries, and the padding's loop over thousands was the attention's slowest (bench/prefill_attention.py).
        padding = min(padded_tokens - len(slots), padded_keys - len(key_slots))
        starts = [
            _starts(lengths, padded_tokens, sequences + 1),
            _starts(key_lengths, len(key_slots) + padding, sequences + 1),
        ]
        held.starts[:, : sequences + 1].copy_(torch.tensor(starts, dtype=torch.int32), non_blocking=True)

    def _buffers(self, embeds, positions) -> types.SimpleNamespace:
        import torch

        if self.buffers is None:
            device, hidden = embeds.device, embeds.shape[-1]
            zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
            self.buffers = types.SimpleNamespace(
                embeds=zeros(1, self.most_tokens, hidden, dtype=embeds.dtype),
                positions=zeros(*positions.shape[:-1], self.most_tokens, dtype=positions.dtype),
                slots=zeros(self.most_tokens),
                key_slots=zeros(KEY_BUCKETS[-1]),
                starts=zeros(2, self.sequences + 1, dtype=torch.int32),  # the queries', then the keys'
                hidden=zeros(1, self.most_tokens, hidden, dtype=embeds.dtype),
            )
        return self.buffers

    def _forward(self, shape: tuple) -> None:
        """The padded prefill of `shape` from the buffers, its hidden states into `buffers.hidden`."""
        tokens, keys, sequences = shape
        held, decoder = self.buffers, self.decoder
        step = PagedStep(
            decoder.keys,
            decoder.values,
            held.slots[:tokens],
            starts=held.starts[0, : sequences + 1],
            longest=tokens,
            key_slots=held.key_slots[:keys],
            key_starts=held.starts[1, : sequences + 1],
            longest_keys=keys,
        )
        hidden = decoder.prompts.through_language_model(step, held.embeds[:, :tokens], held.positions[..., :tokens])
        held.hidden[:, :tokens].copy_(hidden)

    def _ready(self, shape: tuple) -> bool:
        return self.buffers is not None
