"""One layer's attention in a prefill graph (GPU), at Qwen2-VL-2B's text shapes: the engine's packed sequences
and the padding's sequence (engine/prefill_graphs.py) through FlashAttention, replayed as a CUDA graph, with the
padding attending to the rest of the keys' bucket (before) against as many keys as it has tokens (now); and whether
the real sequences' outputs are the same either way.

python -m bench.prefill_attention --out OUT
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from bench.decode_attention import DIM, HEADS, KV_HEADS, replayed_us

ROOT = Path(__file__).resolve().parent.parent


def scenarios() -> dict:
    """name -> (each sequence's new tokens, each sequence's keys): as a batch-1 job and a burst reach the graphs."""
    import random

    random.seed(0)
    mixed = [random.randint(300, 1300) for _ in range(10)]
    return {
        "a repeated image's last chunk (15 tokens after 336 cached)": ([15], [351]),
        "a new image's prompt after the cached system prompt (319 after 32)": ([319], [351]),
        "11 new 448x448 prompts": ([356] * 11, [356] * 11),
        "22 new 448x448 prompts": ([356] * 22, [356] * 22),
        "10 new mixed prompts (300-1,300 tokens)": (mixed, mixed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch

    from runpod_vlm.engine import varlen
    from runpod_vlm.engine.prefill_graphs import _starts, bucket, key_bucket, token_bucket

    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, (lengths, key_lengths) in scenarios().items():
        tokens, keys = sum(lengths), sum(key_lengths)
        padded_tokens, padded_keys, entries = token_bucket(tokens), key_bucket(keys), bucket(len(lengths) + 1, 2) + 1
        query = torch.randn(padded_tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        key, value = (torch.randn(padded_keys, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        query_starts = torch.tensor(_starts(lengths, padded_tokens, entries), dtype=torch.int32, device="cuda")
        padding = min(padded_tokens - tokens, padded_keys - keys)
        layouts = {"before": padded_keys, "now": keys + padding}  # where the padding's keys end
        row: dict = {"tokens": [tokens, padded_tokens], "keys": [keys, padded_keys], "sequences": len(lengths)}
        outputs = {}
        for layout, end in layouts.items():
            key_starts = torch.tensor(_starts(key_lengths, end, entries), dtype=torch.int32, device="cuda")
            attend = functools.partial(
                varlen.causal, query, key, value, query_starts, padded_tokens, None, key_starts, padded_keys
            )
            outputs[layout] = attend()[:tokens]
            row[f"{layout}_us"] = replayed_us(attend, 10)
        row["real_outputs_equal"] = bool(torch.equal(outputs["before"], outputs["now"]))
        row["now_vs_before"] = round(row["now_us"] / row["before_us"], 3)
        results[name] = row
        print(name, row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_attention.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
