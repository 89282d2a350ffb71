"""Where a paged decode step's time goes (GPU): step times by rows and a torch.profiler table.

python bench/paged_profile.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "bench")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--models", default="/tmp/runpod-vlm-bench")
    args = parser.parse_args()
    import logging

    import torch
    from PIL import Image

    import tiny_models

    logging.basicConfig(level=logging.INFO)
    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
    os.environ.update(VLM_MODEL=str(folder), VLM_ALLOW_ANY="true", VLM_DTYPE="bf16")
    import handler
    from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn

    engine = handler.get_engine()
    engine.warm_up()
    engine.wait_until_compiled(300)
    decoder = engine._current_decoder()
    out: dict = {}
    image = Image.new("RGB", (448, 448), (90, 120, 150))
    params = GenerationParams(max_new_tokens=200, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=200)

    def items(n):
        return [GenerationRequest("caption", [Turn("user", [image, "Describe."])], params) for _ in range(n)]

    with torch.inference_mode():
        for rows in (1, 16, 64):
            inputs, _ = engine.adapter.batch_inputs(engine.processor, items(rows), engine.model.device, engine.dtype)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            decoder.prefill(inputs, list(range(rows)), [params] * rows)
            torch.cuda.synchronize()
            out[f"prefill_{rows}_s"] = time.perf_counter() - t0
            for row in range(rows):
                decoder.grow(row, decoder.lengths[row] + 120)
            for name, use_graph in (("eager", False), ("graph", True)):
                decoder.use_graph = use_graph
                decoder.step(8)
                decoder.step(8)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5):
                    decoder.step(8)
                torch.cuda.synchronize()
                out[f"step_{rows}_{name}_ms"] = 1000 * (time.perf_counter() - t0) / 40
            if rows == 64:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    decoder.use_graph = False
                    decoder.step(8)
                    torch.cuda.synchronize()
                (Path(args.out) / "profile_eager_step.txt").write_text(
                    prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
                )
            for row in range(rows):
                decoder.release(row)
            out[f"graphs_{rows}"] = [list(k) for k in decoder.graphs]
        inputs, _ = engine.adapter.batch_inputs(engine.processor, items(16), engine.model.device, engine.dtype)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        torch.cuda.synchronize()
        out["generate_16x32_s"] = time.perf_counter() - t0
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            torch.cuda.synchronize()
        (Path(args.out) / "profile_generate.txt").write_text(
            prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        )
    print(json.dumps(out, indent=2))
    (Path(args.out) / "profile.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
