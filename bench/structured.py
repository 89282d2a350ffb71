"""Structured output's cost on the GPU: 64 concurrent jobs through handler.handler, all free, all
constrained to a JSON schema, and half of each, at Qwen2-VL-2B shapes (random weights, bf16); per
case the mean decode step (engine.timings: decode seconds over decode steps), each case run once
untimed first so that its graphs are recorded before it is measured.

    python -m bench.structured --out DIR      # writes DIR/structured.json and prints it

The tiny builder's tokenizer has a few hundred tokens (the vocabulary of the logits is the model's
151,936), so llguidance's mask filling is cheaper here than with the real tokenizer: see
bench/grammar_masks.py for that CPU cost. What this measures is the rest: the mask applied inside each
step and the engine stepping one token at a time while a constrained row runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def job(n: int, constrained: bool, schema: dict) -> dict:
    request = {"messages": [{"role": "user", "content": f"Item {n} as JSON."}], "max_new_tokens": 96}
    if constrained:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}
    else:
        request["min_new_tokens"] = 48
    return {"id": f"j{n}", "input": request}


async def run(handler, jobs: list[dict]) -> dict:
    engine = handler.get_engine()
    before = dict(engine.timings)
    started = time.perf_counter()
    outputs = await asyncio.gather(*(handler.local_test_answer(j) for j in jobs))
    wall = time.perf_counter() - started
    phases = {k: v - before.get(k, 0) for k, v in engine.timings.items()}
    tokens = sum(o["usage"]["completion_tokens"] for o in outputs)
    constrained = [o for o, j in zip(outputs, jobs) if "response_format" in j["input"]]
    stopped = [o for o in constrained if o.get("finish_reason") == "stop"]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "decode_steps": phases.get("decode_steps", 0),
        "decode_step_ms": 1000 * phases.get("decode_s", 0) / max(phases.get("decode_steps", 0), 1),
        "constrained_jobs": len(constrained),
        "constrained_stopped": len(stopped),  # the rest ran out of max_new_tokens mid-answer
        "stopped_answers_parsed": sum(1 for o in stopped if _parses(o["response"])),
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    from bench.workload import bench_parser

    parser = bench_parser(__doc__)
    args = parser.parse_args()
    import torch

    import tools.tiny_models as tiny_models
    from tools.sample_schemas import SCHEMAS

    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
        torch.cuda.empty_cache()
    os.environ.update(
        VLM_MODEL=str(folder), VLM_ALLOW_ANY="true", VLM_DTYPE="bf16", VLM_MAX_BATCH_SIZE="64",
        VLM_MAX_CONCURRENCY="64", VLM_MAX_BATCH_REQUESTS="64", VLM_COMPILE="false",
    )  # fmt: skip
    import handler

    handler.get_engine()
    schema = SCHEMAS["nested"]
    results = {"device": torch.cuda.get_device_name(), "compiled": False}
    for name, constrained in (
        ("free", lambda n: False),
        ("constrained", lambda n: True),
        ("half", lambda n: n % 2 == 0),
    ):
        jobs = [job(n, constrained(n), schema) for n in range(64)]
        asyncio.run(run(handler, jobs))  # warm: this case's graphs and the grammar cache
        results[name] = asyncio.run(run(handler, jobs))
        print(name, results[name], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
