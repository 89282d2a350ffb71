"""The same concurrent runs on several code trees (GPU), a fresh worker each, taken in turns:

    python -m bench.ab --out OUT --tree old=PATH --tree new=. [--rounds 2] [--variant new:gc_freeze] [--runs ...]

A tree is a checkout of the worker (`git archive REV | tar -x -C PATH`); each worker imports `handler` and
`runpod_vlm` from its tree, and the jobs from this tree's bench/. Trees go in turns (old, new, old, new, ...) so a
drift of the machine falls on every one. Each worker, Qwen2-VL-2B shapes (`--shape qwen2-vl-7b`: 7B's) at DEFAULT
settings, waits for its background compile, then runs on new images each time: 64 mixed jobs (warm-up, not counted),
then three times 32 short mixed jobs (bench/paged.py's short_32_alone), 64 uniform (448x448 x 128), 64 mixed jobs and
64 one-token jobs of a new 448x448 image (their tokens/s: images a second), all at once, and `batch1`: four uniform
jobs one after another (`--runs` picks among them; `open_RATE` adds 128 mixed jobs arriving at RATE a second, Poisson,
and 16 mixed jobs one by one first, once: the p95 latency's divisor, as bench/paged.py's open loop, and the fit of
their latency in their tokens that `p95_latency_vs_alone` divides by). A variant `TREE:gc_freeze` freezes the garbage
collector's objects after the warm-up; `TREE:after_mixed_256` warms up with 256 mixed jobs at once (as bench/paged.py
runs them before its short jobs); `TREE:served_while_compiling` answers one job before its compile (as a worker
started by load), then waits for the compile and the recordings it asked for; `TREE:NAME=VALUE,...` sets the worker's
environment (e.g. VLM_SYNC_INTERVAL=16). Each worker ends by replaying its prefill and vision graphs of the sizes that
run compiled (`graph_replay_ms`). Results: OUT/ab.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


BURSTS = ("short_32", "uniform_64", "mixed_64", "images_64", "batch1")


def child(tree: str, variant: str, models: str, runs: list[str], shape: str = "qwen2-vl-2b") -> dict:
    if "=" in variant:
        os.environ.update(pair.split("=", 1) for pair in variant.split(","))
    sys.path.insert(0, str(Path(tree).resolve()))  # the tree's handler and runpod_vlm, measured
    import gc

    import torch

    import tools.tiny_models as tiny_models

    folder = Path(models) / shape
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, shape, device="cuda", dtype="bf16")  # on a CPU: pass a tiny one
        torch.cuda.empty_cache()
    os.environ.update(VLM_MODEL=str(folder), VLM_ALLOW_ANY="true", VLM_DTYPE="bf16", VLM_STREAM_INTERVAL_MS="0")
    import importlib

    handler = importlib.import_module("handler")  # first: bench's modules put their own checkout ahead on sys.path
    runpod_vlm = importlib.import_module("runpod_vlm")
    from bench.workload import (
        concurrent,
        counted_since,
        counters,
        mixed_jobs,
        open_loop,
        sequential,
        wait_for_recordings,
    )

    for module in (handler, runpod_vlm):  # the tree's own code, not this one's
        assert Path(module.__file__).resolve().is_relative_to(Path(tree).resolve()), module.__file__
    engine = handler.get_engine()
    engine.warm_up()
    if variant == "served_while_compiling":  # a worker started by load: its first job comes before the compile
        asyncio.run(concurrent(handler, mixed_jobs(1, seed=3, first_image=890_000)))
    compiled = engine.wait_until_compiled(600)
    if variant == "served_while_compiling":
        wait_for_recordings(engine)  # those the compile's end asked for
    warm_up = 256 if variant == "after_mixed_256" else 64  # the former: bench/paged.py's run before short_32_alone
    asyncio.run(concurrent(handler, mixed_jobs(warm_up, seed=1, first_image=900_000)))
    if variant == "gc_freeze":
        gc.collect()
        gc.freeze()
    unloaded = None
    if any(name.startswith("open_") for name in runs):
        unloaded = asyncio.run(sequential(handler, mixed_jobs(16, seed=11, first_image=950_000)))
    results: dict = {name: [] for name in runs}
    for n in range(3):
        base = 1_000_000 + 10_000 * n
        for name in runs:
            before = counters(engine)
            if name.startswith("open_"):
                jobs = mixed_jobs(128, seed=17 + n, first_image=base + 4000)
                result = asyncio.run(open_loop(handler, jobs, float(name[5:]), unloaded=unloaded))
            elif name == "batch1":
                result = asyncio.run(sequential(handler, burst(name, base)))
            else:
                result = asyncio.run(concurrent(handler, burst(name, base)))
            result["phases"] = counted_since(engine, before)
            results[name].append(result)
    kv, replays = None, {}
    try:  # the bursts' figures count whatever fails here (an older tree may lack what it reads)
        decoder = engine.start_decoder() if hasattr(engine, "start_decoder") else engine._current_decoder()
        kv = {"blocks": decoder.pool.capacity, "free": decoder.pool.free, "cached": decoder.pool.cached}
        wait_for_recordings(engine)  # the bursts' new shapes: a synchronize here would void a recording
        with torch.inference_mode():  # the graphs' buffers are inference tensors
            replays = graph_replay_ms(engine)
    except Exception as error:
        replays = {"graph_replay_error": repr(error)[:500]}
    return {"compiled": compiled, "unloaded_sequential_16": unloaded, "runs": results, "pool": kv, **replays}


def graph_replay_ms(engine) -> dict:
    """Each recorded prefill graph of 3,072 tokens or more and vision graph of 4,096 patches or more (the sizes that
    run compiled) replayed alone, ms (median of 5): a graph recorded during the compile replays the eager kernels. A
    prefill's over its padding alone (block 0's slot), a vision pass's over its last pixels."""
    import torch

    decoder = engine.start_decoder()
    found: dict = {}
    for name, graphs, smallest in (
        ("prefill_graph_replay_ms", decoder.prefill_graphs, 3072),
        ("vision_graph_replay_ms", decoder.vision_graphs, 4096),
    ):
        found[name] = {}
        for shape, graph in sorted((graphs.graphs if graphs is not None else {}).items()):
            if shape[0] < smallest:
                continue
            if name.startswith("prefill"):
                held = graphs.buffers
                graphs.fill(shape, held.slots[:0], held.key_slots[:0], [], [])
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                started = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append(1000 * (time.perf_counter() - started))
            found[name][str(shape)] = round(statistics.median(times), 3)
    return found


def burst(name: str, base: int) -> list[dict]:
    """A burst's jobs, their images numbered from `base`."""
    from bench.paged import vqa
    from bench.workload import data_uri, mixed_jobs

    if name == "short_32":
        return mixed_jobs(32, seed=5, first_image=base)
    if name == "mixed_64":
        return mixed_jobs(64, seed=7, first_image=base + 2000)
    first, tokens, count = {"uniform_64": (base + 1000, 128, 64), "images_64": (base + 3000, 1, 64)}.get(
        name,
        (base + 5000, 128, 4),  # batch1: four such jobs one after another
    )
    return [vqa(f"{name}-{i}", [data_uri(448, 448, first + i)], tokens) for i in range(count)]


def figure(run: str, result: dict) -> float:
    """What a run is compared by: an open loop's p95 latency against the unloaded one, else tokens/s."""
    return result["p95_latency_vs_unloaded"] if run.startswith("open_") else result["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--models", default="/tmp/runpod-vlm-bench")
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a worker checkout")
    parser.add_argument(
        "--variant", action="append", default=[], help="TREE:VARIANT: a worker more (the docstring lists the variants)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", default=",".join(BURSTS), help=f"of {', '.join(BURSTS)}, open_RATE (e.g. open_16)")
    parser.add_argument("--shape", default="qwen2-vl-2b", choices=("qwen2-vl-2b", "qwen2-vl-7b"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        runs = [r for r in args.runs.split(",") if r]
        return print("RESULT " + json.dumps(child(*args.child, args.models, runs, args.shape)))
    trees = dict(pair.split("=", 1) for pair in args.tree) or {"here": str(ROOT)}
    workers = [(name, "plain") for name in trees] + [tuple(v.split(":", 1)) for v in args.variant]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": " ".join(sys.argv), "trees": trees, "workers": []}
    for round_ in range(args.rounds):
        for name, variant in workers:
            started = time.perf_counter()
            command = [sys.executable, "-m", __spec__.name, "--models", args.models, "--runs", args.runs]
            command += ["--shape", args.shape]
            command += ["--child", trees[name], variant]
            done = subprocess.run(command, cwd=ROOT, text=True, capture_output=True)
            label = name if variant == "plain" else f"{name}:{variant}"
            (out / f"ab-{label.replace(':', '-')}-{round_}.log").write_text(done.stderr[-100_000:])
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            record = json.loads(lines[-1][7:]) if lines else {"error": done.stderr[-2000:]}
            record.update(worker=label, round=round_, wall_s=time.perf_counter() - started)
            results["workers"].append(record)
            (out / "ab.json").write_text(json.dumps(results, indent=2))
            if "runs" in record:
                print(
                    label,
                    {k: [round(figure(k, r), 2) for r in v] for k, v in record["runs"].items()},
                    flush=True,
                )
    summary: dict = {}
    for record in results["workers"]:
        for run, values in record.get("runs", {}).items():
            summary.setdefault(record["worker"], {}).setdefault(run, []).extend(figure(run, r) for r in values)
    # Each run's median `figure` (older results call it `median_tokens_per_s`).
    results["medians"] = {
        worker: {run: round(statistics.median(v), 2) for run, v in runs.items()} for worker, runs in summary.items()
    }
    (out / "ab.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["medians"], indent=2))


if __name__ == "__main__":
    main()
