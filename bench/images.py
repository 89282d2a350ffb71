"""Issue 22's benchmark: new images at GPU speed and images sent again, through the handler's path, at
DEFAULT settings (the image-embedding cache and prefix caching on), random weights at Qwen2-VL-2B shapes on the GPU:

    python -m bench.images --out OUT            # GPU
    python -m bench.images --out OUT --tiny     # a tiny fp32 model on the CPU: checks the script runs

- prefill_64: 64 jobs of one new 448x448 image and max_new_tokens 1 sent at once, after a first such
  burst (first_burst_64): new images a second (target >= 200), with the engine's phases (intake, prefill); and
  LATER_BURSTS more such bursts (later_bursts_64), until the shapes the bursts meet are recorded;
- repeated_image: one job, then the same job again (its image's embedding cached): time to first token
  of the hit against the miss, median of 5 pairs of fresh images (target <= 30%); repeated_image_1280x720 the same
  at 1280x720;
- chat_4_turns: a 4-turn chat whose first turn holds 2 images, every later request resending them in
  its history: each turn's time to first token, and turns 2-4 against turn 1 (target <= 40%);
- prefill_graphs_off: both again with short prefills run eagerly, not replayed as CUDA graphs (as before them);
- the image cache's hits and misses, and the prompt tokens read from cached KV blocks (prefix caching),
  over the run.
Results go to OUT/images.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.workload import (
    QUESTIONS,
    bench_model,
    bench_parser,
    concurrent_records,
    counted_since,
    counters,
    data_uri,
    run_alone,
    run_job,
    wait_for_recordings,
)

ROOT = Path(__file__).resolve().parent.parent

LATER_BURSTS = 6


def job(name: str, images: list[str], tokens: int, history: list | None = None, question: str = QUESTIONS[0]) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    messages = [*(history or []), {"role": "user", "content": [*content, {"type": "text", "text": question}]}]
    return {"id": name, "input": {"messages": messages, "max_new_tokens": tokens, "min_new_tokens": tokens}}


def main() -> None:
    parser = bench_parser(__doc__, tiny=True)
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bench_model(args.models, args.tiny)
    size, count, tokens = (64, 8, 4) if args.tiny else (448, 64, 16)
    os.environ.update(VLM_STREAM_INTERVAL_MS="0")
    import handler

    engine = handler.get_engine()
    engine.warm_up()
    compiled = engine.wait_until_compiled(600)  # False at once on the CPU (--tiny)
    results: dict = {"command": " ".join(sys.argv), "engine": engine.describe(), "compiled": compiled}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "images.json").write_text(json.dumps(results, indent=2))

    asyncio.run(run_job(handler, job("warm", [data_uri(size, size, 9999)], 1)))

    def burst(first_image: int) -> dict:
        jobs = [job(f"p{i}", [data_uri(size, size, first_image + i)], 1) for i in range(count)]  # not timed
        before = counters(engine)
        started = time.perf_counter()
        asyncio.run(concurrent_records(handler, jobs))
        seconds = time.perf_counter() - started
        phases = counted_since(engine, before)
        decoder = engine.start_decoder()
        kinds = {"prefill_graphs": decoder.prefill_graphs, "vision_graphs": decoder.vision_graphs}
        recorded = {kind: len(graphs.graphs) for kind, graphs in kinds.items() if graphs is not None}  # so far
        return {"jobs": count, "seconds": seconds, "images_per_s": count / seconds, "phases": phases, **recorded}

    # A process's first burst of this size also meets its first prefill shapes (kernels loaded, the KV
    # pool's first use: bench/results/profile-intake-timeline-d279a0c.json); the target is the steady state.
    results["first_burst_64"] = burst(10000)
    results["prefill_64"] = burst(0)
    # A burst's groups vary with the jobs' arrival, and each new shape is recorded at the burst's idle moments (0.3-0.6
    # s of the second burst): how many bursts until a worker has recorded them.
    results["later_bursts_64"] = [burst(1000 * n) for n in range(20, 20 + LATER_BURSTS)]
    save()

    def repeated_image(first_image: int, width: int = size, height: int = size) -> dict:
        pairs, same_answer = [], 0
        for n in range(5):
            same = job(f"r{n}", [data_uri(width, height, first_image + n)], tokens)
            miss, hit = (run_alone(handler, engine, same) for _ in range(2))
            pairs.append((miss["ttft_s"], hit["ttft_s"]))
            same_answer += miss["text"] == hit["text"]  # the hit's prompt through its cached blocks, the rest anew
        miss, hit = statistics.median(m for m, _ in pairs), statistics.median(h for _, h in pairs)
        return {"ttft_miss_s": miss, "ttft_hit_s": hit, "hit_vs_miss": hit / miss, "hit_answers_as_miss": same_answer}

    def chat(first_image: int) -> dict:
        images, history, turns = [data_uri(size, size, first_image), data_uri(size, size, first_image + 1)], [], []
        for turn in range(4):  # the images come in the first turn; every later request resends them in its history
            this = job(f"c{turn}", images if turn == 0 else [], tokens, history, QUESTIONS[turn % len(QUESTIONS)])
            turns.append(run_alone(handler, engine, this)["ttft_s"])
            history = this["input"]["messages"] + [{"role": "assistant", "content": f"Answer {turn}."}]
        return {"ttft_s": turns, "turns_2_4_vs_1": statistics.mean(turns[1:]) / turns[0]}

    wait_for_recordings(engine)  # the bursts' new shapes
    results["repeated_image"] = repeated_image(5000)
    # The size of SGLang's figure for its encoder cache (issue 22): the miss's vision pass and prefill grow with it.
    results["repeated_image_1280x720"] = repeated_image(5100, *((96, 64) if args.tiny else (1280, 720)))
    results["chat_4_turns"] = chat(7000)
    save()
    decoder = engine.start_decoder()
    graphs = decoder.prefill_graphs
    if graphs is not None:  # (tokens, keys, starts) recorded, and the seconds recording them took the engine
        results["prefill_graphs"] = {"shapes": sorted(graphs.graphs), "capture_s": graphs.capture_s}
    # The same again, other images, with short prefills eager: the engine before they were replayed as graphs.
    decoder.prefill_graphs = None
    results["prefill_graphs_off"] = {"repeated_image": repeated_image(6000), "chat_4_turns": chat(8000)}
    decoder.prefill_graphs = graphs
    cache = engine.image_cache
    results["image_cache"] = None if cache is None else {"hits": cache.hits, "misses": cache.misses, "held": cache.held}
    timings = engine.timings
    results["prefix_cache"] = {
        "prompt_tokens": timings["prompt_tokens"],
        "cached_tokens": timings["prefix_cached_tokens"],
    }
    save()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
