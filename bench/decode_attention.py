"""One layer's decode attention over a paged KV pool (GPU), at Qwen2-VL-2B's text shapes: the gather of
each row's slots up to a length bucket + SDPA (the engine's first paged kernel) against FlexAttention
reading each row's own blocks through a BlockMask (64-token blocks: it takes no smaller) and the engine's
Triton kernel (runpod_vlm/engine/decode_kernel.py); all replayed as CUDA graphs. `--sweep`: the Triton kernel
alone at 16-token blocks over its launch settings (programs aimed at, tokens a tile, warps, pipeline stages), 20
calls a graph, against the settings it ships with.

python -m bench.decode_attention --out OUT [--sweep]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HEADS, KV_HEADS, DIM = 12, 2, 128


def scenarios() -> dict:
    import torch

    return {
        "1 row x 400": [400],
        "16 rows x 300-500": [int(x) for x in torch.randint(300, 500, (16,))],
        "64 rows x 300-500": [int(x) for x in torch.randint(300, 500, (64,))],
        "64 rows x 300-1300": [int(x) for x in torch.randint(300, 1300, (64,))],
        "256 rows x 300-1300": [int(x) for x in torch.randint(300, 1300, (256,))],
        "56 x 400 + 8 x 6000": [400] * 56 + [6000] * 8,
    }


def replayed_us(fn, calls: int = 1) -> float:
    """Microseconds per call of `fn`, recorded `calls` times into one CUDA graph and replayed."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - began) / 200 / calls * 1e6, 2)


def methods(keys, values, block_size: int, lengths: list[int], compiled_flex) -> tuple[dict, dict]:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    from runpod_vlm.engine.decode_kernel import paged_decode_attention

    device = keys.device
    rows, pool_blocks = len(lengths), keys.shape[0] // block_size
    order = torch.randperm(pool_blocks - 1, device=device) + 1  # blocks scattered over the pool
    table = torch.zeros(rows, 8192 // block_size + 1, dtype=torch.long, device=device)
    start = 0
    for row, length in enumerate(lengths):
        held = -(-length // block_size)
        table[row, :held] = order[start : start + held]
        start += held
    length = torch.tensor(lengths, device=device)  # visible tokens (the new one included)
    query = torch.randn(rows, HEADS, 1, DIM, device=device, dtype=keys.dtype)
    span = 256
    while span < max(lengths):
        span *= 2
    offsets = torch.arange(span, device=device)

    def gathered():
        index = table[:, offsets // block_size] * block_size + offsets % block_size
        visible = (offsets[None, :] < length[:, None])[:, None, None, :]
        k, v = keys[index].transpose(1, 2), values[index].transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=visible, enable_gqa=True)

    pool_k = keys.view(1, -1, KV_HEADS, DIM).transpose(1, 2)  # [1, kv heads, slots, dim]
    pool_v = values.view(1, -1, KV_HEADS, DIM).transpose(1, 2)
    full = (length // block_size).to(torch.int32)
    partial = (length % block_size > 0).to(torch.int32)
    remainder, table32 = length % block_size, table.to(torch.int32)

    def flexed():
        mask = BlockMask.from_kv_blocks(
            partial[:, None, None],
            table32.gather(1, full[:, None].long())[:, None, None, :],
            full[:, None, None],
            table32[:, None, None, :],
            BLOCK_SIZE=(128, block_size),
            mask_mod=lambda b, h, q, kv: kv % block_size < remainder[b],
            seq_lengths=(1, keys.shape[0]),
            compute_q_blocks=False,
        )
        return compiled_flex(query, pool_k, pool_v, block_mask=mask, enable_gqa=True)

    def kernel():
        return paged_decode_attention(query, keys, values, table, length, block_size, DIM**-0.5)

    found = {"gather_sdpa": gathered, "triton": kernel}
    if block_size >= 64:
        found["flex"] = flexed
    return found, {"span": span}


def sweep(out: Path) -> None:
    """The kernel's launch settings against the shipped ones, per scenario; the best by the sum of the scenarios'
    times relative to the shipped settings'."""
    import itertools

    import torch

    from runpod_vlm.engine import decode_kernel

    shipped = {name: getattr(decode_kernel, name) for name in ("SPLITS_TARGET", "TILE", "NUM_WARPS", "NUM_STAGES")}
    torch.manual_seed(0)
    keys = torch.randn(2_000_000, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    cases = {name: methods(keys, values, 16, lengths, None)[0] for name, lengths in scenarios().items()}
    references = {name: found["gather_sdpa"]().float() for name, found in cases.items()}
    settings = [shipped] + [
        dict(zip(shipped, values))
        for values in itertools.product((256, 512, 1024, 2048, 4096), (16, 32, 64, 128), (2, 4, 8), (1, 2, 3))
    ]
    results = []
    for setting in settings:
        vars(decode_kernel).update(setting)
        entry = dict(setting)
        try:
            for name, found in cases.items():
                difference = float((found["triton"]().float() - references[name]).abs().max())
                entry[name] = replayed_us(found["triton"], calls=20)
                entry["max_abs_diff"] = max(entry.get("max_abs_diff", 0.0), difference)
        except Exception as error:  # noqa: BLE001 - a setting Triton cannot build (too much shared memory)
            entry["error"] = repr(error)[:200]
        results.append(entry)
        print(json.dumps(entry), flush=True)
    vars(decode_kernel).update(shipped)
    timed = [entry for entry in results if "error" not in entry]
    for entry in timed:
        entry["relative"] = round(sum(entry[name] / timed[0][name] for name in cases) / len(cases), 3)
    best = min(timed, key=lambda entry: entry["relative"])
    print("shipped", json.dumps(timed[0]), "\nbest", json.dumps(best), flush=True)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "shipped": shipped, "best": best}
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode-kernel-sweep.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if args.sweep:
        return sweep(Path(args.out))
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    compiled_flex = torch.compile(flex_attention, dynamic=False)
    results = []
    for block_size in (16, 64):
        keys = torch.randn(4_000_000, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        for name, lengths in scenarios().items():
            found, entry = methods(keys, values, block_size, lengths, compiled_flex)
            entry = {"block_size": block_size, "scenario": name, "rows": len(lengths), **entry}
            reference = found["gather_sdpa"]().float()
            for label, fn in list(found.items())[1:]:
                began = time.perf_counter()
                try:
                    fn()
                    torch.cuda.synchronize()
                    entry[f"{label}_first_call_s"] = round(time.perf_counter() - began, 2)
                    entry[f"{label}_max_abs_diff"] = float((fn().float() - reference).abs().max())
                except Exception as error:  # noqa: BLE001 - recorded, the other methods still measured
                    entry[f"{label}_error"] = repr(error)[:400]
                    del found[label]
            read = sum(lengths) * KV_HEADS * DIM * 2 * 2  # bytes of K and V the rows hold
            for label, fn in found.items():
                try:
                    entry[f"{label}_us"] = replayed_us(fn)
                    entry[f"{label}_GBps"] = round(read / entry[f"{label}_us"] / 1e3, 1)
                except Exception as error:  # noqa: BLE001
                    entry[f"{label}_error"] = repr(error)[:400]
            print(json.dumps(entry), flush=True)
            results.append(entry)
        del keys, values
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    (out / "decode-attention.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
