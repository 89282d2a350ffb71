"""GPU smoke check of the compiled path: the worker's answers with torch.compile + CUDA graphs against
the same worker with VLM_COMPILE=false, on a tiny random Qwen2-VL (fp32), through handler(job).

    python -m bench.gpu_smoke --out DIR      # writes DIR/gpu_smoke.json and prints it

Reports per request whether the compiled answer's tokens equal the eager one's, whether batched
answers equal solo ones, the finish reasons, and graphs compiled during requests (should be 0); and,
through the CUDA graphs, that a seeded sampled request draws the same tokens alone and batched, and
that logprobs come out (compiled against eager); and that the decode kernel gives the tokens of the
gather + SDPA path it replaced (eager, both).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_job(job: dict):
    """One job through the async handler, as the runpod SDK runs it; its whole output."""
    import asyncio

    import handler

    return asyncio.run(handler.local_test_answer(job))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from torch._dynamo.utils import counters

    import tools.tiny_models as tiny_models
    from tools.sample_images import data_uri, plain, striped

    folder = tiny_models.build("qwen2-vl", Path(tempfile.mkdtemp()) / "qwen2-vl")
    # Two engines in one process: each with a small KV pool (the first one's is not freed when it is replaced).
    os.environ.update(
        VLM_MODEL=str(folder),
        VLM_ALLOW_ANY="true",
        VLM_DTYPE="fp32",
        VLM_MAX_BATCH_SIZE="4",
        VLM_KV_CACHE_TOKENS="65536",
    )
    import handler

    requests = [
        {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 24},
        {"task": "vqa", "question": "what colour?", "image_url": data_uri(plain("red")), "max_new_tokens": 9},
        {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
            "max_new_tokens": 17,
            "min_new_tokens": 17,
        },
    ]
    sampled = {
        "task": "caption",
        "image_url": data_uri(striped()),
        "max_new_tokens": 12,
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.9,
    }

    seeded = dict(sampled, seed=42, max_new_tokens=16)
    with_logprobs = dict(requests[2], logprobs=True, top_logprobs=3, max_new_tokens=8, min_new_tokens=8)

    def answers(compile_: bool) -> dict:
        os.environ["VLM_COMPILE"] = "true" if compile_ else "false"
        handler.reset_engine()
        engine = handler.get_engine()
        engine.warm_up()
        warm_up_s = engine.wait_until_compiled(900) if compile_ else None  # nothing compiles otherwise
        before = int(counters["stats"]["unique_graphs"])
        solo = [run_job({"input": r}) for r in requests]
        batched = run_job({"id": "smoke", "input": {"requests": requests + [sampled]}})["results"]
        seeded_alone = [run_job({"input": seeded})["response"] for _ in range(2)]
        seeded_batched = run_job({"input": {"requests": [sampled, seeded, requests[2]]}})["results"][1]["response"]
        logprobs = run_job({"input": with_logprobs})
        return {
            "seeded_alone_twice_equal": seeded_alone[0] == seeded_alone[1],
            "seeded_batched_equals_alone": seeded_batched == seeded_alone[0],
            "logprobs": logprobs,
            "compiled": engine.compile,
            "warm_up_s": warm_up_s,
            "solo": solo,
            "batched": batched,
            "graphs_compiled_during_requests": int(counters["stats"]["unique_graphs"]) - before,
        }

    compiled, eager = answers(True), answers(False)
    from runpod_vlm.engine import decode_kernel

    kernel_used = decode_kernel.usable(handler.get_engine().model)
    decode_kernel.usable = lambda model: False  # every decode step gathers its rows' slots for SDPA instead
    gathered = answers(False)
    report = {
        "compiled_path_used": compiled["compiled"],
        "warm_up_s": compiled["warm_up_s"],
        "graphs_compiled_during_requests": compiled["graphs_compiled_during_requests"],
        "errors": [a for run in (compiled, eager) for a in run["solo"] + run["batched"] if "error" in a],
        "compiled_equals_eager": [
            c.get("response") == e.get("response") for c, e in zip(compiled["solo"], eager["solo"])
        ],
        "decode_kernel_used": kernel_used,
        "kernel_equals_gather": [  # the greedy answers, solo then batched
            k.get("response") == g.get("response")
            for k, g in zip(eager["solo"] + eager["batched"][:-1], gathered["solo"] + gathered["batched"][:-1])
        ],
        "compiled_batched_equals_solo": [
            b.get("response") == s.get("response") for b, s in zip(compiled["batched"], compiled["solo"])
        ],
        "finish_reasons": [a.get("finish_reason") for a in compiled["batched"]],
        "seeded_alone_twice_equal": [compiled["seeded_alone_twice_equal"], eager["seeded_alone_twice_equal"]],
        "seeded_batched_equals_alone": [compiled["seeded_batched_equals_alone"], eager["seeded_batched_equals_alone"]],
        "logprob_tokens": len(compiled["logprobs"].get("logprobs", [])),
        "logprobs_compiled_minus_eager_max": max(
            (
                abs(c["logprob"] - e["logprob"])
                for c, e in zip(compiled["logprobs"].get("logprobs", []), eager["logprobs"].get("logprobs", []))
            ),
            default=None,
        ),
        "completion_tokens": [a.get("usage", {}).get("completion_tokens") for a in compiled["batched"]],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_smoke.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
