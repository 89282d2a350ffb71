"""Gemma 3 and Phi-4-multimodal in the batch, and prompts of one burst sharing their blocks, on the GPU (random
weights, bf16, default settings, separate jobs through the handler's path):

    python -m bench.families --out OUT [--parts gemma3,phi4,shared_prompt]

  gemma3         Gemma-3-4B shapes: 64 mixed jobs at once (1 to 2 images of 896x896, 8 of them past the 1,024-token
                 sliding window), batched, against the first 8 through the one-at-a-time path (`generate()`, as every
                 Gemma 3 request past its window was answered before it joined the batch) in the same process; and
                 greedy parity of 4 jobs (2 past the window) with eager `generate`.
  phi4           Phi-4-multimodal shapes: 64 mixed jobs at once, 8 of them crossing LongRoPE's original 4,096 tokens
                 while they decode (each such row prefilled again there), batched, against the first 8 through the
                 one-at-a-time path (`generate()`, as every Phi-4 request that could pass 4,096 tokens was answered
                 before) in the same process; and greedy parity of 4 jobs that stay within it with eager `generate`.
  shared_prompt  Qwen2-VL-2B shapes: 64 jobs at once with one 1,000-token system prompt, each its own 448x448 image
                 and question, against 64 whose system prompts differ from their first word: prompt tokens computed
                 and tokens a second. Each burst runs twice (the first warms its shapes), each time with prompts no
                 earlier burst sent.

Each part first waits for the worker's background compile (at most 240 s), as a worker serves once it is done.
Results: OUT/families.json, written as each figure comes."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from bench.workload import QUESTIONS, bench_model, bench_parser, concurrent, data_uri, mixed_jobs

RULES = " ".join(f"Rule {n}: answer in plain words and name what you see." for n in range(20))  # ~1,000 tokens


def long_job(index: int, rng: random.Random) -> dict:
    """Two new images and a long question: past Gemma 3's 1,024-token window before its answer starts."""
    images = [{"type": "image_url", "image_url": {"url": data_uri(640, 480, 9000 + 2 * index + n)}} for n in (0, 1)]
    text = {"type": "text", "text": f"Compare these. {RULES[:700]}"}
    tokens = rng.randint(64, 256)
    request = {"messages": [{"role": "user", "content": [*images, text]}], "max_new_tokens": tokens}
    return {"id": f"long-{index}", "input": {**request, "min_new_tokens": tokens, "stream": True}}


def gemma3(models: Path, tiny: bool, out: Path) -> dict:
    handler, engine = served_family(models, tiny, "gemma3", "gemma3-4b")
    rng = random.Random(3)
    jobs = mixed_jobs(56, seed=11) + [long_job(n, rng) for n in range(8)]
    rng.shuffle(jobs)
    parity_jobs = [mixed_jobs(2, seed=13)[0], mixed_jobs(2, seed=14)[0], long_job(20, rng), long_job(21, rng)]
    return batched_against_alone(handler, engine, jobs, parity_jobs, out, tiny, warm_seed=12)


def crossing_job(index: int, rng: random.Random) -> dict:
    """One 448x448 image and 3,390 bytes of question (a token each): 3,950 prompt tokens, past 4,096 as it answers."""
    image = {"type": "image_url", "image_url": {"url": data_uri(448, 448, 30000 + index)}}
    text = {"type": "text", "text": f"Question {index}. " + " ".join(RULES for _ in range(4))[:3390]}
    tokens = rng.randint(160, 256)
    request = {"messages": [{"role": "user", "content": [image, text]}], "max_new_tokens": tokens}
    return {"id": f"crossing-{index}", "input": {**request, "min_new_tokens": tokens, "stream": True}}


def phi4(models: Path, tiny: bool, out: Path) -> dict:
    handler, engine = served_family(models, tiny, "phi4-multimodal", "phi4-multimodal-6b")
    recomputed = []
    recompute = engine.scheduler.recompute

    def counted(rows, release):  # the rows prefilled again (not one that goes on as it is)
        recompute(rows, release)
        recomputed.extend(row for row in rows if row not in engine.scheduler.running)

    engine.scheduler.recompute = counted
    rng = random.Random(5)
    jobs = mixed_jobs(56, seed=21) + [crossing_job(n, rng) for n in range(8)]
    rng.shuffle(jobs)
    return batched_against_alone(
        handler, engine, jobs, mixed_jobs(4, seed=23), out, tiny, warm_seed=22, counts=lambda: len(recomputed)
    )


def served_family(models: Path, tiny: bool, family: str, shape: str):
    """The handler and its engine serving `family` at `shape` (`bench_model`)."""
    bench_model(str(models), tiny, family, shape)
    import handler

    return handler, handler.get_engine()


def batched_against_alone(handler, engine, jobs, parity_jobs, out: Path, tiny: bool, warm_seed: int, counts=None):
    """Once compiled and warm: `jobs` at once, batched; `parity_jobs` served against generate() alone; the first 8
    of `jobs` through the one-at-a-time path. `counts()`: the rows prefilled again (Phi-4), if given."""
    import torch

    from runpod_vlm.answers import generate_all

    warm = compiled(engine)
    asyncio.run(concurrent(handler, mixed_jobs(16, seed=warm_seed)))  # warm: graphs and kernels
    before = dict(engine.timings)
    batched = asyncio.run(concurrent(handler, jobs))
    batched["prompt_tokens"] = engine.timings["prompt_tokens"] - before.get("prompt_tokens", 0)
    if counts is not None:
        batched["rows_prefilled_again"] = counts()
    result = {"device": "cpu" if tiny else torch.cuda.get_device_name(), **warm, "batched_64": batched}
    save(out, result)
    asked = [{**job["input"], "logprobs": True, "top_logprobs": 2} for job in parity_jobs]
    items = [handler.read_job_item(request, engine.settings, engine.model_id)[1] for request in asked]
    result["parity"] = []
    for answer, item in zip(generate_all(engine, items), items):
        try:
            result["parity"].append(parity(answer, engine.alone.generate(item)))
        except Exception as error:  # generate() fails on a generated image token (its image embedding finds no image)
            result["parity"].append(repr(error))
    save(out, result)
    engine.continuous = False  # the one-at-a-time path: each item through generate()
    try:
        alone = asyncio.run(concurrent(handler, jobs[:8]))
    except RuntimeError as error:  # a job whose answer took an image placeholder: generate() fails at the next step
        return {**result, "one_at_a_time_8": {"error": str(error)[:500]}}
    return {**result, "one_at_a_time_8": alone, "speedup": batched["tokens_per_s"] / alone["tokens_per_s"]}


def parity(served, alone) -> dict:
    """Whether a served answer's tokens are generate()'s; where they part, at which token, and how far apart
    generate()'s two likeliest tokens were there (a gap of a few hundredths is a tie that bf16's sums can break
    either way)."""
    tokens = [[entry["token"] for entry in answer.logprobs] for answer in (served, alone)]
    first = next((n for n, (a, b) in enumerate(zip(*tokens)) if a != b), None)
    if first is None and len(tokens[0]) == len(tokens[1]):
        return {"equal": True}
    if first is None:
        return {"equal": False, "lengths": [len(t) for t in tokens]}
    best, second = (entry["logprob"] for entry in alone.logprobs[first]["top_logprobs"][:2])
    return {"equal": False, "first_difference": first, "generate_top2_gap": round(best - second, 4)}


def shared_prompt_jobs(burst: int, shared: bool) -> list[dict]:
    jobs = []
    for n in range(64):
        system = f"Variant {burst}{'' if shared else f'-{n}'}. {RULES}"
        image = {"type": "image_url", "image_url": {"url": data_uri(448, 448, 20000 + 100 * burst + n)}}
        user = [image, {"type": "text", "text": QUESTIONS[n % len(QUESTIONS)]}]
        request = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        jobs.append({"id": f"p{n}", "input": {**request, "max_new_tokens": 64, "min_new_tokens": 64, "stream": True}})
    return jobs


def shared_prompt(models: Path, tiny: bool, out: Path) -> dict:
    import torch

    bench_model(str(models), tiny)
    import handler

    engine = handler.get_engine()
    results = {"device": "cpu" if tiny else torch.cuda.get_device_name(), **compiled(engine)}
    for burst, (name, shared) in enumerate([("distinct", False), ("shared", True)] * 2):
        before = dict(engine.timings)
        run = asyncio.run(concurrent(handler, shared_prompt_jobs(burst, shared)))
        counted = {k: engine.timings[k] - before.get(k, 0) for k in ("prompt_tokens", "prefix_cached_tokens")}
        run.update(counted, computed_tokens=counted["prompt_tokens"] - counted["prefix_cached_tokens"])
        run["prefill_s"] = engine.timings["prefill_s"] - before.get("prefill_s", 0)
        results[name] = run  # the second of each, warm
        save(out, results)
    return results


def compiled(engine, seconds: float = 240) -> dict:
    """Warm the worker up and wait for its background compile, as a worker serves once it is done."""
    started = time.perf_counter()
    engine.warm_up()
    return {"compiled": engine.wait_until_compiled(seconds), "compile_wait_s": time.perf_counter() - started}


def save(out: Path, result: dict) -> None:
    """OUT/families.json as far as the part got (a part stopped by its time limit keeps its earlier figures)."""
    (out / "families.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


def main() -> None:
    parser = bench_parser(__doc__, tiny=True)
    parser.add_argument("--parts", default="gemma3,shared_prompt")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    part = args.parts
    if "," in part:  # each part in a process of its own: one model loaded a process
        import subprocess
        import sys

        for one in part.split(","):
            command = [sys.executable, "-m", "bench.families", "--out", str(out / one), "--parts", one]
            subprocess.run([*command, "--models", args.models, *(["--tiny"] if args.tiny else [])], check=False)
        return
    started = time.perf_counter()
    result = {"gemma3": gemma3, "phi4": phi4, "shared_prompt": shared_prompt}[part](Path(args.models), args.tiny, out)
    save(out, {**result, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
