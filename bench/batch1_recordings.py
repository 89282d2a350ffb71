"""Batch 1's time to first token in a fresh worker as it meets the CUDA graphs its jobs ask for (GPU; Qwen2-VL-2B
shapes, random weights, default settings): five one-token jobs with a new 448x448 image each, sent back to back
(as `bench/paged.py`'s batch 1 sends them) before and after each of two rounds of 16 mixed jobs checked against
eager `generate`, then with the recordings each job asked for waited for before the next, then back to back again.
Each run: its time to first token (ms) and the engine's counters over it.

    python -m bench.batch1_recordings --out DIR
"""

import json
import logging
from pathlib import Path

from bench.workload import bench_model, bench_parser, gpu_parity, one_token_job, run_alone, wait_for_recordings

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    logging.basicConfig(level=logging.WARNING)
    bench_model(args.models)
    import handler

    engine = handler.get_engine()
    engine.warm_up()
    results: dict = {"compiled": engine.wait_until_compiled(600)}

    def batch1(name: str, first_image: int, wait: bool) -> None:
        records = [run_alone(handler, engine, one_token_job(first_image + n), wait) for n in range(5)]
        runs = [{"ttft_ms": round(1000 * record["ttft_s"], 1), "counted": record["counted"]} for record in records]
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
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "batch1-recordings.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
