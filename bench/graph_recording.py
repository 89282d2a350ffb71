"""Whether PyTorch's cache of page-locked memory keeps a freed block through `torch.cuda.empty_cache()` and through a
CUDA graph recording, by `torch.cuda.graph` and by the engine's `prefill_graphs.record` (GPU; printed):

    python bench/host_cache.py

Each line: (blocks the cache holds, blocks allocated from CUDA so far, blocks given back to CUDA so far).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runpod_vlm.engine.prefill_graphs import record  # noqa: E402


def blocks() -> tuple:
    stats = torch.cuda.host_memory_stats()
    return stats.get("allocations.current"), stats.get("num_host_alloc"), stats.get("num_host_free")


def pinned():
    return torch.empty(8 << 20, dtype=torch.uint8).pin_memory()


def main() -> None:
    block = pinned()
    block.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    del block
    print("freed after a copy", blocks())
    block = pinned()
    print("the same size again (held)", blocks())
    del block
    torch.cuda.empty_cache()
    print("after torch.cuda.empty_cache", blocks())
    graph, value = torch.cuda.CUDAGraph(), torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        value.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        value.add_(1)
    print("after a graph recording", blocks())
    block = pinned()
    del block
    print("the same size again", blocks())
    record(torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), lambda: value.add_(1))
    print("after the engine's recording (prefill_graphs.record)", blocks())
    block = pinned()
    del block
    print("the same size again", blocks())


if __name__ == "__main__":
    main()
