"""Download a model's files into the image's Hugging Face cache at `docker build` time.

    python scripts/bake_model.py Qwen/Qwen2-VL-2B-Instruct

Used by the Dockerfile (build arg MODEL); not needed at run time. HF_HOME decides where the files
land (the Dockerfile sets /opt/hf). Only one copy of the weights is kept: when the repository has
safetensors, the duplicate PyTorch/TF/Flax/ONNX/GGUF formats are skipped. A token for gated or
private repositories is read from HF_TOKEN, as huggingface_hub always does.
"""

from __future__ import annotations

import os
import sys

OTHER_WEIGHT_FORMATS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf"]


def bake(repo_id: str, revision: str | None = None) -> str:
    from huggingface_hub import HfApi, snapshot_download

    files = HfApi().list_repo_files(repo_id, revision=revision)
    ignore = OTHER_WEIGHT_FORMATS if any(f.endswith(".safetensors") for f in files) else []
    path = snapshot_download(repo_id, revision=revision, ignore_patterns=ignore or None)
    size = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path, followlinks=True)
        for name in names
    )
    print(f"baked {repo_id} ({size / 1e9:.1f} GB) into {path}")
    return path


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python scripts/bake_model.py REPO_ID [REVISION]")
    bake(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None)
