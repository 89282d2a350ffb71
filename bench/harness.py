"""GPU benchmark of RunPod-style traffic: separate concurrent jobs through the async handler.

Random weights at Qwen2-VL-2B shapes (tools/tiny_models.py), loaded through the handler's own path.
Every job takes the handler's path, one asyncio task per job as the runpod SDK runs them: its request
is read off the event loop (`handler.read_job_item`), then its item is streamed through the engine
(`stream_generation`); the SDK's posting is not included. Every figure is compared with a
baseline measured in the same run:

    python -m bench.harness --out OUT [--quick] [--skip cold,main,open]

- cold start: fresh worker processes at the default settings, compiled without and then with the
  compile-artifact cache, and eager: process start to the first answer, when the compiled step takes
  over while jobs run, the longest gap between tokens across that switch, greedy answers across it;
- correctness on the GPU: compiled continuous-batching answers vs eager `model.generate`;
- batch 1: time to first token and decode tokens/s;
- uniform: 64 jobs x 448x448 x 128 tokens at once; the decode step at 64 rows;
- mixed: 64 jobs (448x448 to 1280x720 images, 64-256 tokens, varied questions) one after another
  (the baseline) and all at once: aggregate tokens/s, p50/p95 time to first token and latency;
- open loop: the mixed jobs arriving at 4, 16 and 64 jobs/s (Poisson): p50/p95 latency and time to
  first token, and the highest rate whose p95 latency stays under twice the unloaded p95.
Results go to OUT/serving.json as they come; the summary is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.workload import (
    QUESTIONS,
    ROOT,
    bench_parser,
    concurrent,
    concurrent_records,
    data_uri,
    decode_step_ms,
    gpu_parity,
    mixed_jobs,
    open_loop,
    run_job,
    sequential,
)


def cold_start(folder: Path, compile_: bool, cache_dir: Path, log: Path) -> dict:
    """A fresh worker process with the default batch settings; `cache_dir` may hold compile artifacts.
    Its whole log goes to `log`."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLM_MAX_BATCH_SIZE", "VLM_MAX_CONCURRENCY")}
    env.update(
        VLM_MODEL=str(folder),
        VLM_COMPILE="true" if compile_ else "false",
        VLM_COMPILE_CACHE_DIR=str(cache_dir),
        BENCH_SPAWNED_AT=repr(time.time()),
    )
    started = time.perf_counter()
    try:
        child = subprocess.run(
            [sys.executable, "-m", __spec__.name, "--child-cold-start"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as expired:
        log.write_text(str(expired.stderr or ""))
        return {"error": "timed out after 300 s"}
    log.write_text(child.stderr)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        return {"error": child.stderr[-3000:]}
    out = json.loads(lines[-1])
    out["process_total_s"] = time.perf_counter() - started
    out["log"] = [line for line in child.stderr.splitlines() if "runpod-vlm" in line or "ecompil" in line][-16:]
    return out


def speed(handler) -> dict:
    """Batch-1 decode tokens/s and 16 concurrent jobs' tokens/s (448x448, 128 tokens)."""
    one = {
        "id": "s1",
        "input": {
            "task": "vqa",
            "question": QUESTIONS[0],
            "image_url": data_uri(448, 448, 0),
            "max_new_tokens": 128,
            "min_new_tokens": 128,
        },
    }
    record = min((asyncio.run(run_job(handler, one)) for _ in range(3)), key=lambda r: r["latency_s"])
    jobs = [{"id": f"s16-{i}", "input": dict(one["input"], image_url=data_uri(448, 448, i))} for i in range(16)]
    return {
        "batch1_decode_tokens_per_s": 127 / (record["latency_s"] - record["ttft_s"]),
        "batch16_tokens_per_s": asyncio.run(concurrent(handler, jobs))["tokens_per_s"],
    }


def child_cold_start() -> None:
    """A fresh worker: first answer, then steady traffic while the compiled step is built in the
    background, the switch, and the speed once compiled; solo greedy answers before and after."""
    spawned = float(os.environ["BENCH_SPAWNED_AT"])
    import logging

    import handler

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d ms %(name)s %(message)s")

    engine = handler.get_engine()
    loaded = time.time() - spawned
    engine.warm_up()
    job = {
        "id": "first",
        "input": {
            "task": "vqa",
            "question": QUESTIONS[0],
            "image_url": data_uri(448, 448, 0),
            "max_new_tokens": 32,
            "min_new_tokens": 32,
        },
    }
    asyncio.run(run_job(handler, job))
    out = {
        "load_s": loaded,
        "process_start_to_first_answer_s": time.time() - spawned,
        "compiled_at_first_answer": engine.compile and engine.wait_until_compiled(0),
    }
    solo = [
        {
            "id": f"solo{i}",
            "input": {
                "task": "vqa",
                "question": QUESTIONS[i],
                "max_new_tokens": 48,
                "image_url": data_uri(640, 480, 50 + i),
            },
        }
        for i in range(2)
    ]

    def solo_answers() -> list[str]:
        return [asyncio.run(run_job(handler, job_))["text"] for job_ in solo]

    reference = solo_answers()
    out["buckets_compiled_at_reference"] = [
        b for b, f in engine.start_decoder().forwards.items() if f is engine.compiler.forward
    ]
    out["speed_before_compiled"] = speed(handler)
    traffic = [
        {
            "id": f"t{i}",
            "input": {
                "task": "vqa",
                "question": QUESTIONS[i % 5],
                "image_url": data_uri(448, 448, 100 + i),
                "max_new_tokens": 96,
            },
        }
        for i in range(4)
    ]
    gaps = []
    while engine.compile and not engine.wait_until_compiled(0) and time.time() - spawned < 150:
        gaps.append(max(r["longest_gap_s"] for r in asyncio.run(concurrent_records(handler, traffic))))
    if engine.compile:
        out["compiled_while_serving"] = engine.wait_until_compiled(0)
        compiled = engine.wait_until_compiled(max(0.0, 250 - (time.time() - spawned)))  # idle now
        out["process_start_to_compiled_s"] = time.time() - spawned if compiled else None
        out["speed_compiled"] = speed(handler)
        out["traffic_rounds_while_compiling"] = len(gaps)
        out["longest_gap_between_tokens_while_compiling_s"] = max(gaps, default=None)
        out["median_round_longest_gap_s"] = statistics.median(gaps) if gaps else None
        out["greedy_solo_answers_identical_before_and_after_compile"] = solo_answers() == reference
        from torch._dynamo.utils import compile_times  # where the compile's seconds went, summed over shapes

        out["compile_phases_s"] = {
            name: round(float(seconds), 2) for name, seconds in zip(*compile_times(repr="csv", aggregate=True))
        }
    print(json.dumps(out))


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer jobs (a smoke run)")
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated sections to skip: cold (or one of its "
        "eager, compiled_no_cache, compiled_with_cache), main, open",
    )
    parser.add_argument("--child-cold-start", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_cold_start:
        return child_cold_start()

    import logging

    import torch
    import transformers

    import tools.tiny_models as tiny_models

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv),
    }

    def save():
        (out / "serving.json").write_text(json.dumps(results, indent=2))

    os.environ.update(VLM_ALLOW_ANY="true", VLM_DTYPE="bf16", VLM_STREAM_INTERVAL_MS="0")
    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        started = time.perf_counter()
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
        results["build_s"] = time.perf_counter() - started
        torch.cuda.empty_cache()
    if "cold" not in skip:  # fresh processes first, while no other process holds the GPU
        cache_dir = Path(tempfile.mkdtemp(prefix="vlm-compile-cache-"))
        results["cold_start"] = cold = {}
        for name, compile_ in (("eager", False), ("compiled_no_cache", True), ("compiled_with_cache", True)):
            if name in skip:
                continue
            cold[name] = cold_start(folder, compile_, cache_dir, out / f"cold-{name}.log")
            save()
    if "main" in skip:
        return print(json.dumps(results, indent=2))
    os.environ.update(
        VLM_MODEL=str(folder), VLM_MAX_BATCH_SIZE="64", VLM_MAX_CONCURRENCY="64", VLM_MAX_BATCH_REQUESTS="64"
    )
    import handler

    started = time.perf_counter()
    engine = handler.get_engine()
    results["load_s"] = time.perf_counter() - started
    engine.warm_up()
    results["compiled_in_background_s"] = time.perf_counter() - started if engine.wait_until_compiled(900) else None
    save()
    results["gpu_parity"] = gpu_parity(handler, engine)
    save()

    uri = data_uri(448, 448, 0)
    first = {"id": "ttft", "input": {"task": "vqa", "question": QUESTIONS[0], "image_url": uri, "max_new_tokens": 1}}
    full = {
        "id": "b1",
        "input": {
            "task": "vqa",
            "question": QUESTIONS[0],
            "image_url": uri,
            "max_new_tokens": 128,
            "min_new_tokens": 128,
        },
    }
    ttft = statistics.median(asyncio.run(run_job(handler, first))["ttft_s"] for _ in range(5))
    whole = statistics.median(asyncio.run(run_job(handler, full))["latency_s"] for _ in range(3))
    results["batch1"] = {"time_to_first_token_s": ttft, "request_s": whole, "decode_tokens_per_s": 127 / (whole - ttft)}
    save()

    count = 16 if args.quick else 64
    uniform = [
        {
            "id": f"u{i}",
            "input": {
                "task": "vqa",
                "question": QUESTIONS[0],
                "image_url": data_uri(448, 448, i),
                "max_new_tokens": 128,
                "min_new_tokens": 128,
                "stream": True,
            },
        }
        for i in range(count)
    ]
    results["uniform_64x448x128"] = asyncio.run(concurrent(handler, uniform))
    results["decode_step_ms"] = {str(rows): decode_step_ms(handler, engine, rows) for rows in (1, 16, 64)}
    save()

    jobs = mixed_jobs(count)
    results["mixed_sequential"] = asyncio.run(sequential(handler, jobs))
    save()
    results["mixed_concurrent"] = asyncio.run(concurrent(handler, mixed_jobs(count, first_image=500_000)))
    results["mixed_speedup"] = results["mixed_concurrent"]["tokens_per_s"] / results["mixed_sequential"]["tokens_per_s"]
    save()
    if "open" not in skip:
        unloaded_p95 = results["mixed_sequential"]["latency_p95_s"]
        results["open_loop"] = []
        for rate in (4, 16, 64):
            results["open_loop"].append(asyncio.run(open_loop(handler, mixed_jobs(count, seed=rate), rate)))
            save()
        held = [r["rate"] for r in results["open_loop"] if r["latency_p95_s"] < 2 * unloaded_p95]
        results["highest_rate_p95_under_2x_unloaded"] = max(held) if held else None
    results["speed_warm"] = speed(handler)
    results["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    save()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
