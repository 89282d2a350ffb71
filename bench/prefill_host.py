"""Whether a burst's prefill is bound by the host or by the GPU (GPU): the engine thread's time to launch one
prefill of new 448x448 one-image items, against the time until the GPU has run it.

    python -m bench.prefill_host --out OUT [--groups 1,4,16,23]

Random weights at Qwen2-VL-2B shapes, DEFAULT settings. For each group size, three groups of new items prepared as
the intake prepares them, then placed as the engine places them (`on_device`, `collate`, `prefill_launch`):
`launch_s` the call (it does not wait for the GPU), `done_s` until the GPU has finished, and the GPU's busy time
(torch.profiler). Then the same beside threads that read and prepare other jobs, as in a burst (`beside`; they also
make those jobs' JPEGs, which a burst's threads do not), and the 16-item launch under cProfile
(prefill-host-python.txt). Launch well below done: the GPU bounds the prefill; launch near done: the host does.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import threading
import time
from pathlib import Path

from bench.timeline import gpu_busy
from bench.workload import bench_model, bench_parser, data_uri, gpu_parity

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = bench_parser(__doc__, tiny=True)
    parser.add_argument("--groups", default="1,4,16,23")
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = Path(args.out)
    bench_model(args.models, args.tiny)
    import handler
    from runpod_vlm.engine.intake import on_device
    from runpod_vlm.vocabulary import GenerationParams

    engine = handler.get_engine()
    engine.warm_up()
    engine.wait_until_compiled(600)
    results: dict = {"engine": engine.describe(), "gpu_parity": gpu_parity(handler, engine)}
    decoder, intake = engine.start_decoder(), engine.intake()
    images = iter(range(3_000_000, 4_000_000))
    one_token = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=1)

    def prepared(count: int) -> list:
        jobs = [{"task": "vqa", "question": "What is shown?", "image_url": data_uri(448, 448, next(images))}
                for _ in range(count)]  # fmt: skip
        return [intake.prepare(handler.read_job_item(job, *handler.served_model())[1]) for job in jobs]

    def placed(group: list, profiler=None) -> dict:
        params = [one_token] * len(group)
        rows = decoder.free_rows()[: len(group)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        parts = [on_device(inputs, engine.model.device, floating_only=True) for inputs, _, _ in group]
        inputs = parts[0] if len(group) == 1 else engine.adapter.collate(engine.processor, parts)
        launched = decoder.prompts.prefill_launch(inputs, rows, params, None, [0] * len(group))
        launch = time.perf_counter() - started
        if profiler:
            profiler.disable()
        decoder.read(launched)
        done = time.perf_counter() - started
        for row in rows:
            decoder.release(row)
        return {"launch_s": launch, "done_s": done}

    def measured(size: int) -> dict:
        runs = [placed(prepared(size)) for _ in range(3)]
        group = prepared(size)
        with profile(activities=[ProfilerActivity.CPU if args.tiny else ProfilerActivity.CUDA]) as prof:
            placed(group)
        return {
            "launch_s": statistics.median(r["launch_s"] for r in runs),
            "done_s": statistics.median(r["done_s"] for r in runs),
            "gpu": gpu_busy(prof),
        }

    sizes = [int(size) for size in args.groups.split(",")]
    with torch.inference_mode():
        placed(prepared(4))  # warm
        results["alone"] = {size: measured(size) for size in sizes}
        print("alone", json.dumps(results["alone"]), flush=True)
        stop = threading.Event()

        def busy_reader():  # a burst's reading and intake threads: base64, JPEG, the processor
            while not stop.is_set():
                prepared(1)

        readers = [threading.Thread(target=busy_reader, daemon=True) for _ in range(3)]
        for reader in readers:
            reader.start()
        try:
            results["beside"] = {size: measured(size) for size in sizes}
        finally:
            stop.set()
            for reader in readers:
                reader.join()
        print("beside", json.dumps(results["beside"]), flush=True)
        profiler = cProfile.Profile()
        placed(prepared(16), profiler)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(70)
        (out / "prefill-host-python.txt").write_text(text.getvalue())
    (out / "prefill-host.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
