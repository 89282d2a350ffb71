"""The CPU cost of structured output per decode step: llguidance filling the token masks of N constrained
rows (the work the engine thread does between two steps while such rows run), with a byte-level BPE of
a real vocabulary's size trained offline here (the tiny test models' tokenizers have ~300 tokens).

    python -m bench.grammar_masks [--vocab 50000] [--rows 1,16,64] [--out bench/results/grammar-masks-ea7cf4f.json]

Each row follows the tests' "nested" schema with its own random walk through the allowed tokens; the
report is the median milliseconds per step to fill every row's mask and consume its token.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def corpus(limit_bytes: int) -> list[str]:
    """Text to train on: the Python sources and docs of the installed packages."""
    import site

    texts, size = [], 0
    for folder in site.getsitepackages():
        for path in sorted(pathlib.Path(folder).rglob("*.py")):
            try:
                text = path.read_text(errors="ignore")
            except OSError:
                continue
            texts.append(text)
            size += len(text)
            if size > limit_bytes:
                return texts
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="bench/results/grammar-masks-ea7cf4f.json")
    args = parser.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from runpod_vlm.engine.grammar import Grammars
    from tools.sample_schemas import SCHEMAS

    started = time.perf_counter()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus(40_000_000), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    trained_s = time.perf_counter() - started
    grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id, deadline_s=600)
    schema = json.dumps(SCHEMAS["nested"])
    started = time.perf_counter()
    grammars.compiled(schema)  # the tokenizer's setup included, as at boot
    report = {
        "vocab": len(tokenizer),
        "tokenizer_trained_s": trained_s,
        "schema_compile_s": time.perf_counter() - started,
        "threads": torch.get_num_threads(),
        "per_step_ms": {},
    }
    rng = random.Random(0)
    index = torch.arange(len(tokenizer))
    for rows in map(int, args.rows.split(",")):
        matchers = [grammars.start(schema, None).result() for _ in range(rows)]
        times = []
        for _ in range(args.steps):
            live = [m for m in matchers if not m.is_stopped()]
            if not live:
                break
            tick = time.perf_counter()
            masks = grammars.masks(live)
            spent = time.perf_counter() - tick
            bits = (masks[:, index // 32] >> (index % 32)) & 1  # as the decoder unpacks them (not timed)
            chosen = [rng.choice(row.nonzero().flatten().tolist()) for row in bits]  # as a sampled row would take
            tick = time.perf_counter()
            for matcher, token in zip(live, chosen):
                matcher.consume_token(token)
            times.append((spent + time.perf_counter() - tick) * 1000)
        report["per_step_ms"][str(rows)] = {"median": statistics.median(times), "steps": len(times)}
        print(rows, "rows:", report["per_step_ms"][str(rows)], flush=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
