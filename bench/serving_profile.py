"""`bench/profile.py`'s parts through the handler's path: a batch-1 job's time to first token (`ttft`) and 64
one-token jobs on a timeline (`intake`) (GPU)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from bench.vision_profile import vision_packed

ROOT = Path(__file__).resolve().parent.parent


def intake_timeline(handler, engine) -> dict:
    """64 jobs of one new 448x448 image and max_new_tokens 1 sent at once, as bench/images.py, with each
    phase's spans on a timeline: reading (handler threads), intake (its threads), placement (engine
    thread: collate, copy to the GPU, prefill); then the same items read beforehand and submitted at once
    (no handler threads), with two and with four intake threads; and the vision tower alone."""
    import asyncio
    import threading

    import torch

    from bench.images import job
    from bench.workload import concurrent_records, data_uri
    from runpod_vlm.engine.intake import Intake
    from runpod_vlm.engine.runner import Runner

    spans: dict = {"read": [], "intake": [], "place": []}

    def recorded(name, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spans[name].append((start, time.perf_counter(), len(args[1]) if name == "place" else 1))

        return wrapper

    read, prepare, place = handler.read_job_item, Intake.prepare, Runner._place
    handler.read_job_item = recorded("read", read)
    Intake.prepare = recorded("intake", prepare)
    Runner._place = recorded("place", place)

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
        engine.intake().pool._max_workers = intake_threads
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
        engine.intake().pool._max_workers = 2
        return result

    result = {"first_burst": through_handler(20000)}  # the first 64-job run meets its shapes for the first time
    result["through_handler"] = through_handler(21000)
    print(json.dumps(result, indent=2), flush=True)
    result["read_first_2_intake_threads"] = read_first(22000, 2)
    result["read_first_4_intake_threads"] = read_first(23000, 4)
    print(json.dumps(result, indent=2), flush=True)
    handler.read_job_item, Intake.prepare, Runner._place = read, prepare, place
    try:
        result["vision"] = vision_packed(engine)
    except Exception as error:  # out of memory beside the KV pool: the timeline still counts
        result["vision"] = repr(error)[:300]
    return result


RUNNER_SPANS = ("_place", "_begin_chunks", "_prefill_next_chunk", "_launch", "hand_out", "accept")
DECODER_SPANS = ("start_rows", "read")
PROMPTS_SPANS = ("_positions", "_on_device", "_language_model_inputs", "prefill_launch", "prefill_chunk")


@contextlib.contextmanager
def spans_of(engine):
    """Within the block, each call of the engine's and its decoder's methods named above (and the intake's
    `prepare`) appended to the list it gives as (name, thread, start, end) in perf_counter seconds."""
    from bench.timeline import Spans

    spans = Spans()
    decoder = engine.start_decoder()
    for owner, names in ((engine.runner, RUNNER_SPANS), (decoder, DECODER_SPANS), (decoder.prompts, PROMPTS_SPANS)):
        for name in names:
            spans.wrap(owner, name)
    spans.wrap(engine.intake(), "prepare")
    try:
        yield spans.marks
    finally:
        spans.unwrap()


def ttft_breakdown(handler, engine, out: Path) -> dict:
    """One job at a time, one 448x448 image, streamed: reading (fetch, decode), submit to prepared (intake),
    prepared to first token (admission, prefill), and each run's calls on its way (`spans_of`); medians of 5, for new
    images and for each job sent again (image cache and prefix cache hits), once the decode graphs are recorded; and
    one of each profiled."""
    import statistics
    import threading

    from bench.workload import QUESTIONS, counted_since, counters, data_uri, python_profile, wait_for_recordings

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

        with spans_of(engine) as spans:
            ticket = engine.submit(item, listener, stream=True)
            marks["submitted"] = time.perf_counter()
            ticket.prepared.add_done_callback(lambda _: marks.setdefault("prepared", time.perf_counter()))
            first.wait(30)
        time.sleep(0.05)  # the rest of the job
        # and the graphs it asked for: the next job would wait for a recording, and a profiler's exit, which
        # synchronizes the GPU from this thread, would void it
        wait_for_recordings(engine)
        return {
            "read_ms": 1000 * (marks["read"] - marks["start"]),
            "intake_ms": 1000 * (marks["prepared"] - marks["submitted"]),
            "admission_to_first_token_ms": 1000 * (marks["first"] - marks["prepared"]),
            "total_ms": 1000 * (marks["first"] - marks["start"]),
            "counted": counted_since(engine, before),
            # ms from submitted: where the engine thread's (and the intake's) time went up to the first token
            "spans_ms": [
                [name, thread, round(1000 * (start - marks["submitted"]), 2), round(1000 * (end - start), 2)]
                for name, thread, start, end in sorted(spans, key=lambda span: span[2])
                if start < marks["first"]
            ],
        }

    once(100)  # its shapes' graphs are then recorded while idle (waited for)
    result = {}
    for name in ("new_image", "same_again"):
        runs = [once(n) for n in range(5)]
        result[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key.endswith("_ms")}
        result[f"{name}_runs"] = runs
    # bench/paged.py's batch 1, through the handler's path (reading off the event loop, the answer streamed): one
    # token, a new image each time, back to back as there and with the recordings each asked for waited for between.
    from bench.workload import one_token_job, run_alone

    def through_handler(n: int, wait: bool) -> dict:
        record = run_alone(handler, engine, one_token_job(n), wait)
        return {"ttft_ms": 1000 * record["ttft_s"], "counted": record["counted"]}

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
        with python_profile(engine.runner, ("_place", "_prefill_next_chunk"), out / f"profile_ttft_{name}_python.txt"):
            result[f"python_profiled_{name}"] = once(n)
    return result
