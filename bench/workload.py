"""What the GPU benchmarks share: the jobs they send (mixed sizes and lengths, images no run sent before), running
them through the handler's own path (one asyncio task per job, as the runpod SDK runs them: alone, one after another,
all at once or arriving at a rate) and their summaries, the benchmark model, the engine's counters, and GPU parity
with eager `generate`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
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


def bench_model(models: str, tiny: bool = False, family: str = "qwen2-vl", shape: str = "qwen2-vl-2b") -> Path:
    """The model a benchmark runs, with the worker's environment set to load it: random weights of `family` at
    `shape` in bf16 (built into `models` once), or with `tiny` a tiny fp32 one on the CPU (a smoke run)."""
    import tools.tiny_models as tiny_models

    if tiny:
        folder = tiny_models.build(family, Path(models) / f"{family}-tiny")
        os.environ.update(VLM_DEVICE_MAP="cpu", VLM_DTYPE="fp32")
    else:
        folder = Path(models) / shape
        if not (folder / "config.json").exists():
            import torch

            tiny_models.build(family, folder, shape, device="cuda", dtype="bf16")
            torch.cuda.empty_cache()  # the building copy's memory, let go of before the worker loads it
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


async def concurrent_records(handler, jobs: list[dict]) -> list[dict]:
    return list(await asyncio.gather(*(run_job(handler, job) for job in jobs)))


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
