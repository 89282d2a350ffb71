"""Batch 1's time to first token in a fresh worker as it meets the CUDA graphs its jobs ask for (GPU; Qwen2-VL-2B
shapes, random weights, default settings): five one-token jobs with a new 448x448 image each, sent back to back
(as `bench/paged.py`'s batch 1 sends them) before and after each of two rounds of 16 mixed jobs checked against
eager `generate`, then with the recordings each job asked for waited for before the next, then back to back again.
Each run: its time to first token (ms) and the engine's counters over it.

    python bench/batch1_recordings.py --out DIR
"""

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "bench")]

from serving import (  # noqa: E402
    QUESTIONS,
    counted_since,
    counters,
    data_uri,
    gpu_parity,
    run_job,
    wait_for_recordings,
)


def main() -> None:
    import torch

    import tiny_models

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="/tmp/runpod-vlm-bench")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
        torch.cuda.empty_cache()
    os.environ.update(VLM_MODEL=str(folder), VLM_ALLOW_ANY="true", VLM_DTYPE="bf16")
    import handler

    engine = handler.get_engine()
    engine.warm_up()
    results: dict = {"compiled": engine.wait_until_compiled(600)}

    def batch1(name: str, first_image: int, wait: bool) -> None:
        runs = []
        for n in range(5):
            job = {"id": "t", "input": {"task": "vqa", "question": QUESTIONS[0],
                   "image_url": data_uri(448, 448, first_image + n), "max_new_tokens": 1}}  # fmt: skip
            before = counters(engine)
            ttft_ms = 1000 * asyncio.run(run_job(handler, job))["ttft_s"]
            runs.append({"ttft_ms": round(ttft_ms, 1), "counted": counted_since(engine, before)})
            if wait:
                wait_for_recordings(engine)
        results[name] = runs
        print(name, [run["ttft_ms"] for run in runs], flush=True)

    batch1("back_to_back_first", 700_000, False)
    results["parity"] = gpu_parity(handler, engine, 16)
    wait_for_recordings(engine)
    batch1("back_to_back_after_parity", 710_000, False)
    results["parity_again"] = gpu_parity(handler, engine, 16)
    wait_for_recordings(engine)
    batch1("back_to_back_after_parity_again", 800_000, False)
    batch1("recordings_waited_for", 720_000, True)
    batch1("back_to_back_again", 730_000, False)
    Path(args.out, "batch1-recordings.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
