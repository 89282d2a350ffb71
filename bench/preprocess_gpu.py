"""Image processing on the CPU (the model card's path) against the GPU (`VLM_PREPROCESS_ON_GPU`), Qwen2-VL's processor:

    python bench/preprocess_gpu.py

how many of the bf16 pixel values differ, by how much at most, over 20 images of 448x448 to 1280x720; and one
processor call's time on one thread with the GPU otherwise idle, per image size. Printed (GPU).
"""

from __future__ import annotations

import base64
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "bench")]

from serving import SIZES, bench_model, data_uri  # noqa: E402


def main() -> None:
    import torch
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(bench_model("/tmp/runpod-vlm-bench"))
    images = [
        Image.open(io.BytesIO(base64.b64decode(data_uri(w, h, n).split(",", 1)[1]))).convert("RGB")
        for n, (w, h) in enumerate(SIZES * 4)
    ]
    stream = torch.cuda.Stream()  # as the intake's: not behind other work
    worst, differing, total = 0.0, 0, 0
    for image in images:
        on_cpu = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"].to(torch.bfloat16)
        with torch.cuda.stream(stream):
            on_gpu = processor.image_processor(images=[image], return_tensors="pt", device="cuda")["pixel_values"]
            on_gpu = on_gpu.to(torch.bfloat16)
        stream.synchronize()
        difference = (on_cpu.float() - on_gpu.float().cpu()).abs()
        worst = max(worst, difference.max().item())
        differing += int((difference > 0).sum())
        total += difference.numel()
    print(f"bf16 pixels: {differing} of {total} differ, worst {worst}")
    prompt = "<|vision_start|><|image_pad|><|vision_end|>What is shown?"
    for device in (None, "cuda"):
        times = []
        for image in images[: len(SIZES)] * 3:
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                inputs = processor(
                    text=[prompt], images=[image], return_tensors="pt", **({"device": device} if device else {})
                )
                inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
            stream.synchronize()
            times.append(time.perf_counter() - started)
        last = [round(1000 * t, 1) for t in times[len(SIZES) : 2 * len(SIZES)]]  # the second round: warm
        print(device or "cpu", "ms a processor call,", " / ".join(f"{w}x{h}" for w, h in SIZES), last)


if __name__ == "__main__":
    main()
