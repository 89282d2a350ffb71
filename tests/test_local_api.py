"""The worker as RunPod's local API serves it: `python handler.py --rp_serve_api`, real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import handler
from conftest import free_port, running_server
from tools.sample_images import b64, data_uri, encode, plain, striped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_env(model_folder, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLM_", "RUNPOD_"))}
    env.update(
        VLM_MODEL=str(model_folder),
        VLM_ALLOW_ANY="true",
        VLM_DEVICE_MAP="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        **extra,
    )
    return env


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def api(tiny_model, tmp_path_factory):
    """Base URL of a local API serving a tiny Qwen2-VL; the server is stopped afterwards.

    VLM_ALLOW_INTERNAL_URLS=true lets it fetch from the test's loopback image server; it widens
    only the URL policy, which the data-URI tests here never reach."""
    port = free_port()
    command = [sys.executable, "handler.py", "--rp_serve_api", "--rp_api_port", str(port), "--rp_api_host", "127.0.0.1"]
    env = worker_env(tiny_model("qwen2-vl"), VLM_ALLOW_INTERNAL_URLS="true")
    with running_server(command, env, port, "/", tmp_path_factory.mktemp("api") / "server.log") as base:
        yield base


def runsync(api: str, payload: dict):
    """A job's output through /runsync: the handler streams, so RunPod aggregates what it yields
    into a list; a job that does not stream yields exactly one output."""
    answer = post(api + "/runsync", {"input": payload})
    assert answer.get("status") == "COMPLETED", answer
    if payload.get("stream"):
        return answer["output"]
    assert isinstance(answer["output"], list) and len(answer["output"]) == 1, answer
    return answer["output"][0]


def test_a_streamed_answer_is_its_chunks_joined(api):
    request = {
        "task": "vqa",
        "image_url": data_uri(striped()),
        "question": "What is it?",
        "max_new_tokens": 12,
        "min_new_tokens": 12,
    }
    whole = runsync(api, request)
    chunks = runsync(api, dict(request, stream=True))
    assert "".join(chunk["text"] for chunk in chunks) == whole["response"]
    last = chunks[-1]
    assert last["finish_reason"] == "length" and last["usage"] == whole["usage"]
    assert all(set(chunk) == {"text"} for chunk in chunks[:-1])


def test_caption(api):
    out = runsync(api, {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 4})
    assert out["task"] == "caption" and out["image_count"] == 1
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    assert isinstance(out["response"], str)


def test_vqa_with_raw_base64(api):
    raw = b64(plain("red", (64, 48)))
    out = runsync(api, {"task": "vqa", "image_b64": raw, "question": "What colour is it?", "max_new_tokens": 3})
    assert out["task"] == "vqa" and out["usage"]["completion_tokens"] == 3


def test_multi_turn_multi_image_chat(api):
    out = runsync(
        api,
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_uri(striped())}},
                        {"type": "image_url", "image_url": {"url": data_uri(plain("blue"))}},
                        {"type": "text", "text": "Which one is blue?"},
                    ],
                },
                {"role": "assistant", "content": "The second one."},
                {"role": "user", "content": "Are you sure?"},
            ],
            "max_new_tokens": 3,
        },
    )
    assert out["task"] == "chat" and out["image_count"] == 2
    assert out["usage"]["prompt_tokens"] > 0


def test_grounding(api):
    out = runsync(
        api,
        {
            "task": "grounding",
            "image_url": data_uri(striped((84, 56))),
            "target": "the left stripe",
            "max_new_tokens": 4,
        },
    )
    assert out["task"] == "grounding" and out["supports_grounding"] is True
    # A random model rarely writes a box: then the box is None and a warning says why.
    assert out["bbox"] is not None or out["bbox_warning"]


def test_batch(api):
    out = runsync(
        api,
        {
            "requests": [
                {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 2},
                {"task": "vqa", "image_url": data_uri(striped())},  # no question
                {"messages": [{"role": "user", "content": "Hello?"}], "max_new_tokens": 2},
            ]
        },
    )
    assert out["count"] == 3
    first, bad, last = out["results"]
    assert first["task"] == "caption" and last["task"] == "chat"
    assert bad["param"] == "requests[1].question" and "error" in bad


def test_an_http_image_url_is_fetched_when_internal_urls_are_allowed(api, image_server):
    out = runsync(api, {"task": "caption", "image_url": image_server.url, "max_new_tokens": 3})
    assert out["task"] == "caption" and out["image_count"] == 1
    assert out["usage"]["completion_tokens"] == 3 and out["usage"]["prompt_tokens"] > 0
    assert image_server.requests == ["/x.png"]


def test_the_same_url_is_refused_by_default_and_never_fetched(image_server, monkeypatch):
    """The default policy, in process (no second worker): plain http to loopback is refused
    before any connection is made."""
    for name in list(os.environ):
        if name.startswith(("VLM_MEDIA", "VLM_URL", "VLM_TRUST_ENV")) or name == "VLM_ALLOW_INTERNAL_URLS":
            monkeypatch.delenv(name)
    job = {"input": {"task": "caption", "image_url": image_server.url, "max_new_tokens": 3}}
    out = asyncio.run(handler.local_test_answer(job))
    assert out["code"] == "blocked_url" and out["param"] == "image_url", out
    assert "image_url: " in out["error"] and "127.0.0.1" not in out["error"]
    assert image_server.requests == []


def test_a_refused_request_answers_its_reason(api):
    # RunPod's queue turns an output with `error` into a failed job; the SDK's local /runsync keeps
    # a streaming handler's outputs as they are.
    answer = runsync(api, {"task": "vqa", "question": "No image?"})
    assert answer["code"] == "missing_image" and answer["param"] == "image_url"
    message = json.loads(answer["error"])["error_message"]
    assert message.startswith("image_url: ") and "needs an image" in message


def test_test_input_runs_one_job_and_exits_0(tiny_model):
    job = {"input": {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 2}}
    result = subprocess.run(
        [sys.executable, "handler.py", "--test_input", json.dumps(job)],
        cwd=ROOT,
        env=worker_env(tiny_model("qwen2-vl")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "'task': 'caption'" in result.stdout and "'finish_reason': 'length'" in result.stdout


# ---- every request body of the README, as its examples show it ----------------------------------

README = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "examples.md")]  # the user's documents


def top_level_keys(shape: str) -> set[str]:
    """The keys written at the outer level of an output shape as the README shows it (`{"a": ..., "b": [...]}`)."""
    keys, depth, outer = set(), 0, 1 if shape.lstrip().startswith("{") else 0
    for match in re.finditer(r'[\[\]{}]|"(\w+)":', shape):
        token = match.group(0)
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
        elif depth == outer:
            keys.add(match.group(1))
    return keys


def readme_requests(image_url: str) -> list[tuple[str, dict, set[str]]]:
    """(where, job body, the output keys shown) for every job body in the README: its JSON examples, each with
    the keys of the shape after its arrow ("same shape" is the first example's), and the bodies of its curl lines."""
    text = "\n".join(open(path, encoding="utf-8").read() for path in README)
    images = {
        "data:image/png;base64,iVBORw0KGgo...": data_uri(striped()),
        "data:image/jpeg;base64,/9j/4AAQ...": data_uri(encode(plain("blue"), "JPEG"), "image/jpeg"),
        "iVBORw0KGgo...": b64(plain("red", (64, 48))),
        "https://example.com/street.jpg": image_url,
    }

    def runnable(body: str) -> dict:
        for placeholder, real in images.items():
            body = body.replace(placeholder, real)
        return json.loads(body)

    found, shape_keys = [], set()
    for match in re.finditer(r"```json\n(.*?)```\n(?:→ (.*?)(?:\n\n|$))?", text, re.S):
        body = match.group(1)
        if not body.lstrip().startswith('{"input"'):
            continue
        shown = next((m for m in re.finditer(r"`([^`]*)`", match.group(2) or "") if '":' in m.group(1)), None)
        keys = top_level_keys(shown.group(1)) if shown else set()
        if (match.group(2) or "").startswith("same shape"):
            keys |= shape_keys
        elif keys >= {"response", "task"}:
            shape_keys = keys
        found.append((body.splitlines()[0][:60], runnable(body), keys))
    for match in re.finditer(r"-d '(\{.*?\})'", text, re.S):
        found.append((match.group(1)[:60], runnable(match.group(1)), set()))
    found.append(("test_input.json", runnable(open(os.path.join(ROOT, "test_input.json")).read()), set()))
    return found


def test_every_request_body_of_the_readme_is_answered_in_the_shape_it_shows(api, image_server):
    requests = readme_requests(image_server.url)
    assert len(requests) >= 10  # the eight examples, the curl lines' bodies, test_input.json
    for where, job, keys in requests:
        answer = post(api + "/runsync", job)
        assert answer.get("status") == "COMPLETED", (where, answer)
        outputs = answer["output"]
        if job["input"].get("stream"):
            assert all("text" in chunk for chunk in outputs) and "finish_reason" in outputs[-1], where
            continue
        assert len(outputs) == 1, where
        [output] = outputs
        assert "error" not in output, (where, output)
        assert keys <= set(output), (where, sorted(keys - set(output)))
        if "results" in output:
            assert [r.get("code") for r in output["results"]] == [None, None, "invalid_request"], where


def test_a_job_runs_through_the_local_apis_own_verbs(api):
    # POST /run records the job; POST /status/{id} runs it and answers all of it (the SDK's stand-in).
    body = {"input": {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 3}}
    queued = post(api + "/run", body)
    assert queued["status"] == "IN_PROGRESS"
    done = post(api + f"/status/{queued['id']}", {})
    assert done["status"] == "COMPLETED" and done["output"][0]["usage"]["completion_tokens"] == 3
    streamed = post(api + "/run", {"input": dict(body["input"], stream=True)})
    chunks = post(api + f"/stream/{streamed['id']}", {})
    assert chunks["status"] == "COMPLETED" and "finish_reason" in chunks["stream"][-1]["output"]
