"""Where a paged decode step's time goes (GPU): step times by rows and a torch.profiler table; and where a
prefill of 16 mixed jobs (448x448 to 1280x720, one image each) goes: the processor, the vision tower, the
language model, the rest, together against each item alone, with a profiler table (`prefill_uniform`: 23
448x448 jobs, one prefill at the default token budget); the vision tower eager against
torch.compile(dynamic=True) on two sets of 16 mixed images, and each of its blocks compiled alone
(`vision_blocks`: regional compilation, one graph for every block), and (`vision_packed`) transformers' per-image
SDPA against the packed attention; prefills of shapes met for the first time against the second, with and
without cuDNN's attention (`shapes`); a batch-1 job's time to first token split into reading, intake and
admission, for a new image and for the same job again; (`intake`) 64 one-token jobs at once with each
phase's spans on a timeline; and (`prefill_layers`) prompts of 40 to 8,000 tokens prefilled through the decoder
layers compiled with dynamic shapes and eagerly.

python -m bench.profile --out OUT [--projections-apart]
    [--parts decode,prefill,prefill_uniform,vision,vision_blocks,vision_packed,shapes,ttft,intake,prefill_layers]

With the default KV pool the GPU has too little room left for `vision_packed` after other parts: run it
with VLM_KV_CACHE_TOKENS=600000. The vision tower's parts are in bench/vision_profile.py, those through the handler's
path (`ttft`, `intake`) in bench/serving_profile.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from bench.vision_profile import mixed_items

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    from bench.serving_profile import intake_timeline, ttft_breakdown
    from bench.vision_profile import vision_blocks_compiled, vision_compile, vision_packed
    from bench.workload import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--parts", default="decode,prefill")
    parser.add_argument(
        "--projections-apart",
        action="store_true",
        help="every projection its own product in the compiled step (the engine before engine/projections.py)",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    import logging

    import torch
    from PIL import Image

    import tools.tiny_models as tiny_models

    logging.basicConfig(level=logging.INFO)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    folder = Path(args.models) / "qwen2-vl-2b"
    if not (folder / "config.json").exists():
        tiny_models.build("qwen2-vl", folder, "qwen2-vl-2b", device="cuda", dtype="bf16")
    os.environ.update(VLM_MODEL=str(folder), VLM_ALLOW_ANY="true", VLM_DTYPE="bf16")
    import handler
    from runpod_vlm.engine import engine as engine_module
    from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn

    if args.projections_apart:
        engine_module.share_weights = lambda model: 0

    engine = handler.get_engine()
    engine.warm_up()
    engine.wait_until_compiled(300)
    decoder = engine.start_decoder()
    out: dict = {}
    image = Image.new("RGB", (448, 448), (90, 120, 150))
    params = GenerationParams(max_new_tokens=200, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=200)

    def items(n):
        return [GenerationRequest("caption", [Turn("user", [image, "Describe."])], params) for _ in range(n)]

    measures = {  # part -> its key in the results, what measures it, whether it runs under inference mode
        "prefill": ("prefill_16_mixed", lambda: prefill_breakdown(engine, decoder, Path(args.out)), True),
        "vision_packed": ("vision_packed", lambda: vision_packed(engine), True),
        "shapes": ("new_shapes", lambda: new_shapes(engine, decoder), True),
        "prefill_uniform": (
            "prefill_23_uniform",
            lambda: prefill_breakdown(engine, decoder, Path(args.out), True),
            True,
        ),
        "vision": ("vision_compile", lambda: vision_compile(engine), True),
        "vision_blocks": ("vision_blocks_compiled", lambda: vision_blocks_compiled(engine), True),
        "ttft": (
            "ttft_batch1",
            lambda: ttft_breakdown(handler, engine, Path(args.out)),
            False,
        ),  # the handler's own path
        "intake": ("intake_64", lambda: intake_timeline(handler, engine), False),
        "prefill_layers": ("prefill_layers", lambda: prefill_layers(engine, decoder), True),
    }
    for part, (key, measure, inference) in measures.items():
        if part in parts:
            with torch.inference_mode() if inference else contextlib.nullcontext():
                out[key] = measure()
            print(json.dumps(out[key], indent=2), flush=True)
            (Path(args.out) / "profile.json").write_text(json.dumps(out, indent=2))
    with torch.inference_mode():
        for rows in (1, 16, 64) if "decode" in parts else ():
            inputs, _ = engine.adapter.batch_inputs(engine.processor, items(rows), engine.model.device, engine.dtype)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            decoder.prompts.prefill(inputs, list(range(rows)), [params] * rows)
            torch.cuda.synchronize()
            out[f"prefill_{rows}_s"] = time.perf_counter() - t0
            for row in range(rows):
                decoder.grow(row, decoder.lengths[row] + 120)
            for name, use_graph in (("eager", False), ("graph", True)):
                decoder.step_graphs.enabled = use_graph
                decoder.step(8)
                decoder.step(8)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5):
                    decoder.step(8)
                torch.cuda.synchronize()
                out[f"step_{rows}_{name}_ms"] = 1000 * (time.perf_counter() - t0) / 40
            if rows == 64:
                from torch.profiler import ProfilerActivity, profile

                for name, use_graph in (("eager", False), ("graph", True)):  # a graph's kernels show as launched
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        decoder.step_graphs.enabled = use_graph
                        decoder.step(8)
                        torch.cuda.synchronize()
                    (Path(args.out) / f"profile_{name}_step.txt").write_text(
                        prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
                    )
            for row in range(rows):
                decoder.release(row)
            out[f"graphs_{rows}"] = [list(k) for k in decoder.step_graphs.graphs]
        if "decode" not in parts:
            return print(json.dumps(out, indent=2)), (Path(args.out) / "profile.json").write_text(json.dumps(out))
        inputs, _ = engine.adapter.batch_inputs(engine.processor, items(16), engine.model.device, engine.dtype)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        torch.cuda.synchronize()
        out["generate_16x32_s"] = time.perf_counter() - t0
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            torch.cuda.synchronize()
        (Path(args.out) / "profile_generate.txt").write_text(
            prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        )
    print(json.dumps(out, indent=2))
    (Path(args.out) / "profile.json").write_text(json.dumps(out, indent=2))


def new_shapes(engine, decoder) -> dict:
    """Prefills of shapes not seen before (groups of 448x448 one-image items, question lengths drawn): each
    group's first prefill against its second, with transformers' SDPA choosing its backend (cuDNN on the
    H200), and with cuDNN's left out (a first call of a shape builds its plan)."""
    import random

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn

    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=1)
    rng, result = random.Random(5), {}
    image = mixed_items(engine, 1, 6, 6000, params, [(448, 448)])[0].turns[0].parts[0]
    backends = {
        "default": None,
        "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }
    for name, allowed in backends.items():
        runs = []
        for count in (5, 9, 13, 17, 21):
            words = " ".join("word" for _ in range(rng.randrange(5, 60)))
            items = [GenerationRequest("vqa", [Turn("user", [image, f"{words} {n}?"])], params) for n in range(count)]
            inputs, _ = engine.adapter.batch_inputs(engine.processor, items, engine.model.device, engine.dtype)
            seconds = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel(allowed) if allowed else contextlib.nullcontext():
                    decoder.prompts.prefill(inputs, list(range(count)), [params] * count)
                torch.cuda.synchronize()
                seconds.append(round(time.perf_counter() - t0, 4))
                for row in range(count):
                    decoder.release(row)
            runs.append({"items": count, "shape": list(inputs["input_ids"].shape), "first_s": seconds[0],
                         "second_s": seconds[1]})  # fmt: skip
        result[name] = runs
    return result


def prefill_layers(engine, decoder) -> dict:
    """One text prompt of about n tokens prefilled into a free row (the packed path; a chunk runs the same layers),
    through the decoder layers the background compile left (compiled with dynamic shapes, here at every size, below
    `COMPILED_PREFILL_FROM_TOKENS` too) and eagerly: the engine thread's whole time, host included; medians of 5
    after a warm-up."""
    import statistics

    import torch

    from runpod_vlm.engine import compile as compile_module
    from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn

    layers = compile_module.decoder_layers(engine.model)
    installed = [vars(layer).get("forward") for layer in layers]
    forwards = {type(layer): forward.args[0] for layer, forward in zip(layers, installed) if forward is not None}
    threshold = compile_module.COMPILED_PREFILL_FROM_TOKENS
    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False)
    row = decoder.free_rows()[0]
    result: dict = {"compiled_layers": sum(f is not None for f in installed)}
    for tokens in (40, 300, 1000, 2000, 4000, 8000):
        item = GenerationRequest("chat", [Turn("user", ["a " * (tokens // 2)])], params)
        inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], engine.model.device, engine.dtype)
        timings = {}
        for mode in ("compiled", "eager") if forwards else ("eager",):
            for layer in layers:
                vars(layer).pop("forward", None)
            if mode == "compiled":
                compile_module.COMPILED_PREFILL_FROM_TOKENS = 0
                compile_module.run_layers_compiled(layers, forwards)
                compile_module.COMPILED_PREFILL_FROM_TOKENS = threshold
            runs = []
            for _ in range(6):
                torch.cuda.synchronize()
                started = time.perf_counter()
                decoder.prompts.prefill(inputs, [row], [params])
                torch.cuda.synchronize()
                runs.append(time.perf_counter() - started)
                decoder.release(row)
            timings[f"{mode}_ms"] = 1000 * statistics.median(runs[1:])
        result[str(inputs["input_ids"].shape[1])] = timings
    for layer, forward in zip(layers, installed):  # as the engine ran them
        vars(layer).pop("forward", None)
        if forward is not None:
            layer.forward = forward
    return result


def prefill_breakdown(engine, decoder, out: Path, uniform: bool = False) -> dict:
    """16 mixed one-image jobs (`uniform`: 23 of 448x448, one prefill's worth at the default token budget)
    prefilled as the engine does (together: packed, or padded for a family that does not pack), and each alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runpod_vlm.vocabulary import GenerationParams

    params = GenerationParams(max_new_tokens=8, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=8)
    items = (
        mixed_items(engine, 23, 0, 900, params, [(448, 448)]) if uniform else mixed_items(engine, 16, 0, 900, params)
    )
    tag = "uniform" if uniform else "mixed"
    model, spent, started = engine.model, {"vision_s": 0.0, "language_s": 0.0}, {}

    def timed(module, name):  # synchronizing hooks, removed before the profile and the parts after this one
        def before(*_):
            torch.cuda.synchronize()
            started[name] = time.perf_counter()

        def after(*_):
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - started[name]

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    hooks = timed(model.model.visual, "vision_s") + timed(model.model.language_model, "language_s")

    def prefill(group):
        t0 = time.perf_counter()
        inputs, _ = engine.adapter.batch_inputs(engine.processor, group, "cpu", engine.dtype)
        t1 = time.perf_counter()
        inputs = inputs.to(model.device)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        decoder.prompts.prefill(inputs, list(range(len(group))), [params] * len(group))
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for row in range(len(group)):
            decoder.release(row)
        tokens = int(inputs["attention_mask"].sum())
        return {"processor_s": t1 - t0, "to_gpu_s": t2 - t1, "prefill_s": t3 - t2, "tokens": tokens,
                "padded_tokens": int(inputs["input_ids"].numel())}  # fmt: skip

    prefill(items[:4])  # warm
    result = {}
    for name, groups in (("together", [items]), ("each_alone", [[item] for item in items])):
        spent.update(vision_s=0.0, language_s=0.0)
        runs = [prefill(group) for group in groups]
        total = {key: sum(run[key] for run in runs) for key in runs[0]}
        total.update(spent)
        total["rest_s"] = total["prefill_s"] - spent["vision_s"] - spent["language_s"]
        result[name] = total
    for hook in hooks:
        hook.remove()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(items)
    averages = prof.key_averages()
    (out / f"profile_prefill_{tag}_cuda.txt").write_text(averages.table(sort_by="cuda_time_total", row_limit=40))
    (out / f"profile_prefill_{tag}_cpu.txt").write_text(averages.table(sort_by="cpu_time_total", row_limit=30))
    print(json.dumps(result, indent=2), flush=True)
    return result


if __name__ == "__main__":
    main()
