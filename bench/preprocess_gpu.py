"""Image processing on the CPU (the model card's path) against the GPU (`VLM_PREPROCESS_ON_GPU`), Qwen2-VL's processor:

    python -m bench.preprocess_gpu

over 20 images of 448x448 to 1280x720, how many of the bf16 pixel values differ from the CPU's, and by how much at
most: resized on the GPU by the processor, and resized on the host as the worker now does (`host_resized`, the
processor's own steps) with the rest on the GPU; and one processor call's time on one thread, with the GPU otherwise
idle, per image size. Printed (GPU).
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

from bench.workload import SIZES, bench_model, data_uri
from runpod_vlm.families import adapter_for

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    import torch
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(bench_model("/tmp/runpod-vlm-bench"))
    adapter = adapter_for("qwen2_vl")
    images = [
        Image.open(io.BytesIO(base64.b64decode(data_uri(w, h, n).split(",", 1)[1]))).convert("RGB")
        for n, (w, h) in enumerate(SIZES * 4)
    ]
    stream = torch.cuda.Stream()  # as the intake's: not behind other work

    def processed(call, image, device=None, host_resized=False, **kwargs):
        """`call` (the processor or its image processor) on `image`, on `device`, the pixels in bf16 when it returns."""
        if host_resized:
            image = adapter.host_resized(processor, image)
        with torch.cuda.stream(stream):
            inputs = call(images=[image], return_tensors="pt", **({"device": device} if device else {}), **kwargs)
            inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        stream.synchronize()
        return inputs

    def pixels(image, device=None, host_resized=False):
        return processed(processor.image_processor, image, device, host_resized)["pixel_values"].float().cpu()

    for name, host_resized in (("resized on the GPU", False), ("resized on the host", True)):
        worst, differing, total = 0.0, 0, 0
        for image in images:
            difference = (pixels(image) - pixels(image, "cuda", host_resized)).abs()
            worst = max(worst, difference.max().item())
            differing += int((difference > 0).sum())
            total += difference.numel()
        print(f"bf16 pixels {name}: {differing} of {total} differ from the CPU's, worst {worst}")
    prompt = "<|vision_start|><|image_pad|><|vision_end|>What is shown?"
    for name, device, host_resized in (
        ("cpu", None, False),
        ("cuda", "cuda", False),
        ("host resize, cuda", "cuda", True),
    ):
        times = []
        for image in images[: len(SIZES)] * 3:
            started = time.perf_counter()
            processed(processor, image, device, host_resized, text=[prompt])
            times.append(time.perf_counter() - started)
        last = [round(1000 * t, 1) for t in times[len(SIZES) : 2 * len(SIZES)]]  # the second round: warm
        print(name, "ms a processor call,", " / ".join(f"{w}x{h}" for w, h in SIZES), last)


if __name__ == "__main__":
    main()
