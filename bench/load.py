"""Where a fresh worker's load time goes, phase by phase, in a fresh process (GPU machine):

    python -m bench.load MODEL_FOLDER [--device-map auto|cuda] > OUT/load.json

Imports, the CUDA context, config, processor, weights (`from_pretrained` as the worker calls it),
and the first forward; beside them, the bare read of the safetensors files onto the GPU
(`safetensors.torch.load_file`), the floor for the weights phase.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

started = time.perf_counter()
phases: dict = {}


def mark(name: str) -> None:
    phases[name] = round(time.perf_counter() - started - sum(phases.values()), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--device-map", default="auto")
    args = parser.parse_args()
    import torch

    mark("import_torch")
    import transformers

    mark("import_transformers")
    torch.zeros(1, device="cuda")
    mark("cuda_context")
    transformers.AutoConfig.from_pretrained(args.folder)
    mark("config")
    processor = transformers.AutoProcessor.from_pretrained(args.folder)
    mark("processor")
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        args.folder, dtype=torch.bfloat16, device_map=args.device_map
    ).eval()
    torch.cuda.synchronize()
    mark("weights_from_pretrained")
    with torch.inference_mode():
        ids = processor.tokenizer("hello", return_tensors="pt").input_ids.cuda()
        model(input_ids=ids)
    torch.cuda.synchronize()
    mark("first_forward")
    del model
    torch.cuda.empty_cache()
    from safetensors.torch import load_file

    tensors = [load_file(f, device="cuda") for f in sorted(Path(args.folder).glob("*.safetensors"))]
    torch.cuda.synchronize()
    mark("bare_safetensors_to_gpu")
    gigabytes = sum(t.numel() * t.element_size() for shard in tensors for t in shard.values()) / 1e9
    print(
        json.dumps(
            {
                "device_map": args.device_map,
                "weights_gb": round(gigabytes, 2),
                "phases_s": phases,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
