"""GPU benchmark: the handler against the naive one-generate-per-request loop, on random weights.

Builds random-weight Qwen2-VL models at real shapes offline (tools/tiny_models.py), loads them through
the handler's own loading path, drives the async handler (`handler.local_test_answer(job)`) with data-URI images
and 128 forced new tokens, and writes every number to OUT/results.json (bench/plot.py draws the chart from it):

    python bench/benchmark.py --out OUT [--shapes qwen2-vl-2b,qwen2-vl-7b] [--quantized]

Numbers: memory roofline (copy bandwidth over weight bytes), naive loop vs handler on a 16-request
batch, batch-1 time to first token and decode tokens/s, aggregate tokens/s at batch 1/4/16/64, peak
memory, cold start (load, warm-up, first request) and a restart reusing the compiled-kernel cache,
and bitsandbytes 4-bit/8-bit at batch 1 and 16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests")]

NEW_TOKENS = 128
BATCHES = (1, 4, 16, 64)
PROMPT = "Describe this image in one sentence."


def run_job(job: dict):
    """One job through the async handler, as the runpod SDK runs it; its whole output."""
    import asyncio

    import handler

    return asyncio.run(handler.local_test_answer(job))


def photo_uri(width: int, height: int, seed: int) -> str:
    """A photo-like JPEG (smooth gradients and noise) as a data URI."""
    import numpy as np
    from PIL import Image

    from sample_images import data_uri, encode

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 127 // (width + height))], -1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype("uint8")
    return data_uri(encode(Image.fromarray(pixels), "JPEG", quality=90), "image/jpeg")


def request(image: str, new_tokens: int = NEW_TOKENS) -> dict:
    return {
        "task": "vqa",
        "question": PROMPT,
        "image_url": image,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
    }


def sync():
    import torch

    torch.cuda.synchronize()


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        sync()
        started = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second (as gpu-baseline.md measured it)."""
    import torch

    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    sync()
    seconds = start.elapsed_time(end) / 1000 / 10
    del source, target
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / seconds


def compile_count() -> int:
    """Graphs compiled so far by dynamo in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def check(answer: dict) -> dict:
    failures = [r for r in answer.get("results", [answer]) if "error" in r]
    if failures:
        raise RuntimeError(f"handler answered an error: {failures[0]}")
    return answer


def naive_loop(engine, images: list[str]) -> float:
    """The model card's recipe, one request at a time: chat template + processor + plain generate."""
    import torch

    import handler

    model, processor = engine.model, engine.processor

    def run():
        for uri in images:
            image = handler.resolve_image(uri, "image_url")
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = processor(text=[text], images=[image], return_tensors="pt").to(model.device)
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    seconds, _ = timed(run)
    return seconds


def measure_handler(handler, images: dict, label: str, batches=BATCHES, repeat: int = 3) -> dict:
    """Batch-1 latency and aggregate throughput through handler(job), images of one size."""
    out: dict = {}
    uri = images[label][0]
    ttft, _ = timed(lambda: check(run_job({"input": request(uri, 1)})), repeat=5)
    full, answer = timed(lambda: check(run_job({"input": request(uri)})), repeat=repeat)
    out["batch1"] = {
        "time_to_first_token_s": ttft,
        "request_s": full,
        "decode_tokens_per_s": (NEW_TOKENS - 1) / (full - ttft),
        "completion_tokens": answer["usage"]["completion_tokens"],
    }
    out["throughput"] = {}
    for rows in batches:
        job = {"id": f"bench-{rows}", "input": {"requests": [request(u) for u in images[label][:rows]]}}
        seconds, answer = timed(lambda job=job: check(run_job(job)), repeat=repeat if rows <= 16 else 1)
        tokens = sum(r["usage"]["completion_tokens"] for r in answer["results"])
        out["throughput"][str(rows)] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    return out


def bench_shape(shape: str, args, results: dict, save) -> None:
    import torch

    import tiny_models

    folder = Path(args.models) / shape
    entry = results.setdefault(shape, {})
    if not (folder / "config.json").exists():
        started = time.perf_counter()
        tiny_models.build("qwen2-vl", folder, shape, device="cuda", dtype="bf16")
        entry["build_s"] = time.perf_counter() - started
        torch.cuda.empty_cache()
    os.environ.update(
        VLM_MODEL=str(folder),
        VLM_ALLOW_ANY="true",
        VLM_DTYPE="bf16",
        VLM_MAX_BATCH_SIZE="64",
        VLM_MAX_BATCH_REQUESTS="64",
        VLM_COMPILE_CACHE_DIR=str(Path(args.models) / "compile-cache"),
    )
    import handler

    handler.reset_engine()
    torch.cuda.reset_peak_memory_stats()
    images = {
        "448x448": [photo_uri(448, 448, seed) for seed in range(max(BATCHES))],
        "1024x768": [photo_uri(1024, 768, seed) for seed in range(16)],
    }
    started = time.perf_counter()
    engine = handler.get_engine()
    load_s = time.perf_counter() - started
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    language_bytes = sum(
        p.numel() * p.element_size() for n, p in engine.model.named_parameters() if ".visual." not in f".{n}"
    )
    engine.warm_up()
    warm_up_s = time.perf_counter() - started if engine.wait_until_compiled(900) else None
    compiles_after_warm_up = compile_count()
    first_s, _ = timed(lambda: check(run_job({"input": request(images["448x448"][0])})))
    entry["cold_start"] = {
        "load_s": load_s,
        "warm_up_s": warm_up_s,
        "first_request_s": first_s,
        "compiled": engine.compile,
    }
    entry["weights_gb"] = weight_bytes / 1e9
    entry["decode_weights_gb"] = language_bytes / 1e9
    save()

    for label in ("448x448", "1024x768"):
        batches = BATCHES if label == "448x448" else (1, 16)
        entry[label] = measure_handler(handler, images, label, batches)
        save()
    entry["compiles_during_requests"] = compile_count() - compiles_after_warm_up
    entry["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    roofline = results["copy_bandwidth_bytes_per_s"] / language_bytes
    batch1 = entry["448x448"]["batch1"]
    entry["roofline_tokens_per_s"] = roofline
    entry["decode_fraction_of_roofline"] = batch1["decode_tokens_per_s"] / roofline
    save()

    if args.naive:
        naive_s = naive_loop(engine, images["448x448"][:16])
        batch16 = entry["448x448"]["throughput"]["16"]["seconds"]
        entry["naive_vs_handler_16"] = {"naive_s": naive_s, "handler_s": batch16, "speedup": naive_s / batch16}
        save()

    handler.reset_engine()
    del engine
    torch.cuda.empty_cache()
    if args.restart:
        entry["restart"] = restart(folder, Path(args.models) / "compile-cache")
        save()
    if args.quantized:
        for mode in ("4bit", "8bit"):
            try:
                entry[mode] = quantized(handler, folder, mode, images)
            except Exception as error:  # bitsandbytes may be missing on the machine
                entry[mode] = {"error": f"{type(error).__name__}: {error}"[:300]}
            save()


def quantized(handler, folder: Path, mode: str, images: dict) -> dict:
    import torch

    os.environ["VLM_QUANTIZE"] = mode
    handler.reset_engine()
    torch.cuda.reset_peak_memory_stats()
    try:
        started = time.perf_counter()
        engine = handler.get_engine()
        out = {"load_s": time.perf_counter() - started, "compiled": engine.compile}
        out.update(measure_handler(handler, images, "448x448", batches=(1, 16), repeat=1))
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        return out
    finally:
        os.environ["VLM_QUANTIZE"] = "none"
        handler.reset_engine()
        torch.cuda.empty_cache()


def restart(folder: Path, cache_dir: Path) -> dict:
    """A fresh process that loads, warms up and answers once, with the compiled-kernel cache warm."""
    env = dict(os.environ, VLM_MODEL=str(folder), VLM_COMPILE_CACHE_DIR=str(cache_dir))
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, __file__, "--child-restart"], env=env, capture_output=True, text=True, timeout=900
    )
    total = time.perf_counter() - started
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        return {"error": child.stderr[-2000:]}
    out = json.loads(lines[-1])
    out["process_total_s"] = total
    return out


def child_restart() -> None:
    import handler

    started = time.perf_counter()
    engine = handler.get_engine()
    load_s = time.perf_counter() - started
    engine.warm_up()
    warm_up_s = time.perf_counter() - started if engine.wait_until_compiled(900) else None
    first_s, _ = timed(lambda: check(run_job({"input": request(photo_uri(448, 448, 0))})))
    print(json.dumps({"load_s": load_s, "warm_up_s": warm_up_s, "first_request_s": first_s}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--models", default="/tmp/runpod-vlm-bench", help="where the random models go")
    parser.add_argument("--shapes", default="qwen2-vl-2b")
    parser.add_argument("--no-naive", dest="naive", action="store_false")
    parser.add_argument("--no-restart", dest="restart", action="store_false")
    parser.add_argument("--quantized", action="store_true")
    parser.add_argument("--child-restart", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_restart:
        return child_restart()

    import logging

    import torch
    import transformers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        new_tokens=NEW_TOKENS,
        command=" ".join(sys.argv),
    )

    def save():
        results_path.write_text(json.dumps(results, indent=2))

    results["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    save()
    for shape in args.shapes.split(","):
        bench_shape(shape, args, results, save)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
