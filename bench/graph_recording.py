"""The engine's CUDA graph recordings (`prefill_graphs.record`) on a GPU, printed:

- whether PyTorch's cache of page-locked memory keeps a freed block through `torch.cuda.empty_cache()` and through a
  recording, by `torch.cuda.graph` and by `record` (each line: blocks the cache holds, blocks allocated from CUDA so
  far, blocks given back to CUDA so far);
- what a recording voided midway (the GPU synchronized during it, from its own thread and from another) leaves: the
  next recording into its memory pool, and into a new one as the engine then takes, and their replays.

    python -m bench.graph_recording
"""

import threading

import torch

from runpod_vlm.engine.prefill_graphs import record, usable


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
    voided_recordings()


def voided_recordings() -> None:
    """Each case in a pool of its own: a recording voided midway, then the next recording into the same pool, and
    into a new one where `prefill_graphs.usable` says the engine would take one (`StepGraphs.memory`)."""
    value = torch.zeros(16, device="cuda")

    def from_another_thread():
        value.add_(1)
        synchronizing = threading.Thread(target=torch.cuda.synchronize)
        synchronizing.start()
        synchronizing.join()
        value.add_(1)

    def doubled(pool) -> str:
        graph = torch.cuda.CUDAGraph()
        try:
            record(graph, pool, lambda: value.mul_(2))
        except Exception as error:
            return f"failed: {type(error).__name__}: {str(error)[:100]}"
        value.fill_(3)
        graph.replay()
        torch.cuda.synchronize()
        return f"replays 3 -> {value[0].item():g} (6 expected)"

    for name, voiding in (("on its own thread", torch.cuda.synchronize), ("from another thread", from_another_thread)):
        pool = torch.cuda.MemPool()
        try:
            record(torch.cuda.CUDAGraph(), pool.id, voiding)
            print(f"synchronized {name}: the recording ended")
        except Exception as error:
            print(f"synchronized {name}: the recording failed: {type(error).__name__}: {str(error)[:100]}")
        print(f"  usable(pool): {usable(pool.id)}; the next recording into the same pool {doubled(pool.id)}")
        print(f"  the next recording into a new pool {doubled(torch.cuda.MemPool().id)}")
    # Last, as it may leave the allocator broken: the same with torch.cuda.graph, into a pool of its own.
    pool = torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool):
            torch.cuda.synchronize()
    except Exception as error:
        print(f"torch.cuda.graph, synchronized on its own thread: failed: {type(error).__name__}")
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool):
            value.mul_(2)
        print("  the next torch.cuda.graph recording into its pool ended")
    except Exception as error:
        print(f"  the next torch.cuda.graph recording into its pool failed: {str(error)[:100]}")


if __name__ == "__main__":
    main()
