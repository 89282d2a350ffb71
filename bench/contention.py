"""Why serving slows while the background compile runs (GPU machine), one fresh worker per variant:

    python -m bench.contention --out OUT --models MODELS

Each worker (Qwen2-VL-2B shapes, one 8-row bucket, its own empty inductor/Triton caches) answers
single jobs one after another: before the compile, while it runs and after. A sampler records where
the engine thread is every 20 ms while compiling. Variants: the defaults; inductor's parallel kernel
compile off (`TORCHINDUCTOR_COMPILE_THREADS=1`); a GIL switch interval of 0.05 ms and of 5 ms while
compiling (the worker's is 0.5 ms). Results go to OUT/contention.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "defaults": {},
    "one_compile_process": {"TORCHINDUCTOR_COMPILE_THREADS": "1"},
    "switch_interval_0.05ms": {"BENCH_SWITCH_INTERVAL": "0.00005"},
    "switch_interval_5ms": {"BENCH_SWITCH_INTERVAL": "0.005"},
}


def stats(records: list[dict]) -> dict:
    if not records:
        return {"jobs": 0}
    return {
        "jobs": len(records),
        "ttft_median_s": statistics.median(r["ttft_s"] for r in records),
        "ttft_max_s": max(r["ttft_s"] for r in records),
        "decode_tokens_per_s_median": statistics.median(
            (r["tokens"] - 1) / max(r["latency_s"] - r["ttft_s"], 1e-6) for r in records
        ),
        "longest_gap_s": max(r["longest_gap_s"] for r in records),
    }


def child() -> None:
    forced = os.environ.get("BENCH_SWITCH_INTERVAL")
    if forced:  # the worker sets 0.5 ms while compiling; this variant sets its own instead
        real = sys.setswitchinterval
        sys.setswitchinterval = lambda value: real(float(forced) if value < 0.005 else value)
    import handler
    from bench.workload import QUESTIONS, data_uri, run_job

    class Gate(threading.Event):  # the compile starts when the gate opens, not at the first answer
        def set(self):
            pass

    handler.COMPILE_AFTER_FIRST_ANSWER_S = 600
    engine = handler.get_engine()
    engine.compiler.answered = Gate()
    jobs = iter(range(10**6))

    def one() -> dict:
        index = next(jobs)
        job = {
            "id": f"j{index}",
            "input": {
                "task": "vqa",
                "question": QUESTIONS[index % 5],
                "max_new_tokens": 24,
                "min_new_tokens": 24,
                "image_url": data_uri(448, 448, index),
            },
        }
        record = asyncio.run(run_job(handler, job))
        record.pop("text")
        return record

    before = [one() for _ in range(6)]
    frames: collections.Counter = collections.Counter()
    compiling = threading.Event()

    def sample() -> None:
        while compiling.is_set():
            ident = next((t.ident for t in threading.enumerate() if t.name == "vlm-engine"), None)
            frame = sys._current_frames().get(ident)
            where = []
            while frame is not None and len(where) < 3:
                where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
                frame = frame.f_back
            frames[" < ".join(where)] += 1
            time.sleep(0.02)

    started = time.perf_counter()
    compiling.set()
    threading.Thread(target=sample, daemon=True).start()
    threading.Event.set(engine.compiler.answered)
    during, load = [], []
    while not engine.wait_until_compiled(0) and time.perf_counter() - started < 85:
        during.append(one())
        load.append(os.getloadavg()[0])
    compiled_s = time.perf_counter() - started if engine.wait_until_compiled(0) else None
    compiling.clear()
    after = [one() for _ in range(6)]
    print(
        json.dumps(
            {
                "compile_s": compiled_s,
                "before": stats(before),
                "during": stats(during),
                "after": stats(after),
                "load_average_1min_max": max(load, default=None),
                "engine_thread_where": frames.most_common(12),
            }
        )
    )


def main() -> None:
    from bench.workload import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()
    import tools.tiny_models as tiny_models

    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"command": " ".join(sys.argv)}
    for name, env in VARIANTS.items():
        caches = tempfile.mkdtemp(prefix="vlm-contention-")
        child_env = {
            **os.environ,
            **env,
            "VLM_MODEL": str(folder),
            "VLM_ALLOW_ANY": "true",
            "VLM_DTYPE": "bf16",
            "VLM_STREAM_INTERVAL_MS": "0",
            "VLM_MAX_BATCH_SIZE": "8",
            "VLM_COMPILE": "true",
            "VLM_COMPILE_CACHE_DIR": caches,
            "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor",
            "TRITON_CACHE_DIR": f"{caches}/triton",
        }
        try:
            done = subprocess.run(
                [sys.executable, "-m", __spec__.name, "--child"],
                cwd=ROOT,
                env=child_env,
                capture_output=True,
                text=True,
                timeout=130,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            results[name] = json.loads(lines[-1]) if lines else {"error": done.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            results[name] = {"error": "timed out after 130 s"}
        (out / "contention.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
