"""Issue 13: the worker in the runpod SDK's real production loop (`python handler.py` with
RUNPOD_WEBHOOK_GET_JOB set) against a loopback stand-in of RunPod's job queue (tools/runpod_queue.py),
a tiny model on CPU. Faults, hostile jobs and the log at the default level."""

from __future__ import annotations

import json
import re
import time

import pytest

from tools.runpod_queue import Faults, JobQueue, worker
from tools.sample_images import data_uri, striped

SMALL = 4096  # bytes: the most an error answer may weigh
RUN_LIMIT_S = 300  # a deadline for a run to finish, not a performance assertion
IMAGE = data_uri(striped())


def caption(n: int, max_new_tokens: int = 8) -> dict:
    return {
        "task": "vqa",
        "image_url": IMAGE,
        "question": f"marker-{n}-zebra: what is it?",
        "max_new_tokens": max_new_tokens,
    }


def assert_answered_exactly_once(queue: JobQueue, job_ids):
    answers = queue.answers()
    for job_id in job_ids:
        assert len(answers.get(job_id, [])) == 1, (job_id, answers.get(job_id))


def body_size(body) -> int:
    return len(json.dumps(body, ensure_ascii=False).encode("utf-8"))


def output_of(body: dict):
    """A posted result's output: a plain handler's dict, or the one item of the list a generator
    handler's aggregate (return_aggregate_stream) holds."""
    output = body.get("output")
    return output[0] if isinstance(output, list) and len(output) == 1 else output


def assert_error(body: dict, code: str, param=None):
    """A clean error as the SDK posts it: the job's `error` is a JSON string with the stable code, the
    message and the field (the SDK keeps only a yielded error's `error`), small, with no traceback."""
    assert body_size(body) < SMALL, body_size(body)
    assert isinstance(body.get("error"), str) and "Traceback" not in body["error"], body
    error = json.loads(body["error"])
    assert error["error_type"] == code, error
    if param is not None:
        assert error["param"] == param and error["error_message"].startswith(f"{param}: "), error


def text_forms(text: str) -> set[str]:
    """The ways a text can be printed in a log: as is, as a Python repr, as JSON."""
    return {text, repr(text)[1:-1], json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen2-vl")


STREAMING_WORKER = """
import asyncio, runpod

async def handler(job):
    for n in range(job["input"]["chunks"]):
        await asyncio.sleep(0.05)
        yield {"n": n, "job": job["id"]}

runpod.serverless.start({"handler": handler, "return_aggregate_stream": True,
                         "concurrency_modifier": lambda current: 4})
"""


ENVIRONMENT_WORKER = """
import json, os, pathlib, time
names = ("RUNPOD_SKIP_AUTO_SYSTEM_CHECKS", "RUNPOD_SKIP_GPU_CHECK", "RUNPOD_WEBHOOK_GET_JOB")
pathlib.Path(os.environ["ENV_OUT"]).write_text(json.dumps({name: os.environ.get(name) for name in names}))
time.sleep(60)
"""


def test_a_worker_on_the_stand_in_has_the_sdks_start_up_checks_off_whatever_its_env_says(tmp_path):
    """The SDK's start-up checks open a TCP connection to a public address: every worker the tests start against the
    stand-in has them off and its webhooks on loopback, even where a test's `env` says otherwise."""
    script, written = tmp_path / "environment_worker.py", tmp_path / "env.json"
    script.write_text(ENVIRONMENT_WORKER)
    with JobQueue() as queue:
        asked = dict(RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="false", RUNPOD_WEBHOOK_GET_JOB="https://api.runpod.ai/v2/x")
        with worker(queue, "unused", tmp_path / "env.log", script=str(script), ENV_OUT=str(written), **asked):
            deadline = time.monotonic() + RUN_LIMIT_S
            while not written.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            seen = json.loads(written.read_text())
    assert seen["RUNPOD_SKIP_AUTO_SYSTEM_CHECKS"] == "true" and seen["RUNPOD_SKIP_GPU_CHECK"] == "true"
    assert seen["RUNPOD_WEBHOOK_GET_JOB"].startswith("http://127.0.0.1:")


def test_the_stand_in_speaks_the_sdks_batch_take_and_stream_protocol(tmp_path):
    """An async generator handler with concurrency 4 (the shape the engine's handler will have):
    the SDK takes jobs in batches, streams each chunk and posts the aggregate with isStream=true."""
    script = tmp_path / "streaming_worker.py"
    script.write_text(STREAMING_WORKER)
    with JobQueue() as queue:
        ids = [queue.put({"chunks": 3}) for _ in range(12)]
        with worker(queue, "unused", tmp_path / "stream.log", script=str(script)) as running:
            assert queue.wait_answered(ids, RUN_LIMIT_S), running.log()[-3000:]
        assert running.process.returncode == 0
    assert_answered_exactly_once(queue, ids)
    for job_id in ids:
        (post,) = queue.accepted(job_id)
        assert post.is_stream and post.body == {"output": [{"n": n, "job": job_id} for n in range(3)]}
        chunks = [p.body for p in queue.stream_posts if p.job_id == job_id]
        assert chunks == [{"output": {"n": n, "job": job_id}} for n in range(3)]
    batch_takes = [take for take in queue.takes if take["kind"] == "job-take-batch"]
    assert batch_takes and all(1 < int(take["query"]["batch_size"]) <= 4 for take in batch_takes)
    assert max(len(take["ids"]) for take in queue.takes) > 1


def test_fault_run_answers_every_job_exactly_once(model, tmp_path):
    lost, retried_once, retried_twice = "job-lost", ["job-r1a", "job-r1b"], "job-r2"
    cancelled = ["job-cancel-a", "job-cancel-b"]
    faults = Faults(
        result_500s={lost: 3, retried_twice: 2, **{j: 1 for j in retried_once}},
        take_500_fraction=0.15,
        slow_take_fraction=0.2,
        slow_take_s=0.3,
        cancel=set(cancelled),
        seed=7,
    )
    with JobQueue(faults) as queue:
        good, invalid, batches = [], [], []
        for n in range(20):
            if n % 10 == 3:  # 10% invalid
                invalid.append(queue.put({"task": "vqa", "image_url": IMAGE}))  # no question
            else:
                good.append(queue.put(caption(n)))
        batches.append(queue.put({"requests": [caption(100), {"task": "nope"}, caption(101, 4)]}))
        for job_id in (*retried_once, retried_twice, lost, *cancelled):
            queue.put(caption(200), job_id=job_id)
        last = queue.put(caption(300))
        with worker(queue, model, tmp_path / "worker.log") as running:
            assert queue.wait_answered([*good, *invalid, *batches, *retried_once, retried_twice, last], RUN_LIMIT_S), (
                running.log()[-3000:]
            )
            queue.wait_for(lambda q: len([p for p in q.posts if p.job_id == lost]) >= 3, 30)
            assert running.alive()
        assert running.process.returncode == 0  # SIGTERM: the SDK's graceful shutdown
        log = running.log()

    answers = queue.answers()
    assert_answered_exactly_once(queue, [*good, *invalid, *batches, *retried_once, retried_twice, last])
    for job_id in good + [last]:
        output = output_of(answers[job_id][0])
        assert output["task"] == "vqa" and output["usage"]["completion_tokens"] == 8
    for job_id in invalid:
        assert_error(answers[job_id][0], "invalid_request", "question")
    results = output_of(answers[batches[0]][0])["results"]
    assert results[0]["task"] == "vqa" and results[2]["usage"]["completion_tokens"] == 4
    assert results[1]["code"] == "invalid_request" and results[1]["param"] == "requests[1].task"
    # 500s were retried by the SDK: every post of a job carries the same answer, the last accepted
    for job_id, failures in [*((j, 1) for j in retried_once), (retried_twice, 2)]:
        posts = [p for p in queue.posts if p.job_id == job_id]
        assert [p.status for p in posts] == [500] * failures + [200]
        assert all(p.body == posts[-1].body for p in posts)
    # three 500s exhaust the SDK's retries: the result is lost, and the SDK says so at ERROR
    assert [p.status for p in queue.posts if p.job_id == lost] == [500, 500, 500]
    assert re.search(rf"ERROR\s*\| {lost} \| Failed to return job results", log)
    for job_id in cancelled:  # a stopped job is answered at most once (never, if stopped in time)
        assert len(answers.get(job_id, [])) <= 1
    # the faults really happened, and no job was handed out twice
    statuses = [take["status"] for take in queue.takes]
    assert 500 in statuses and any(take["ids"] for take in queue.takes)
    handed_out = [job_id for take in queue.takes for job_id in take["ids"]]
    assert len(handed_out) == len(set(handed_out)) == len(queue.jobs)
    assert queue.stop_polls > 0 and queue.pings and queue.unknown == []
    assert "Traceback" not in log
    # the default log level (INFO) keeps answers and requests out of the log
    for job_id in good:
        text = output_of(answers[job_id][0])["response"]
        if len(text) >= 6:
            assert not any(form in log for form in text_forms(text)), job_id
    assert "zebra" not in log and "marker-" not in log


def test_answers_reach_the_log_only_when_the_operator_asks_for_debug(model, tmp_path):
    """The control for the privacy check above: the same check finds answers at DEBUG."""
    with JobQueue() as queue:
        ids = [queue.put(caption(n, 12)) for n in range(2)]
        with worker(queue, model, tmp_path / "debug.log", RUNPOD_LOG_LEVEL="DEBUG") as running:
            assert queue.wait_answered(ids, RUN_LIMIT_S), running.log()[-3000:]
        log = running.log()
    texts = [output_of(queue.answers()[job_id][0])["response"] for job_id in ids]
    assert any(form in log for text in texts for form in text_forms(text))


HUGE = 15_000_000


def test_hostile_run_gets_bounded_clear_answers_and_the_worker_keeps_serving(model, tmp_path):
    lone = "\ud800"
    deep: object = "leaf"
    for _ in range(200):
        deep = [deep]
    hostile = {  # job input -> (code, param) of the answer
        "huge-name": ({**caption(0), "n" * HUGE: 1}, "invalid_request", "n" * 64 + "…"),
        "huge-question": ({**caption(0), "question": "q" * HUGE}, "text_too_long", "input"),
        "huge-task": ({**caption(0), "task": "t" * 1_000_000}, "invalid_request", "task"),
        "surrogate-text": ({**caption(0), "question": f"what{lone}"}, "invalid_request", "question"),
        "surrogate-key": ({**caption(0), f"k{lone}": 1}, "invalid_request", "k\\ud800"),
        "surrogate-block": (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": lone}]}]},
            "invalid_request",
            "messages[0].content[0].text",
        ),
        "nul": ({**caption(0), "question": "a\x00b"}, "invalid_request", "question"),
        "deep": ({**caption(0), "images": deep}, "invalid_request", None),
        "string-input": ("caption this", "invalid_request", "input"),
        "list-input": ([1, 2, 3], "invalid_request", "input"),
        "null-input": (None, "invalid_request", "input"),
        "surrogate-in-batch": ({"requests": [caption(1), {**caption(2), "question": lone}]}, None, None),
    }
    with JobQueue() as queue:
        serving = []
        for job_id, (job_input, _, _) in hostile.items():
            queue.put(job_input, job_id=job_id)
            serving.append(queue.put(caption(len(serving), 2)))  # a good job after each hostile one
        # what the SDK itself cannot read (its JSON parser recurses; a body without "input"): it
        # drops the job; the worker must still serve the next one
        queue.put(
            None,
            job_id="too-deep-for-json",
            raw=b'{"id": "too-deep-for-json", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        )
        queue.put(None, job_id="no-input", raw=b'{"id": "no-input"}')
        queue.put(None, job_id="not-json", raw=b"{not json")
        serving.append(queue.put(caption(99, 2)))
        with worker(queue, model, tmp_path / "worker.log") as running:
            assert queue.wait_answered([*hostile, *serving], RUN_LIMIT_S), running.log()[-3000:]
            assert running.alive()
        log = running.log()

    answers = queue.answers()
    assert_answered_exactly_once(queue, [*hostile, *serving])
    for job_id, (_, code, param) in hostile.items():
        body = answers[job_id][0]
        if job_id == "surrogate-in-batch":
            good, bad = output_of(body)["results"]
            assert good["task"] == "vqa" and bad["code"] == "invalid_request" and bad["param"] == "requests[1].question"
            continue
        assert_error(body, code, param)
    assert "nested deeper" in json.loads(answers["deep"][0]["error"])["error_message"]
    for job_id in serving:
        assert output_of(answers[job_id][0])["usage"]["completion_tokens"] == 2
    for job_id in ("too-deep-for-json", "no-input", "not-json"):  # dropped by the SDK, or answered cleanly
        for body in answers.get(job_id, []):
            assert_error(body, "invalid_request")
    assert "Traceback" not in log and "generation failed" not in log


def test_two_hundred_mixed_jobs_through_the_real_loop_each_answered_once(model, tmp_path):
    """The worker itself in the SDK's loop: plain, streamed, batch-call and invalid jobs, several in
    flight at once (the SDK takes them in batches), each answered exactly once, streamed ones
    through /job-stream with their chunks adding up to the aggregate."""
    with JobQueue() as queue:
        kinds = {}
        for n in range(200):
            kind = ("plain", "streamed", "batch", "invalid")[n % 4]
            if kind == "batch":
                job = {"requests": [caption(n, 4), {"task": "vqa", "image_url": IMAGE}]}
            elif kind == "invalid":
                job = {"task": "vqa", "image_url": IMAGE, "max_new_tokens": "many"}
            else:
                job = dict(caption(n, 6), stream=kind == "streamed")
            kinds[queue.put(job)] = kind
        with worker(queue, model, tmp_path / "worker.log") as running:
            assert queue.wait_answered(kinds, RUN_LIMIT_S), running.log()[-3000:]
        assert running.process.returncode == 0
    assert_answered_exactly_once(queue, kinds)
    assert max(len(take["ids"]) for take in queue.takes) > 1  # more than one job in flight
    for job_id, kind in kinds.items():
        (post,) = queue.accepted(job_id)
        if kind == "invalid":
            assert_error(post.body, "invalid_request", "max_new_tokens")
        elif kind == "batch":
            first, second = output_of(post.body)["results"]
            assert first["usage"]["completion_tokens"] == 4 and second["code"] == "invalid_request"
        elif kind == "plain":
            assert output_of(post.body)["usage"]["completion_tokens"] == 6
        else:
            chunks = post.body["output"]
            streamed = [p.body["output"] for p in queue.stream_posts if p.job_id == job_id]
            assert streamed == chunks and chunks[-1]["usage"]["completion_tokens"] == 6
            assert chunks[-1]["finish_reason"] == "length"
