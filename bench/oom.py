"""GPU check of the out-of-memory path with batches that really do not fit (issue 13).

A fresh worker (Qwen2-VL-2B shapes, random weights, eager) is capped with
`torch.cuda.set_per_process_memory_fraction` to its idle memory plus 1.5x what one small job needs:

    python -m bench.oom --out OUT

- 8 small jobs at once: their prefill does not fit together; all must succeed (split in halves);
- 1 large job that does not fit alone, sent with 2 small ones: the large one gets `out_of_memory`,
  the small ones succeed;
- the cap lifted: memory back to the idle level, and the next job answers normally.
Results go to OUT/oom.json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from bench.workload import photo_uri
from runpod_vlm.answers import stream_generation
from runpod_vlm.vocabulary import RequestError

ROOT = Path(__file__).resolve().parent.parent

SMALL, LARGE = 896, 2464  # about 1,024 and 7,744 visual tokens


async def outcome(handler, job: dict) -> dict:
    """One job on the handler's path: its text or its error code."""
    settings, model_id = handler.served_model()
    _, item = await asyncio.to_thread(handler.read_job_item, job["input"], settings, model_id, None)
    result = None
    async for event in stream_generation(handler.get_engine(), item):
        result = event
    if isinstance(result, RequestError):
        return {"id": job["id"], "error": result.code, "message": result.message}
    return {"id": job["id"], "tokens": result.completion_tokens}


def job(name: str, side: int, seed: int) -> dict:
    return {
        "id": name,
        "input": {
            "task": "vqa",
            "question": "What is in the picture?",
            "image_url": photo_uri(side, side, seed),
            "max_new_tokens": 32,
            "min_new_tokens": 32,
        },
    }


def main() -> None:
    from bench.workload import bench_parser

    parser = bench_parser(__doc__)
    args = parser.parse_args()

    import torch

    import tools.tiny_models as tiny_models

    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
        torch.cuda.empty_cache()
    os.environ.update(
        VLM_MODEL=str(folder), VLM_ALLOW_ANY="true", VLM_DTYPE="bf16", VLM_COMPILE="false", VLM_KV_CACHE_TOKENS="65536"
    )
    import handler

    warnings: list[str] = []
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("runpod-vlm").addHandler(
        type(
            "Collect",
            (logging.Handler,),
            {
                "emit": lambda self, record: (
                    warnings.append(record.getMessage()) if record.levelno >= logging.WARNING else None
                )
            },
        )()
    )
    handler.get_engine()

    def run(*jobs: dict) -> list[dict]:
        async def all_at_once():
            return await asyncio.gather(*(outcome(handler, j) for j in jobs))

        return asyncio.run(all_at_once())

    def peak_of(*jobs: dict) -> tuple[float, list[dict]]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        answers = run(*jobs)
        return (torch.cuda.max_memory_allocated() - before) / 2**30, answers

    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    run(job("warm", SMALL, 0))  # graphs captured, allocator warm
    results["small_job_peak_gib"], _ = peak_of(job("small", SMALL, 1))
    results["large_job_peak_gib"], _ = peak_of(job("large", LARGE, 2))
    torch.cuda.empty_cache()
    idle = torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = idle + 1.5 * results["small_job_peak_gib"] * 2**30
    results.update(idle_reserved_gib=idle / 2**30, cap_gib=cap / 2**30)
    results["large_fits_under_cap"] = results["large_job_peak_gib"] < 1.5 * results["small_job_peak_gib"]
    torch.cuda.set_per_process_memory_fraction(cap / total)

    started, seen = time.perf_counter(), len(warnings)
    answers = run(*(job(f"small-{i}", SMALL, 10 + i) for i in range(8)))
    results["eight_small"] = {
        "seconds": time.perf_counter() - started,
        "answers": answers,
        "all_answered": all("tokens" in a for a in answers),
        "oom_warnings": [w for w in warnings[seen:] if "out of GPU memory" in w],
    }
    seen = len(warnings)
    answers = run(job("large", LARGE, 20), job("small-a", SMALL, 21), job("small-b", SMALL, 22))
    results["large_with_two_small"] = {
        "answers": answers,
        "oom_warnings": [w for w in warnings[seen:] if "out of GPU memory" in w],
    }
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    results["reserved_after_gib"] = torch.cuda.memory_reserved() / 2**30
    results["next_job"] = run(job("after", SMALL, 30))[0]
    results["engine_broken"] = handler.get_engine().broken
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "oom.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
