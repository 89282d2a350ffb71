"""`bench/profile.py`'s parts on the vision tower (`vision`, `vision_blocks`, `vision_packed`), and the mixed
one-image items its parts use (GPU)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mixed_items(engine, count: int, seed: int, first_image: int, params, sizes=None) -> list:
    """`count` one-image vqa items of sizes drawn with `seed`, images numbered from `first_image`."""
    import base64
    import random

    from bench.workload import QUESTIONS, SIZES, data_uri
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
