"""FP8's few-rows product (engine/fp8.py's `weight_only_matmul`) against bf16's and `_scaled_mm`'s (GPU), at the
language model's shapes of Qwen2-VL-2B or 7B (each projection, and the groups engine/projections.py joins) and 1, 8 and
64 rows: each product recorded 50 times in a CUDA graph, as a decode step runs it, and the graph's replays averaged
(bench/decode_attention.py's `replayed_us`; the result files up to 2fb4f45 took the best of 5 replays); its
weight bytes against the copy bandwidth measured in the same run (the floor), and a sweep of the kernel's tiles and
splits of K beside `tiles`' choice.

    python -m bench.fp8_matmul --out OUT [--no-sweep] [--shape 7b]

Results: OUT/fp8-matmul.json.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

LANGUAGE_MODELS = {"2b": (1536, 8960, 256), "7b": (3584, 18944, 512)}  # Qwen2-VL's: hidden, intermediate, k (or v)


def shapes(hidden: int, intermediate: int, kv: int) -> dict:
    """name -> (N, K) of each projection, and of the groups engine/projections.py joins."""
    return {
        "q/o": (hidden, hidden),
        "k or v": (kv, hidden),
        "q+k+v": (hidden + 2 * kv, hidden),
        "gate or up": (intermediate, hidden),
        "gate+up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
    }


ROWS = (1, 8, 64)
REPLAYS = 50  # calls recorded in one CUDA graph


def copy_bandwidth(torch) -> float:
    """Bytes a second a device-to-device copy of 1 GiB moves (read and written)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    target.copy_(source)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    return 2 * source.numel() * 10 / (start.elapsed_time(end) / 1000)


def main() -> None:
    from bench.decode_attention import replayed_us
    from bench.workload import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--shape", choices=tuple(LANGUAGE_MODELS), default="2b", help="Qwen2-VL's language model")
    args = parser.parse_args()
    import torch

    from runpod_vlm.engine import fp8

    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch)
    results: dict = {"device": torch.cuda.get_device_name(), "copy_GBps": round(bandwidth / 1e9), "shapes": []}
    results["language_model"] = args.shape
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {results['device']}")
    sweep = [(n, k, s, splits) for n in (16, 32, 64) for k in (128, 256) for s in (3, 4) for splits in (1, 2, 4)]
    for name, (N, K) in shapes(*LANGUAGE_MODELS[args.shape]).items():
        weight_bf16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        weight, scale = fp8.quantized_rows(weight_bf16)
        column_scale = scale.reshape(-1).contiguous()
        for rows in ROWS:
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            reference = x.float() @ (weight.float() * scale).t()
            out = fp8.weight_only_matmul(x, weight, column_scale)
            error = float((out.float() - reference).abs().max() / reference.abs().max())
            row = {"shape": name, "N": N, "K": K, "rows": rows, "max_rel_error": error}
            row["floor_us_fp8"] = round(N * K / bandwidth * 1e6, 2)
            row["floor_us_bf16"] = round(2 * N * K / bandwidth * 1e6, 2)
            weight_only = functools.partial(fp8.weight_only_matmul, x, weight, column_scale)
            row["bf16_linear_us"] = round(
                replayed_us(functools.partial(torch.nn.functional.linear, x, weight_bf16), REPLAYS), 2
            )
            row["scaled_mm_us"] = round(
                replayed_us(functools.partial(scaled_mm, torch, fp8, x, weight, scale), REPLAYS), 2
            )
            row["tiles"] = list(fp8.tiles(rows, N, K, x.device))
            row["weight_only_us"] = round(replayed_us(weight_only, REPLAYS), 2)
            if not args.no_sweep:
                timed = {}
                for config in sweep:
                    try:
                        timed[config] = replayed_us(functools.partial(weight_only, config), REPLAYS)
                    except Exception as error:  # a config past the multiprocessor's shared memory
                        timed[config] = float("inf")
                        print(f"  {config}: {type(error).__name__}")
                best = min(timed, key=timed.get)
                row["best_tiles"], row["best_us"] = list(best), round(timed[best], 2)
            print(json.dumps(row))
            results["shapes"].append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8-matmul.json").write_text(json.dumps(results, indent=1) + "\n")


def scaled_mm(torch, fp8, x, weight, scale):
    """The product as FP8's layers ran it before the kernel: `x` quantized per row, then `_scaled_mm` row-wise."""
    quantized, x_scale = fp8.quantized_rows(x)
    return torch._scaled_mm(quantized, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype)


if __name__ == "__main__":
    main()
