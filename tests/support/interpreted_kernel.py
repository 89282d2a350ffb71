"""The GPU kernels on the CPU, through Triton's interpreter: run as a process of its own, with TRITON_INTERPRET=1
set before Triton is imported (tests/test_decode_kernel.py and tests/test_fp8.py start it). Prints JSON.

    python tests/interpreted_kernel.py kernel          # the decode kernel against gather + SDPA
    python tests/interpreted_kernel.py engine FOLDER   # a tiny model's concurrent answers with it
    python tests/interpreted_kernel.py fp8             # FP8's weight-only product against the dequantized one
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Triton is imported"

import torch  # noqa: E402

from runpod_vlm.engine import decode_kernel  # noqa: E402

BLOCK = 16


def gathered(query, keys, values, table, seen, window=0, chunk=0):
    offsets = torch.arange(table.shape[1] * BLOCK)
    index = table[:, offsets // BLOCK] * BLOCK + offsets % BLOCK
    newest = seen[:, None] - 1
    visible = offsets[None, :] <= newest
    if window:
        visible &= offsets[None, :] > newest - window
    if chunk:
        visible &= offsets[None, :] // chunk == newest // chunk
    visible = visible[:, None, None, :]
    k, v = keys[index].transpose(1, 2), values[index].transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=visible, enable_gqa=True)


def kernel_cases() -> list[dict]:
    """Rows of 1 token (an idle row reads block 0's first slot) to several tiles, at 1, 4 and 32 splits,
    with 2 and 3 query heads per KV head (3 is padded to the kernel's group of 16); all tokens, a sliding
    window's last 20, a chunk of 32's."""
    torch.manual_seed(0)
    found = []
    shapes = [(4, 2, target, 0, 0) for target in (1, 64, 512)] + [(6, 2, target, 0, 0) for target in (1, 64, 512)]
    shapes += [(4, 2, target, window, chunk) for target in (1, 512) for window, chunk in ((20, 0), (0, 32))]
    for heads, kv_heads, target, window, chunk in shapes:
        decode_kernel.SPLITS_TARGET = target
        keys = torch.randn(96 * BLOCK, kv_heads, 16)
        values = torch.randn_like(keys)
        lengths = [1, 5, 16, 17, 64, 65, 300]
        table = torch.zeros(len(lengths), 24, dtype=torch.long)
        free = (torch.randperm(95) + 1).tolist()  # blocks scattered over the pool, 0 left out
        for row, length in enumerate(lengths):
            for column in range(-(-length // BLOCK)):
                table[row, column] = free.pop()
        table[0, 0] = 0  # an idle row: block 0
        seen = torch.tensor(lengths)
        query = torch.randn(len(lengths), heads, 1, 16)
        out = decode_kernel.paged_decode_attention(query, keys, values, table, seen, BLOCK, 16**-0.5, window, chunk)
        splits = max(1, min(32, target // (len(lengths) * kv_heads)))
        difference = float((out - gathered(query, keys, values, table, seen, window, chunk)).abs().max())
        found.append(
            {"heads": heads, "kv_heads": kv_heads, "splits": splits, "window": window, "chunk": chunk}
            | {"max_abs_diff": difference}
        )
    return found


def engine_answers(folder: str) -> dict:
    """Concurrent jobs of different lengths with every decode step through the kernel, and each alone
    through generate()."""
    os.environ.update(VLM_MODEL=folder, VLM_ALLOW_ANY="true", VLM_DEVICE_MAP="cpu", VLM_SYNC_INTERVAL="3")
    decode_kernel.usable = lambda model: True
    decode_kernel.SPLITS_TARGET = 32  # 2 splits at 8 rows: the merge runs, the interpreter stays quick
    import handler
    from runpod_vlm.answers import generate_all
    from tools.sample_images import data_uri, striped

    engine = handler.get_engine()
    jobs = [
        {"task": "caption", "image_url": data_uri(striped((48, 40))), "max_new_tokens": 12, "min_new_tokens": 12},
        {"messages": [{"role": "user", "content": "Hi."}], "max_new_tokens": 20, "min_new_tokens": 20},
        {"task": "vqa", "image_url": data_uri(striped((64, 56))), "question": "What?", "max_new_tokens": 7},
        {"messages": [{"role": "user", "content": " ".join(f"w{n}" for n in range(40))}], "max_new_tokens": 5},
    ]
    items = [handler.read_job_item(dict(job, logprobs=True), engine.settings, engine.model_id, None)[1] for job in jobs]
    batched = generate_all(engine, items)
    solo = [engine.alone.generate(item) for item in items]
    drift = [
        max(abs(b["logprob"] - s["logprob"]) for b, s in zip(one.logprobs, alone.logprobs))
        for one, alone in zip(batched, solo)
    ]
    return {
        "kernel_used": engine.start_decoder().decode_kernel,
        "equal": [b.raw_text == s.raw_text for b, s in zip(batched, solo)],
        "logprob_drift": drift,
        "tokens": [b.completion_tokens for b in batched],
        "prompt_tokens": [b.prompt_tokens for b in batched],
    }


def fp8_cases() -> list[dict]:
    """The weight-only product at 1 to 64 rows, outputs narrow and wide (over 64 columns a multiprocessor, two
    here) and not a multiple of their tiles, K not a multiple of its stride, in 1 to 3 splits of K (chosen by
    `tiles` or given); in float32, which the interpreter multiplies exactly (its bf16 products are wrong)."""
    from runpod_vlm.engine import fp8

    fp8._multiprocessors = lambda device: 2
    fp8.SPLIT_MIN_K = 128
    torch.manual_seed(0)
    found = []
    shapes = [(1, 40, 200), (2, 40, 600), (5, 100, 96), (16, 130, 300), (17, 200, 64), (64, 48, 520), (33, 136, 136)]
    configs = [None] * len(shapes) + [(16, 64, 2, 3), (32, 32, 2, 2), (64, 32, 2, 2)]
    for (rows, N, K), config in zip(shapes + [(3, 40, 600), (20, 70, 100), (50, 90, 600)], configs):
        weight, scale = fp8.quantized_rows(torch.randn(N, K))
        x = torch.randn(rows, K)
        out = fp8.weight_only_matmul(x, weight, scale.reshape(-1), config)
        expected = x @ (weight.float() * scale).t()
        splits = (config or fp8.tiles(rows, N, K, x.device))[3]
        found.append(
            {"rows": rows, "N": N, "K": K, "splits": splits, "max_abs_diff": float((out - expected).abs().max())}
        )
    return found


if __name__ == "__main__":
    if sys.argv[1] == "kernel":
        print(json.dumps(kernel_cases()))
    elif sys.argv[1] == "fp8":
        print(json.dumps(fp8_cases()))
    else:
        print(json.dumps(engine_answers(sys.argv[2])))
