"""Where a concurrent run's time goes (GPU): the engine thread's spans (admission, placement, prefill, decode
steps, handing out tokens), the intake's and the reading's, and how busy the GPU was.

    python -m bench.timeline --out OUT [--runs uniform,mixed,images] [--variants switch_0.1ms,...]

Random weights at Qwen2-VL-2B shapes, DEFAULT settings, jobs on the handler's path as in bench/paged.py:
`uniform` 64 x 448x448 x 128 tokens, `mixed` 64 mixed jobs, `images` 64 one-token jobs of a new 448x448
image. Each is run on new images: first and again with spans only (timeline.json); with each of VARIANTS (Python's
GIL switch interval at 0.1 ms, one or four intake threads, the jobs read beforehand, two jobs' images read at a
time, the pixels page-locked by the engine thread; `syncs`: each operation of the engine thread that waited for the
GPU, counted by its stack); the prefill's and the vision tower's graphs recorded; the uniform
run under torch.profiler (the GPU's busy time; its trace as timeline-uniform-trace.json.gz); and with the engine
loop under cProfile (timeline-RUN-python.txt; on Python 3.12 it sees every thread while enabled).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import json
import os
import sys
import threading
import time
from pathlib import Path

from bench.paged import vqa
from bench.workload import (
    bench_parser,
    concurrent,
    data_uri,
    gpu_parity,
    mixed_jobs,
    python_profile,
    wait_for_recordings,
)

ROOT = Path(__file__).resolve().parent.parent

RUNNER_TOP = ("_admit", "_prefill_next_chunk", "_decode_interval")  # what one engine-loop turn does


async def submitted(engine, items: list) -> dict:
    """Items already read, submitted at once (no reading threads beside the engine)."""
    from runpod_vlm.answers import stream_generation

    async def one(item):
        return [event async for event in stream_generation(engine, item)][-1]

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(item) for item in items))
    seconds = time.perf_counter() - started
    tokens = sum(outcome.completion_tokens for outcome in outcomes)
    return {"jobs": len(items), "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


@contextlib.contextmanager
def switch_interval(engine, seconds: float = 0.0001):
    kept = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield None
    finally:
        sys.setswitchinterval(kept)


@contextlib.contextmanager
def intake_threads(engine, count: int):
    pool = engine.intake().pool
    kept, pool._max_workers = pool._max_workers, count
    try:
        yield None
    finally:
        pool._max_workers = kept


@contextlib.contextmanager
def read_first(engine):
    yield submitted


@contextlib.contextmanager
def images_read_two_at_a_time(engine):
    """At most two jobs' images fetched and decoded at once (the handler's other reading threads wait, off the GIL)."""
    import handler

    real, gate = handler.read_images, threading.BoundedSemaphore(2)

    def gated(*args, **kwargs):
        with gate:
            return real(*args, **kwargs)

    handler.read_images = gated
    try:
        yield None
    finally:
        handler.read_images = real


SYNCS: collections.Counter = collections.Counter()  # the engine thread's stacks at each operation that waited


@contextlib.contextmanager
def syncs(engine):
    """Every operation that waits for the GPU (torch's sync debug mode), counted by the engine thread's stack."""
    import traceback
    import warnings

    import torch

    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        if threading.current_thread().name == "vlm-engine":
            stack = traceback.extract_stack()[:-1]
            frames = [f for f in stack if "runpod_vlm" in f.filename or "models/" in f.filename]
            SYNCS[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))] += 1

    SYNCS.clear()
    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*synchroniz.*")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield None
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown


@contextlib.contextmanager
def pinned_by_engine(engine):
    """The pixels page-locked by the engine thread as it moves them, not by the intake threads."""
    intake = engine.intake()
    kept, intake.pin = intake.pin, False
    try:
        yield None
    finally:
        intake.pin = kept


VARIANTS = {  # mode -> what it changes, as a context giving None (jobs on the handler's path) or a submitter of items
    "switch_0.1ms": switch_interval,
    "intake_1": lambda engine: intake_threads(engine, 1),
    "intake_4": lambda engine: intake_threads(engine, 4),
    "read_first": read_first,
    "reads_2": images_read_two_at_a_time,
    "syncs": syncs,
    "pinned_by_engine": pinned_by_engine,
}


class Spans:
    """Named spans of wrapped functions, per thread."""

    def __init__(self):
        self.marks: list[tuple] = []  # (name, thread, start, end)
        self._undo: list = []

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        real, label = getattr(owner, name), label or name

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.marks.append((label, threading.current_thread().name, start, time.perf_counter()))

        had_own = isinstance(owner, type) or name in vars(owner)  # else an instance's attribute hides its class's
        setattr(owner, name, wrapper)
        self._undo.append((owner, name, real, had_own))

    def unwrap(self) -> None:
        for owner, name, real, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, name, real)
            else:
                delattr(owner, name)
        self._undo.clear()

    def summary(self, started: float, ended: float) -> dict:
        totals: dict = collections.defaultdict(lambda: [0, 0.0])
        for name, thread, start, end in self.marks:
            key = f"{thread.split('_')[0]}:{name}"
            totals[key][0] += 1
            totals[key][1] += end - start
        engine = sorted((m for m in self.marks if m[0] in RUNNER_TOP), key=lambda m: m[2])
        busy = sum(m[3] - m[2] for m in engine)
        return {
            "seconds": ended - started,
            "spans": {k: {"count": c, "s": round(s, 4)} for k, (c, s) in sorted(totals.items())},
            "engine_turns_s": round(busy, 4),
            "engine_outside_turns_s": round(ended - started - busy, 4),
            "engine_timeline": [[round(m[2] - started, 4), round(m[3] - m[2], 4), m[0]] for m in engine[:400]],
        }


def gpu_busy(prof) -> dict:
    """The GPU's busy time (the union of its kernels and copies) against the span from its first to its last."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    busy, end = 0.0, None
    for start, stop in kernels:
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    if not kernels:
        return {"kernels": 0}
    return {"kernels": len(kernels), "first_to_last_s": (end - kernels[0][0]) / 1e6, "busy_s": busy / 1e6}


@contextlib.contextmanager
def captures_held(engine, held: bool):
    """The engine records no graph ahead (while idle) inside the block."""
    graphs = engine.start_decoder().step_graphs
    if held:
        graphs.due = lambda ahead=True: False
    try:
        yield
    finally:
        if held:
            del graphs.due


def copies_waiting(trace: Path) -> dict:
    """The host's copies that took over a millisecond, in an exported trace: they waited for the GPU (a copy to it
    from pageable memory: engine/host_copies.py), each with its kind and size; and the page-locked memory allocated
    (`cudaHostAlloc`: the cache of page-locked memory growing)."""
    events = json.loads(trace.read_text())["traceEvents"]
    copies = {e["args"].get("correlation"): e for e in events if e.get("cat") == "gpu_memcpy"}
    waits = [e for e in events if e.get("name") == "cudaMemcpyAsync" and e.get("dur", 0) > 1000]
    allocations = [e["dur"] for e in events if e.get("name") == "cudaHostAlloc"]

    def described(call: dict) -> list:
        copy = copies.get(call.get("args", {}).get("correlation"), {})
        return [round(call["dur"] / 1e3, 2), copy.get("name"), copy.get("args", {}).get("bytes")]

    return {
        "copies_waiting": len(waits),
        "copies_waiting_s": sum(e["dur"] for e in waits) / 1e6,
        "copies_waiting_ms_kind_bytes": [described(e) for e in waits],
        "host_allocations": len(allocations),
        "host_allocations_s": sum(allocations) / 1e6,
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--runs", default="uniform,mixed,images")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    import logging

    import torch

    import tools.tiny_models as tiny_models

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
        torch.cuda.empty_cache()
    os.environ.update(VLM_MODEL=str(folder), VLM_ALLOW_ANY="true", VLM_DTYPE="bf16", VLM_STREAM_INTERVAL_MS="0")
    import handler
    from runpod_vlm.engine.intake import Intake

    engine = handler.get_engine()
    engine.warm_up()
    engine.wait_until_compiled(600)
    parity = gpu_parity(handler, engine)  # its shapes' graphs are then recorded
    wait_for_recordings(engine)

    def one_token(n):
        return {"id": f"i{n}", "input": {"task": "vqa", "question": "What is shown?", "max_new_tokens": 1,
                                         "image_url": data_uri(448, 448, n)}}  # fmt: skip

    makers = {
        "uniform": lambda first: [vqa(f"u{i}", [data_uri(448, 448, first + i)], 128) for i in range(64)],
        "mixed": lambda first: mixed_jobs(64, seed=11, first_image=first),
        "images": lambda first: [one_token(first + i) for i in range(64)],
    }
    results: dict = {"engine": engine.describe(), "gpu_parity": parity}
    first_image = 2_000_000
    for run in args.runs.split(","):
        spans = Spans()
        decoder = engine.start_decoder()
        for name in (*RUNNER_TOP, "_place", "hand_out", "accept", "_next_grammar_masks", "_requeue"):
            spans.wrap(engine.runner, name)
        spans.wrap(engine.scheduler, "make_room", "scheduler.make_room")
        for name in ("launch", "read"):
            spans.wrap(decoder, name, f"decoder.{name}")
        for name in ("prefill_launch", "begin_chunks", "prefill_chunk"):
            spans.wrap(decoder.prompts, name, f"decoder.{name}")
        spans.wrap(engine.adapter, "collate", "adapter.collate")
        spans.wrap(Intake, "prepare", "intake")
        spans.wrap(handler, "read_job_item", "read")
        result: dict = {}
        try:
            for mode in ("first", "spans", *filter(None, args.variants.split(",")), "profiled", "python"):
                if mode == "profiled" and run != "uniform":
                    continue
                first_image += 1000
                jobs = makers[run](first_image)
                if mode == "python":
                    result[mode] = python_profiled(engine, jobs, out / f"timeline-{run}-python.txt")
                    continue
                with VARIANTS[mode](engine) if mode in VARIANTS else contextlib.nullcontext() as submit:
                    items = submit and [handler.read_job_item(job["input"], *handler.served_model())[1] for job in jobs]
                    profiler = None
                    if mode == "profiled":
                        from torch.profiler import ProfilerActivity, profile

                        gpu = torch.cuda.is_available()
                        profiler = profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU])
                    spans.marks.clear()
                    started = time.perf_counter()
                    # No graph recorded ahead while profiled: the profiler's stop would cut a capture off.
                    with captures_held(engine, bool(profiler)), profiler or contextlib.nullcontext():
                        record = asyncio.run(submit(engine, items) if submit else concurrent(handler, jobs))
                    ended = time.perf_counter()
                result[mode] = {"run": record, **spans.summary(started, ended)}
                if mode == "syncs":
                    result[mode]["syncs"] = dict(SYNCS.most_common(40))
                if profiler is not None:
                    result[mode]["gpu"] = gpu_busy(profiler)
                    trace = out / f"timeline-{run}-trace.json"
                    profiler.export_chrome_trace(str(trace))
                    result[mode]["gpu"].update(copies_waiting(trace))
                    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb", compresslevel=6) as packed:
                        packed.write(raw.read())
                    trace.unlink()
                print(run, mode, json.dumps({k: v for k, v in result[mode].items() if k != "engine_timeline"}))
        finally:
            spans.unwrap()
        results[run] = result
        results["graphs"] = graphs_recorded(engine)
        print("graphs", json.dumps(results["graphs"]))
        (out / "timeline.json").write_text(json.dumps(results, indent=1))


def graphs_recorded(engine) -> dict:
    """The prefill's and the vision tower's graphs recorded so far: their shapes, failures, and the passes replayed."""
    decoder = engine.start_decoder()
    found = {}
    for kind, graphs in (("prefill", decoder.prefill_graphs), ("vision", decoder.vision_graphs)):
        if graphs is not None:
            shapes = [shape if kind == "prefill" else shape[0] for shape in graphs.graphs]
            found[kind] = {"shapes": sorted(shapes), "wanted": len(graphs.wanted), "failures": graphs.failures}
    if decoder.vision_graphs is not None:
        found["vision"].update(passes=decoder.vision_graphs.passes, replays=decoder.vision_graphs.replays)
    return found


def python_profiled(engine, jobs: list[dict], path: Path) -> dict:
    """The run with the engine loop's turns under cProfile (their sum, by tottime and cumulative)."""
    import handler

    with python_profile(engine.runner, RUNNER_TOP, path, (("tottime", 45), ("cumulative", 70))):
        started = time.perf_counter()
        record = asyncio.run(concurrent(handler, jobs))
        seconds = time.perf_counter() - started
    return {"run": record, "seconds": seconds}


if __name__ == "__main__":
    main()
