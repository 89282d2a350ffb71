"""The GPU decode kernel (runpod_vlm/engine/decode_kernel.py) run on the CPU by Triton's interpreter, in a
process of its own (the interpreter must be chosen before Triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).with_name("support") / "interpreted_kernel.py"


def interpreted(*args: str) -> object:
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernel_attends_to_each_rows_own_blocks_as_sdpa_over_them_does():
    cases = interpreted("kernel")
    assert {case["splits"] for case in cases} == {1, 4, 32}
    assert {(case["window"], case["chunk"]) for case in cases} == {(0, 0), (20, 0), (0, 32)}
    for case in cases:
        assert case["max_abs_diff"] < 1e-5, case


@pytest.mark.parametrize("family", ["qwen2-vl", "gemma3"])
def test_concurrent_answers_through_the_kernel_equal_each_jobs_solo_generate(family, tiny_model):
    # Gemma 3's tiny sliding window is 64 tokens: the last job's rows read only their window in one layer.
    answers = interpreted("engine", str(tiny_model(family)))
    assert answers["kernel_used"]
    assert all(answers["equal"]), answers
    assert max(answers["logprob_drift"]) < 1e-5, answers  # reading past the window: 9e-5
    assert answers["tokens"][:2] == [12, 20] and answers["prompt_tokens"][-1] > 64
