"""The vision tower's small passes, eager against replayed as CUDA graphs (engine/vision_graphs.py), at Qwen2-VL-2B
shapes with random weights on the GPU:

    python -m bench.vision_graphs --out OUT            # GPU: OUT/vision_graphs.json
    python -m bench.vision_graphs --out OUT --tiny     # a tiny fp32 model on the CPU: checks the script runs

For each set of images: the engine thread's time for the tower's pass (the host's wall time to the GPU's end, median
of 10) run eagerly as before, padded eagerly (a shape's first pass), and replayed; the replayed features against the
eager ones (largest difference), for these images and for other images of the same sizes. Compiling is off: the
engine's background compile would take the GPU meanwhile.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

IMAGE_SETS = {
    "one_448x448": [(448, 448)],
    "one_224x224": [(224, 224)],
    "one_640x480": [(640, 480)],
    "two_448x448_336x224": [(448, 448), (336, 224)],
    "three_448x448": [(448, 448)] * 3,
}


def main() -> None:
    from bench.workload import bench_parser

    parser = bench_parser(__doc__, tiny=True)
    args = parser.parse_args()
    import logging

    import torch

    from bench.workload import bench_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bench_model(args.models, args.tiny)
    os.environ.update(VLM_COMPILE="false")
    import handler
    from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn
    from tools.sample_images import striped

    engine = handler.get_engine()
    decoder = engine.start_decoder()  # the engine thread is not started: nothing else runs on the GPU
    graphs = decoder.vision_graphs
    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "sets": {}}
    results["graphs"] = graphs is not None
    language = engine.model.model
    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False)

    def inputs_of(sizes, turn_over=0):
        images = [striped(size).rotate(90 * turn_over) for size in sizes]
        item = GenerationRequest("vqa", [Turn("user", [*images, "Describe."])], params)
        inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], engine.model.device, engine.dtype)
        return inputs["pixel_values"], inputs["image_grid_thw"]

    def features(pixels, grid):
        with torch.inference_mode():
            return torch.cat(list(language.get_image_features(pixels, grid).pooler_output))

    def timed(pixels, grid, runs=10):
        seconds = []
        for _ in range(runs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            started = time.perf_counter()
            features(pixels, grid)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        return round(statistics.median(seconds) * 1000, 2)

    for name, sizes in IMAGE_SETS.items():
        if args.tiny:
            sizes = [(w // 7, h // 7) for w, h in sizes]
        pixels, grid = inputs_of(sizes)
        entry: dict = {"patches": int(grid.prod(-1).sum()), "eager_ms": timed(pixels, grid)}
        eager = features(pixels, grid)
        results["sets"][name] = entry
        if graphs is None:
            continue
        with graphs.engaged():
            entry["padded_eager_ms"] = timed(pixels, grid, runs=1)
            with torch.inference_mode():
                while graphs.wanted:
                    graphs.capture_one(decoder.step_graphs.memory())
            replays = graphs.replays
            entry["replayed_ms"] = timed(pixels, grid)
            replayed = features(pixels, grid)
            other_pixels, other_grid = inputs_of(sizes, turn_over=2)  # other images of the same sizes, replayed
            other = features(other_pixels, other_grid)
            entry["replayed"] = graphs.replays - replays
        entry["max_abs_diff"] = float((replayed.float() - eager.float()).abs().max())
        entry["feature_abs_max"] = float(eager.float().abs().max())
        entry["other_images_max_abs_diff"] = float(
            (other.float() - features(other_pixels, other_grid).float()).abs().max()
        )
        print(name, entry, flush=True)
    results["graphs_recorded"] = len(graphs.entries) if graphs else 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_graphs.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
