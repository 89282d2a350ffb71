"""Draw bench/results/chart.png from bench/results/results.json (needs matplotlib, no GPU).

python -m bench.plot [--results bench/results/results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(Path(__file__).parent / "results" / "results.json"))
    args = parser.parse_args()
    path = Path(args.results)
    results = json.loads(path.read_text())
    shapes = [key for key in results if key.startswith("qwen2-vl-")]

    figure, (throughput, naive) = plt.subplots(1, 2, figsize=(12, 4.5))
    for shape in shapes:
        curve = results[shape]["448x448"]["throughput"]
        batches = sorted(curve, key=int)
        throughput.plot(
            [int(b) for b in batches],
            [curve[b]["tokens_per_s"] for b in batches],
            marker="o",
            label=f"{shape} bf16 (compiled)",
        )
        for mode in ("4bit", "8bit"):
            quantized = results[shape].get(mode, {}).get("throughput")
            if quantized:
                points = sorted(quantized, key=int)
                throughput.plot(
                    [int(b) for b in points],
                    [quantized[b]["tokens_per_s"] for b in points],
                    marker="s",
                    linestyle="--",
                    label=f"{shape} {mode} (bitsandbytes)",
                )
    throughput.set(
        xscale="log",
        yscale="log",
        xlabel="requests in one call (batch)",
        ylabel="generated tokens/s",
        title="Throughput through handler(job), 448x448, 128 tokens",
    )
    throughput.set_xticks([1, 4, 16, 64], labels=["1", "4", "16", "64"])
    throughput.legend(fontsize=8)
    throughput.grid(alpha=0.3)

    labels, naive_s, handler_s = [], [], []
    for shape in shapes:
        pair = results[shape].get("naive_vs_handler_16")
        if pair:
            labels.append(f"{shape}\n{pair['speedup']:.0f}x faster")
            naive_s.append(pair["naive_s"])
            handler_s.append(pair["handler_s"])
    positions = range(len(labels))
    naive.bar([p - 0.2 for p in positions], naive_s, width=0.4, label="naive loop (one generate each)")
    naive.bar([p + 0.2 for p in positions], handler_s, width=0.4, label="handler, one batched call")
    naive.set(yscale="log", ylabel="wall time, s", title="16 requests, 448x448, 128 tokens each")
    naive.set_xticks(list(positions), labels=labels)
    naive.set_ylim(0.3, max(naive_s) * 8)  # room for the legend above the bars
    naive.legend(fontsize=8)
    naive.grid(alpha=0.3, axis="y")

    figure.suptitle(
        f"runpod-vlm on {results['device']} (random weights at real shapes; "
        f"torch {results['torch']}, transformers {results['transformers']})",
        fontsize=10,
    )
    figure.tight_layout()
    out = path.with_name("chart.png")
    figure.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
