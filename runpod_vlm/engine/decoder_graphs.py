"""Which CUDA graphs a paged decoder records, and when: a decode step's per row bucket (before the step that needs it,
or ahead while the engine is idle), a vision pass's and a prefill's per shape met or asked for ahead, all into one
memory pool, none while the background compile holds the GPU."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from runpod_vlm.engine.gpu_errors import is_out_of_memory
from runpod_vlm.engine.prefill_graphs import record, usable

log = logging.getLogger("runpod-vlm")


class StepGraphs:
    """A decoder's recorded graphs and what decides their recording. It records the decoder's steps (`advance`, with
    the rows' state kept and put back around it) and asks its vision and prefill graphs to record theirs; the decoder
    replays them."""

    def __init__(self, decoder, enabled: bool):
        self.decoder = decoder
        self.enabled = enabled  # off for good after 3 failed recordings, and where CUDA graphs cannot run
        self.graphs: dict = {}  # (bucket, span, any sampled row, logprobs, constrained) -> CUDA graph of one step
        self.unrecorded: set = set()  # keys of graphs whose recording ran out of memory: their steps run eagerly
        self.ahead: list = []  # (bucket, sampled) graphs to record while the engine is idle
        self.pool = None  # the memory pool every graph records into, the passes' too (each its own: GBs at 256 rows)
        self.capture_lock: Optional[threading.Lock] = None  # held by the background compile while it runs GPU work
        self.recording_wanted = False  # a step found its graph unrecorded and the compile holding the GPU
        self.failures = 0  # e.g. voided by the background compile's GPU work
        self.capture_s = 0.0  # seconds spent recording (benchmarks)

    def key(self, bucket: int, span: int) -> tuple:
        return bucket, span, *self.decoder.step_flags()

    def before_step(self, bucket: int, span: int):
        """The graph of the step about to run, recorded first if it can be (an eager step takes several replays'
        time); None where it runs eagerly."""
        key = self.key(bucket, span)
        self.recording_wanted = False
        if self.enabled and key not in self.graphs and key not in self.unrecorded and self.decoder.lengths:
            self._capture_or_log(bucket, span)
        return self.graphs.get(key)

    def drop(self, bucket: int) -> None:
        """Forget `bucket`'s graphs (its steps run another forward): they are recorded anew."""
        self.graphs = {key: graph for key, graph in self.graphs.items() if key[0] != bucket}

    def _capture_or_log(self, bucket: int, span: int) -> None:
        started = time.perf_counter()
        try:
            # Not recorded: the compile lets it go first before its next shape (`BackgroundCompiler.holding_the_gpu`).
            self.recording_wanted = not self._capture_unless_compiling(bucket, span)
        except Exception as error:  # still correct without the graph, only slower
            if is_out_of_memory(error):  # not tried again: each try would run out again beside the rows' steps
                self.unrecorded.add(self.key(bucket, span))
                log.warning("a %d-row step's CUDA graph ran out of memory: its steps run eagerly", bucket)
            else:  # tried again at later steps
                self.failures += 1
                log.warning("CUDA graph capture failed (%d of 3 tries)", self.failures, exc_info=True)
                self.enabled = self.failures < 3
        self.capture_s += time.perf_counter() - started

    def ask_ahead(self, bucket: int) -> None:
        """Have `bucket`'s greedy and sampled steps recorded ahead of need (`capture_one_ahead`, while the
        engine is idle), so that no request waits on their capture; only with the decode kernel, whose graphs
        hold rows of any length."""
        if self.enabled and self.decoder.decode_kernel:
            self.ahead.extend((bucket, sample) for sample in (False, True))

    def due(self, ahead: bool = True) -> bool:
        """Whether `capture_one_ahead` has one to record: of a shape a pass met, or (`ahead`) of one asked for ahead
        of need, and the background compile does not hold the GPU (the engine thread would spin; it is woken when a
        shape compiled)."""
        passes = self._pass_graphs()
        wanted = any(graphs.demanded() for graphs in passes) or (
            ahead and (self.ahead or any(graphs.recordable() for graphs in passes))
        )
        compiling = self.capture_lock is not None and self.capture_lock.locked()
        return bool(wanted and self.enabled and not compiling)

    def capture_one_ahead(self, ahead: bool = True) -> None:
        """Record one graph (one at a time: a request that comes meanwhile waits on one capture at most): of a vision
        pass's or a prefill's shape met, else (`ahead`) one `ask_ahead` asked for, else one of a shape asked for
        ahead of need."""
        if not self.due(ahead):
            return
        if not self.ahead or any(graphs.demanded() for graphs in self._pass_graphs()):
            return self.capture_pass()
        bucket, sample = self.ahead.pop(0)
        decoder = self.decoder
        flags = decoder.step_flags()
        decoder.set_step_flags((sample, *[False] * (len(flags) - 1)))  # sampled or greedy rows, nothing more
        try:
            if self.key(bucket, 0) not in self.graphs and not self._capture_unless_compiling(bucket, 0):
                self.ahead.insert(0, (bucket, sample))  # the compile took the GPU meanwhile: later
        except Exception:  # captured again when a step needs it
            log.warning("CUDA graph capture ahead of the %d-row steps failed", bucket, exc_info=True)
        finally:
            decoder.set_step_flags(flags)

    def _pass_graphs(self) -> list:
        """The vision passes' and the prefills' graphs, those the decoder has."""
        decoder = self.decoder
        return [graphs for graphs in (decoder.vision_graphs, decoder.prefill_graphs) if graphs is not None]

    def capture_pass(self) -> None:
        """Record a vision pass's or a prefill's graph of a shape met or asked for ahead, unless the background
        compile holds the GPU (then later: a worker's first request meets the compile, and a burst's shapes asked for
        ahead are recorded once it is done)."""
        passes = [graphs for graphs in self._pass_graphs() if graphs.recordable()]
        graphs = next((graphs for graphs in passes if graphs.demanded()), passes[0])
        try:
            self._unless_compiling(lambda: graphs.capture_one(self.memory()))
        except Exception:  # the pass runs eagerly, as before
            log.warning("CUDA graph capture of a %s failed", graphs.kind, exc_info=True)

    def memory(self):
        """The memory pool every graph records into: they never replay at once. Called before each recording: it
        first gives the caching allocator's free blocks back to the GPU, which a recording cannot do (capped to
        24 GB, a recording ran out of memory beside 1 GB of them)."""
        import torch

        torch.cuda.empty_cache()
        if self.pool is not None and not usable(self.pool.id):
            log.warning("a CUDA graph recording was voided: the next ones record into a memory pool of their own")
            self.pool = None  # its graphs keep their memory
        if self.pool is None:
            # A MemPool, not a bare graph_pool_handle(): it holds the pool open, so that capturing into it
            # after every graph in it was dropped (a bucket switching to the compiled forward) does not
            # trip the allocator's `use_count > 0` assert, as it did on a fresh H200.
            self.pool = torch.cuda.MemPool()
        return self.pool.id

    def _capture_unless_compiling(self, bucket: int, span: int) -> bool:
        """Record a step's graph unless the background compile holds the GPU (tried again at a later step)."""
        return self._unless_compiling(lambda: self._capture(bucket, span))

    def _unless_compiling(self, record) -> bool:
        """Run `record` (a graph's recording) unless the background compile holds the GPU: its synchronizing
        benchmarks void a capture, and the capture its compile. Whether it ran."""
        lock = self.capture_lock
        if lock is not None and not lock.acquire(blocking=False):
            return False
        try:
            record()
        finally:
            if lock is not None:
                lock.release()
        return True

    def _capture(self, bucket: int, span: int) -> None:
        """Record one step as a CUDA graph. The steps run to record it write each row's next slots (written
        again by the real steps before any reads them) or block 0's; what they advance is put back."""
        import torch

        decoder = self.decoder
        decoder.write_table()
        kept = decoder.keep_rows()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    decoder.ring_index.zero_()
                    decoder.advance(bucket, span)
        finally:  # also after a step that failed midway (out of memory): else the rows would go on a step ahead
            torch.cuda.current_stream().wait_stream(stream)
            decoder.put_back(kept)
        decoder.ring_index.zero_()
        graph = torch.cuda.CUDAGraph()
        record(graph, self.memory(), lambda: decoder.advance(bucket, span))
        decoder.put_back(kept)
        self.graphs[self.key(bucket, span)] = graph
