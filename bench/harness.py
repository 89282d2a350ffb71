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
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runpod_vlm.answers import stream_generation
from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, RequestError, StreamDelta, Turn, answered_length

ROOT = Path(__file__).resolve().parent.parent

SIZES = [(448, 448), (640, 480), (800, 600), (1024, 768), (1280, 720)]
QUESTIONS = [
    "Describe this image in one sentence.",
    "What is in the picture?",
    "List every object you can see, with its colour.",
    "Is there any text in this image? Read it out.",
    "Describe the scene in detail: the objects, the light and the mood.",
]


def photo_uri(width: int, height: int, seed: int) -> str:
    """A photo-like JPEG (smooth gradients and noise) as a data URI."""
    import numpy as np
    from PIL import Image

    from tools.sample_images import data_uri, encode

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 127 // (width + height))], -1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype("uint8")
    return data_uri(encode(Image.fromarray(pixels), "JPEG", quality=90), "image/jpeg")


data_uri = photo_uri  # the harness's images are photo-like JPEGs


@contextlib.contextmanager
def python_profile(engine, methods, path: Path, sorts=(("cumulative", 60),)):
    """`engine`'s `methods` run under one cProfile inside the block (on Python 3.12 it sees every thread while
    enabled); its stats go to `path`, sorted by each (key, rows) of `sorts`."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    real = {name: getattr(engine, name) for name in methods}

    def profiled(method):
        def run(*args, **kwargs):
            profiler.enable()
            try:
                return method(*args, **kwargs)
            finally:
                profiler.disable()

        return run

    for name, method in real.items():
        setattr(engine, name, profiled(method))
    try:
        yield profiler
    finally:
        for name, method in real.items():
            setattr(engine, name, method)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for key, rows in sorts:
        stats.sort_stats(key).print_stats(rows)
    path.write_text(text.getvalue())


def bench_parser(doc: str, tiny: bool = False) -> argparse.ArgumentParser:
    """A benchmark's command line: its summary (the first paragraph of `doc`, its module's), where its results go
    (--out), where the random-weight models are built (--models) and, with `tiny`, --tiny: its smoke run."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--models", default="/tmp/runpod-vlm-bench")
    if tiny:
        parser.add_argument("--tiny", action="store_true", help="tiny fp32 models on the CPU (a smoke run)")
    return parser


def bench_model(models: str, tiny: bool = False) -> Path:
    """The model a benchmark runs, with the worker's environment set to load it: random weights at Qwen2-VL-2B shapes
    in bf16 (built into `models` once), or with `tiny` a tiny fp32 one on the CPU (a smoke run)."""
    import tools.tiny_models as tiny_models

    if tiny:
        folder = tiny_models.build("qwen2-vl", Path(models) / "qwen2-vl-tiny")
        os.environ.update(VLM_DEVICE_MAP="cpu", VLM_DTYPE="fp32")
    else:
        folder = Path(models) / "qwen2-vl-2b"
        if not (folder / "config.json").exists():
            tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
        os.environ.update(VLM_DTYPE="bf16")
    os.environ.update(VLM_MODEL=str(folder), VLM_ALLOW_ANY="true")
    return folder


def counters(engine) -> dict:
    """The engine's timings and counts so far, and on the GPU the page-locked blocks allocated (each a `cudaHostAlloc`
    of milliseconds, which stalls the engine thread's CUDA calls meanwhile) and
    the GPU memory segments the caching allocator took from CUDA."""
    import torch

    now = dict(engine.timings)
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch 2.6+
    if torch.cuda.is_available() and stats is not None:
        now["page_locked_allocations"] = stats().get("num_host_alloc", 0)
    if torch.cuda.is_available():  # each a cudaMalloc: after a graph recording's empty_cache, a step's memory anew
        now["gpu_segments_allocated"] = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    return now


def counted_since(engine, before: dict) -> dict:
    """`counters` since `before` (the phases of a run)."""
    return {k: round(v - before.get(k, 0), 3) for k, v in counters(engine).items()}


def wait_for_recordings(engine, seconds: float = 60) -> None:
    """Until the engine has recorded the CUDA graphs it asked for while idle and none is under way (at most
    `seconds`): a job arriving meanwhile waits for one recording, which is not the steady state, and a synchronize
    from another thread (a profiler's exit) voids it. A recording holds the capture lock (as the background compile
    does), taken before the last one asked for is no longer due."""
    graphs, deadline = engine.start_decoder().step_graphs, time.monotonic() + seconds
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:  # twice in a row: a decode step's is asked for before its lock
        busy = graphs.due() or (graphs.capture_lock is not None and graphs.capture_lock.locked())
        quiet = 0 if busy else quiet + 1
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def mixed_jobs(count: int, seed: int = 0, first_image: int | None = None) -> list[dict]:
    """Sizes, questions and lengths drawn with `seed`; images numbered from `first_image` (seed x 1000 by
    default), so that no two runs send the same image: the image and prefix caches would answer it."""
    rng = random.Random(seed)
    first_image = seed * 1000 if first_image is None else first_image
    jobs = []
    for index in range(count):
        width, height = rng.choice(SIZES)
        tokens = rng.randint(64, 256)
        jobs.append(
            {
                "id": f"mixed-{index}",
                "input": {
                    "task": "vqa",
                    "question": rng.choice(QUESTIONS),
                    "image_url": data_uri(width, height, first_image + index),
                    "max_new_tokens": tokens,
                    "min_new_tokens": tokens,
                    "stream": True,
                },
            }
        )
    return jobs


async def run_job(handler, job: dict) -> dict:
    """One job on the handler's own path (read the request off the event loop, stream the item
    through the engine); records time to first token, latency, tokens and the longest gap
    between two token deliveries."""
    started = time.perf_counter()
    settings, model_id = handler.served_model()
    _, item = await asyncio.to_thread(handler.read_job_item, job["input"], settings, model_id, None)
    first = previous = None
    gap, result = 0.0, None
    async for event in stream_generation(handler.get_engine(), item):
        now = time.perf_counter()
        if isinstance(event, StreamDelta):
            first = first or now
            gap = max(gap, now - previous) if previous else gap
            previous = now
        else:
            result = event
    if isinstance(result, RequestError):
        raise RuntimeError(f"job {job['id']} failed: {result.to_dict()}")
    end = time.perf_counter()
    return {
        "ttft_s": (first or end) - started,  # a path that streams no deltas (one at a time): its whole answer
        "latency_s": end - started,
        "tokens": result.completion_tokens,
        "longest_gap_s": gap,
        "text": result.text,
    }


def one_token_job(image: int) -> dict:
    """A job of one new 448x448 image (numbered `image`: a repeated one is answered from the caches) and one token."""
    input = {"task": "vqa", "question": QUESTIONS[0], "image_url": data_uri(448, 448, image), "max_new_tokens": 1}
    return {"id": "t", "input": input}


def run_alone(handler, engine, job: dict, wait: bool = True) -> dict:
    """`run_job` of `job` alone, then (`wait`) the graphs it asked for recorded while idle: the next job meets none
    under way, as a warm worker serves (unwaited, a fresh worker's first jobs took 55-155 ms to their first token
    against 26-30). Its record, with the engine's counters over it."""
    before = counters(engine)
    record = asyncio.run(run_job(handler, job))
    if wait:
        wait_for_recordings(engine)
    return {**record, "counted": counted_since(engine, before)}


def summarize(records: list[dict], seconds: float) -> dict:
    tokens = sum(r["tokens"] for r in records)
    return {
        "jobs": len(records),
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_s": percentile([r["ttft_s"] for r in records], 0.5),
        "ttft_p95_s": percentile([r["ttft_s"] for r in records], 0.95),
        "latency_p50_s": percentile([r["latency_s"] for r in records], 0.5),
        "latency_p95_s": percentile([r["latency_s"] for r in records], 0.95),
    }


async def sequential(handler, jobs: list[dict]) -> dict:
    """The jobs one by one, and (`latency_fit`, where their lengths differ) a job's latency alone as a line in its
    tokens, fitted over all of them: what the open loop's jobs would each take alone (`open_loop`'s `unloaded`)."""
    started = time.perf_counter()
    records = [await run_job(handler, job) for job in jobs]
    result = summarize(records, time.perf_counter() - started)
    tokens = [r["tokens"] for r in records]
    if len(set(tokens)) > 1:
        fit = statistics.linear_regression(tokens, [r["latency_s"] for r in records])
        result["latency_fit"] = {"intercept_s": fit.intercept, "per_token_s": fit.slope}
    return result


async def concurrent(handler, jobs: list[dict]) -> dict:
    started = time.perf_counter()
    records = await asyncio.gather(*(run_job(handler, job) for job in jobs))
    return summarize(list(records), time.perf_counter() - started)


async def open_loop(handler, jobs: list[dict], rate: float, seed: int = 1, unloaded: dict | None = None) -> dict:
    """`jobs` arriving at `rate` a second (Poisson). With `unloaded` (`sequential`'s): the p95 latency against its
    p95 (`p95_latency_vs_unloaded`), and, with its `latency_fit`, against the p95 of these same jobs alone as the fit
    predicts them (`p95_latency_vs_alone`), a divisor steadier than the unloaded run's own p95, which is of 16 other
    jobs."""
    rng = random.Random(seed)
    started = time.perf_counter()
    tasks, at = [], 0.0
    for job in jobs:
        at += rng.expovariate(rate)
        delay = started + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_job(handler, job)))
    records = await asyncio.gather(*tasks)
    result = dict(summarize(list(records), time.perf_counter() - started), rate=rate)
    if unloaded is not None:
        result["p95_latency_vs_unloaded"] = result["latency_p95_s"] / unloaded["latency_p95_s"]
    fit = (unloaded or {}).get("latency_fit")
    if fit is not None:
        alone = [fit["intercept_s"] + fit["per_token_s"] * r["tokens"] for r in records]
        result["latency_p95_alone_s"] = percentile(alone, 0.95)
        result["p95_latency_vs_alone"] = result["latency_p95_s"] / result["latency_p95_alone_s"]
    return result


def decode_step_ms(handler, engine, rows: int, steps: int = 80) -> float:
    """The decode step with `rows` rows in flight, timed on the engine's decoder while it is idle."""
    import torch
    from PIL import Image

    decoder = engine.start_decoder()
    image = Image.new("RGB", (448, 448), (90, 120, 150))
    params = GenerationParams(
        max_new_tokens=steps + 8, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=steps + 8
    )
    items = [GenerationRequest("caption", [Turn("user", [image, "Describe."])], params) for _ in range(rows)]
    with torch.inference_mode():
        inputs, _ = engine.adapter.batch_inputs(engine.processor, items, engine.model.device, engine.dtype)
        free = decoder.free_rows()[:rows]
        decoder.prompts.prefill(inputs, free, [params] * rows)
        for row in free:  # the blocks of every step below
            decoder.grow(row, decoder.lengths[row] + params.max_new_tokens)
        decoder.step(decoder.interval)  # graph capture if not yet
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps // decoder.interval):
            decoder.step(decoder.interval)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        for row in free:
            decoder.release(row)
    return 1000 * seconds / (steps // decoder.interval * decoder.interval)


def gpu_parity(handler, engine, count: int = 6) -> dict:
    """Greedy answers of the compiled continuous-batching engine (all at once) vs eager generate."""
    import torch

    jobs = mixed_jobs(count, seed=7)
    for job in jobs:
        job["input"].update(stream=False, max_new_tokens=24, min_new_tokens=0)

    async def all_at_once():
        return await asyncio.gather(*(handler.local_test_answer(job) for job in jobs))

    answers = asyncio.run(all_at_once())
    same = 0
    for job, answer in zip(jobs, answers):
        _, item = handler.read_job_item(job["input"], engine.settings, engine.model_id, None)
        inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], engine.model.device, engine.dtype)
        with torch.inference_mode(), engine.compiler.capture_lock:  # no graph recorded beside generate's GPU work
            out = engine.model.generate(**inputs, max_new_tokens=24, do_sample=False)
        ids = out[0, inputs["input_ids"].shape[1] :].tolist()
        text = engine.tokenizer.decode(ids[: answered_length(ids, engine.eos_ids)], skip_special_tokens=True)
        same += text.strip() == answer["response"]
    return {"jobs": count, "identical_to_eager_generate": same}


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


async def concurrent_records(handler, jobs: list[dict]) -> list[dict]:
    return list(await asyncio.gather(*(run_job(handler, job) for job in jobs)))


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
