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

python bench/paged_profile.py --out OUT [--projections-apart]
    [--parts decode,prefill,prefill_uniform,vision,vision_blocks,vision_packed,shapes,ttft,intake,prefill_layers]

With the default KV pool the GPU has too little room left for `vision_packed` after other parts: run it
with VLM_KV_CACHE_TOKENS=600000.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "bench")]


def main() -> None:
    from serving import bench_parser

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

    import tiny_models

    logging.basicConfig(level=logging.INFO)
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
    decoder = engine._current_decoder()
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
            decoder.prefill(inputs, list(range(rows)), [params] * rows)
            torch.cuda.synchronize()
            out[f"prefill_{rows}_s"] = time.perf_counter() - t0
            for row in range(rows):
                decoder.grow(row, decoder.lengths[row] + 120)
            for name, use_graph in (("eager", False), ("graph", True)):
                decoder.use_graph = use_graph
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
                        decoder.use_graph = use_graph
                        decoder.step(8)
                        torch.cuda.synchronize()
                    (Path(args.out) / f"profile_{name}_step.txt").write_text(
                        prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
                    )
            for row in range(rows):
                decoder.release(row)
            out[f"graphs_{rows}"] = [list(k) for k in decoder.graphs]
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


def mixed_items(engine, count: int, seed: int, first_image: int, params, sizes=None) -> list:
    """`count` one-image vqa items of sizes drawn with `seed`, images numbered from `first_image`."""
    import base64
    import random

    from serving import QUESTIONS, SIZES, data_uri

    from runpod_vlm.media import decode_image
    from runpod_vlm.vocabulary import GenerationRequest, Turn

    rng, items = random.Random(seed), []
    for n in range(count):
        uri = data_uri(*rng.choice(sizes or SIZES), first_image + n)
        image = decode_image(base64.b64decode(uri.split(",", 1)[1]), engine.settings.media, "image")
        items.append(GenerationRequest("vqa", [Turn("user", [image, rng.choice(QUESTIONS)])], params))
    return items


def vision_compile(engine) -> dict:
    """The vision tower over 16 mixed images: eager, then compiled with dynamic shapes (first call, steady),
    then 16 other images through the compiled one (does it recompile?)."""
    import torch

    from runpod_vlm.vocabulary import GenerationParams

    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=1)
    language = engine.model.model

    def pixels(seed):
        items = mixed_items(engine, 16, seed, 100 * seed, params)
        inputs, _ = engine.adapter.batch_inputs(engine.processor, items, "cuda", engine.dtype)
        return inputs["pixel_values"], inputs["image_grid_thw"]

    def timed(batch, runs=3):
        seconds = []
        for _ in range(runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            language.get_image_features(*batch)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        return seconds

    first, second = pixels(1), pixels(2)
    result = {"patches": [int(first[1].prod(-1).sum()), int(second[1].prod(-1).sum())]}
    result["eager_s"] = [min(timed(first)), min(timed(second))]
    eager_visual = language.visual
    language.visual = torch.compile(eager_visual, dynamic=True)
    try:
        result["compiled_first_call_s"] = timed(first, runs=1)[0]
        result["compiled_s"] = [min(timed(first)), None]
        result["compiled_other_images_first_call_s"] = timed(second, runs=1)[0]
        result["compiled_s"][1] = min(timed(second))
    except Exception as error:  # what stops it is the finding
        result["compile_error"] = repr(error)[:500]
    finally:
        language.visual = eager_visual
    return result


def vision_blocks_compiled(engine) -> dict:
    """The vision tower with each block compiled (`torch.compile(dynamic=True)` on every block: one graph
    serves them all, the packed attention inside) against eager, over 23 448x448 images (one prefill's
    worth), 16 mixed and 5 448x448: each set's first call, its steady time, whether a new set compiled
    again (checked under the "fail_on_recompile" stance), and how far the features move."""
    import torch

    from runpod_vlm.vocabulary import GenerationParams

    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=1)
    language = engine.model.model
    sets = {
        "23_uniform": mixed_items(engine, 23, 7, 7000, params, sizes=[(448, 448)]),
        "16_mixed": mixed_items(engine, 16, 8, 8000, params),
        "5_uniform": mixed_items(engine, 5, 9, 9000, params, sizes=[(448, 448)]),
    }
    batches = {}
    for name, items in sets.items():
        inputs, _ = engine.adapter.batch_inputs(engine.processor, items, engine.model.device, engine.dtype)
        batches[name] = (inputs["pixel_values"], inputs["image_grid_thw"])

    def features(batch):
        output = language.get_image_features(*batch)
        embeds = getattr(output, "pooler_output", output)
        return torch.cat([torch.cat(list(e)) if isinstance(e, (tuple, list)) else e for e in embeds])

    def timed(batch, runs=3):
        seconds = []
        for _ in range(runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            features(batch)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        return min(seconds)

    result = {name: {"patches": int(b[1].prod(-1).sum()), "eager_s": timed(b)} for name, b in batches.items()}
    eager = {name: features(b) for name, b in batches.items()}
    blocks = language.visual.blocks
    try:
        for block in blocks:
            block.compile(dynamic=True)
        for name, batch in batches.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                with (
                    torch.compiler.set_stance("fail_on_recompile") if name != "23_uniform" else contextlib.nullcontext()
                ):
                    compiled = features(batch)
                result[name]["recompiled"] = False
            except Exception as error:  # it needed a new graph: let it compile and time that
                result[name]["recompiled"] = repr(error)[:200]
                compiled = features(batch)
            torch.cuda.synchronize()
            result[name]["first_call_s"] = time.perf_counter() - t0
            result[name]["compiled_s"] = timed(batch)
            result[name]["max_difference"] = (compiled.float() - eager[name].float()).abs().max().item()
    except Exception as error:  # what stops it is the finding
        result["compile_error"] = repr(error)[:500]
    finally:
        for block in blocks:
            block._compiled_call_impl = None  # what Module.compile set
    return result


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
                    decoder.prefill(inputs, list(range(count)), [params] * count)
                torch.cuda.synchronize()
                seconds.append(round(time.perf_counter() - t0, 4))
                for row in range(count):
                    decoder.release(row)
            runs.append({"items": count, "shape": list(inputs["input_ids"].shape), "first_s": seconds[0],
                         "second_s": seconds[1]})  # fmt: skip
        result[name] = runs
    return result


def vision_packed(engine) -> dict:
    """The vision tower over 64 448x448 images in groups of 16 and over 16 mixed ones: transformers' SDPA
    per image against the packed variable-length attention (engine/vision_attention.py), and how far apart."""
    import torch

    from runpod_vlm.engine.vision_attention import NAME
    from runpod_vlm.vocabulary import GenerationParams

    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False, min_new_tokens=1)
    model, language = engine.model, engine.model.model
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    uniform = mixed_items(engine, 64, 4, 4000, params, sizes=[(448, 448)])
    batches = {"64_uniform_in_16s": [uniform[n : n + 16] for n in range(0, 64, 16)]}
    batches["16_mixed"] = mixed_items(engine, 16, 3, 3000, params)
    result = {"allocated_gb_before": torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    for name, groups in batches.items():
        torch.cuda.empty_cache()
        groups = groups if isinstance(groups[0], list) else [groups]
        pixels = []
        for group in groups:
            inputs, _ = engine.adapter.batch_inputs(engine.processor, group, engine.model.device, engine.dtype)
            pixels.append((inputs["pixel_values"], inputs["image_grid_thw"]))
        first, times = {}, {}  # the first batch's features of each (memory: the KV pool leaves little room)
        for implementation in ("sdpa", NAME):
            model.set_attn_implementation({"vision_config": implementation})
            runs = []
            for _ in range(3):
                synchronize()
                t0 = time.perf_counter()
                for batch in pixels:
                    features = language.get_image_features(*batch)
                    first.setdefault(implementation, features)
                    del features
                synchronize()
                runs.append(time.perf_counter() - t0)
            times[implementation] = min(runs)

        def flat(features):
            embeds = getattr(features, "pooler_output", features)
            return torch.cat([torch.cat(list(e)) if isinstance(e, (tuple, list)) else e for e in embeds])

        difference = (flat(first["sdpa"]).float() - flat(first[NAME]).float()).abs().max().item()
        del first, pixels
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result[name] = {"per_image_sdpa_s": times["sdpa"], "packed_s": times[NAME], "max_difference": difference}
    return result


def intake_timeline(handler, engine) -> dict:
    """64 jobs of one new 448x448 image and max_new_tokens 1 sent at once, as bench/images.py, with each
    phase's spans on a timeline: reading (handler threads), intake (its threads), placement (engine
    thread: collate, copy to the GPU, prefill); then the same items read beforehand and submitted at once
    (no handler threads), with two and with four intake threads; and the vision tower alone."""
    import asyncio
    import threading

    import torch
    from images import job
    from serving import concurrent_records, data_uri

    from runpod_vlm.engine.intake import Intake

    spans: dict = {"read": [], "intake": [], "place": []}

    def recorded(name, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spans[name].append((start, time.perf_counter(), len(args[1]) if name == "place" else 1))

        return wrapper

    read, prepare, place = handler.read_job_item, Intake._prepare, type(engine)._place
    handler.read_job_item = recorded("read", read)
    Intake._prepare = recorded("intake", prepare)
    type(engine)._place = recorded("place", place)

    def summary(started: float, ended: float) -> dict:
        result = {"seconds": ended - started, "images_per_s": 64 / (ended - started)}
        result["allocated_gb"] = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        for name, marks in spans.items():
            if marks:
                result[name] = {
                    "count": len(marks),
                    "first_start": min(m[0] for m in marks) - started,
                    "last_end": max(m[1] for m in marks) - started,
                    "busy_sum": sum(m[1] - m[0] for m in marks),
                }
        result["placements"] = [[round(m[0] - started, 3), round(m[1] - m[0], 3), m[2]] for m in spans["place"]]
        for marks in spans.values():
            marks.clear()
        return result

    def through_handler(first_image: int) -> dict:
        jobs = [job(f"t{i}", [data_uri(448, 448, first_image + i)], 1) for i in range(64)]
        started = time.perf_counter()
        asyncio.run(concurrent_records(handler, jobs))
        return summary(started, time.perf_counter())

    def read_first(first_image: int, intake_threads: int) -> dict:
        settings, model_id = handler.served_model()
        items = [
            read(job(f"t{i}", [data_uri(448, 448, first_image + i)], 1)["input"], settings, model_id)[1]
            for i in range(64)
        ]
        engine._intake_of().pool._max_workers = intake_threads
        left, done = [64], threading.Event()

        def listener(event):  # the final Generation or RequestError, once per item
            left[0] -= 1
            if left[0] == 0:
                done.set()

        started = time.perf_counter()
        for item in items:
            engine.submit(item, listener)
        done.wait(120)
        result = summary(started, time.perf_counter())
        engine._intake_of().pool._max_workers = 2
        return result

    result = {"first_burst": through_handler(20000)}  # the first 64-job run meets its shapes for the first time
    result["through_handler"] = through_handler(21000)
    print(json.dumps(result, indent=2), flush=True)
    result["read_first_2_intake_threads"] = read_first(22000, 2)
    result["read_first_4_intake_threads"] = read_first(23000, 4)
    print(json.dumps(result, indent=2), flush=True)
    handler.read_job_item, Intake._prepare, type(engine)._place = read, prepare, place
    try:
        result["vision"] = vision_packed(engine)
    except Exception as error:  # out of memory beside the KV pool: the timeline still counts
        result["vision"] = repr(error)[:300]
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
                decoder.prefill(inputs, [row], [params])
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


def ttft_breakdown(handler, engine, out: Path) -> dict:
    """One job at a time, one 448x448 image, streamed: reading (fetch, decode), submit to prepared (intake),
    prepared to first token (admission, prefill); medians of 5, for new images and for each job sent again
    (image cache and prefix cache hits), once the decode graphs are recorded; and one of each profiled."""
    import statistics
    import threading

    from serving import QUESTIONS, counted_since, counters, data_uri, python_profile, wait_for_recordings

    def once(n: int) -> dict:
        job = {"task": "vqa", "question": QUESTIONS[0], "image_url": data_uri(448, 448, 8000 + n),
               "max_new_tokens": 4, "min_new_tokens": 4}  # fmt: skip
        before = counters(engine)
        marks, first = {"start": time.perf_counter()}, threading.Event()
        settings, model_id = handler.served_model()
        item = handler.read_job_item(job, settings, model_id)[1]
        marks["read"] = time.perf_counter()

        def listener(event):
            if "first" not in marks:
                marks["first"] = time.perf_counter()
                first.set()

        ticket = engine.submit(item, listener, stream=True)
        marks["submitted"] = time.perf_counter()
        ticket.prepared.add_done_callback(lambda _: marks.setdefault("prepared", time.perf_counter()))
        first.wait(30)
        time.sleep(0.05)  # the rest of the job
        # and the graphs it asked for: the next job would wait for a recording, and a profiler's exit, which
        # synchronizes the GPU from this thread, would void it (bench/README.md, sixteenth session)
        wait_for_recordings(engine)
        return {
            "read_ms": 1000 * (marks["read"] - marks["start"]),
            "intake_ms": 1000 * (marks["prepared"] - marks["submitted"]),
            "admission_to_first_token_ms": 1000 * (marks["first"] - marks["prepared"]),
            "total_ms": 1000 * (marks["first"] - marks["start"]),
            "counted": counted_since(engine, before),
        }

    once(100)  # the first prefill makes the KV pool; the decode graphs are then recorded ahead while idle (waited for)
    result = {}
    for name in ("new_image", "same_again"):
        runs = [once(n) for n in range(5)]
        result[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key.endswith("_ms")}
        result[f"{name}_runs"] = runs
    # bench/paged.py's batch 1, through the handler's path (reading off the event loop, the answer streamed): one
    # token, a new image each time, back to back as there and with the recordings each asked for waited for between.
    import asyncio

    from serving import run_job

    def through_handler(n: int, wait: bool) -> dict:
        job = {"id": "t", "input": {"task": "vqa", "question": QUESTIONS[0], "image_url": data_uri(448, 448, n),
               "max_new_tokens": 1}}  # fmt: skip
        before = counters(engine)
        ttft = asyncio.run(run_job(handler, job))["ttft_s"]
        if wait:
            wait_for_recordings(engine)
        return {"ttft_ms": 1000 * ttft, "counted": counted_since(engine, before)}

    for name, first, wait in (("handler_back_to_back", 9000, False), ("handler_waiting", 9100, True)):
        runs = [through_handler(first + n, wait) for n in range(5)]
        result[name] = {"ttft_ms": statistics.median(run["ttft_ms"] for run in runs), "runs": runs}
    from torch.profiler import ProfilerActivity, profile

    for name, n in (("new_image", 200), ("same_again", 0)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result[f"profiled_{name}"] = once(n)
        averages = prof.key_averages()
        (out / f"profile_ttft_{name}_cpu.txt").write_text(averages.table(sort_by="cpu_time_total", row_limit=45))
        (out / f"profile_ttft_{name}_cuda.txt").write_text(averages.table(sort_by="cuda_time_total", row_limit=25))
    # The engine thread's Python calls while it places the job and prefills it (torch.profiler records only this
    # thread's ops); a prompt that starts from cached blocks is prefilled by `_prefill_next_chunk`.
    for name, n in (("new_image", 300), ("same_again", 0)):
        with python_profile(engine, ("_place", "_prefill_next_chunk"), out / f"profile_ttft_{name}_python.txt"):
            result[f"python_profiled_{name}"] = once(n)
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
        decoder.prefill(inputs, list(range(len(group))), [params] * len(group))
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
