"""RunPod's load-balancing mode: `VLM_ENDPOINT_TYPE=lb python handler.py` as an HTTP server on PORT, its
readiness on PORT_HEALTH, the OpenAI routes and the native route answered through the job path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from fastapi.testclient import TestClient

from conftest import ROOT, free_port
from runpod_vlm.http_server import make_app
from sample_images import data_uri, striped

# ---- readiness, in process: the states /ping reports ---------------------------------------------


@pytest.mark.parametrize(
    "state, status", [("initializing", 204), ("ready", 200), ("unhealthy", 503)], ids=["loading", "ready", "broken"]
)
def test_ping_says_whether_the_worker_is_ready(state, status):
    async def no_job(job):
        raise AssertionError("/ping runs no job")
        yield

    client = TestClient(make_app(no_job, lambda: state))
    assert client.get("/ping").status_code == status
    health = client.get("/health")
    assert health.status_code == status and (status == 204 or health.json() == {"status": state})


def test_a_streamed_native_request_comes_as_server_sent_events():
    async def run_job(job):
        assert job["input"]["stream"] is True
        yield {"text": "Hel"}
        yield {"text": "lo", "finish_reason": "stop"}

    client = TestClient(make_app(run_job, lambda: "ready"))
    with client.stream("POST", "/generate", json={"input": {"stream": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events == [{"text": "Hel"}, {"text": "lo", "finish_reason": "stop"}]


# ---- the real worker on loopback ------------------------------------------------------------------


def get(url: str, timeout: float = 5):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def post(url: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def lb_worker(tiny_model, tmp_path_factory):
    """`python handler.py` in load-balancing mode on two loopback ports; (base URL, health URL, /ping answers
    seen from its start until it was ready)."""
    port, health_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLM_", "RUNPOD_"))}
    env.update(
        VLM_ENDPOINT_TYPE="lb",
        VLM_MODEL=str(tiny_model("qwen2-vl")),
        VLM_ALLOW_ANY="true",
        VLM_DEVICE_MAP="cpu",
        HF_HUB_OFFLINE="1",
        PORT=str(port),
        PORT_HEALTH=str(health_port),
    )
    log_path = tmp_path_factory.mktemp("lb") / "worker.log"
    log = log_path.open("w+")
    process = subprocess.Popen(
        [sys.executable, "handler.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )
    # The server listens on 0.0.0.0 as in a container; the tests call it on loopback only.
    base, health, seen = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{health_port}/ping", []
    deadline = time.monotonic() + 180
    try:
        while not seen or seen[-1] != 200:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                seen.append(get(health)[0])
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        yield base, health, seen, log_path
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_the_health_port_answers_204_while_loading_then_200(lb_worker):
    _, health, seen, log_path = lb_worker
    assert set(seen) <= {204, 200} and seen[-1] == 200
    assert get(health)[0] == 200
    log = log_path.read_text()
    assert "listening on http://0.0.0.0:" in log
    ready = json.loads(log.split("ready: ", 1)[1].splitlines()[0])
    assert ready["family"] == "qwen2-vl" and ready["dtype"] == "float32" and ready["endpoint_type"] == "lb"


def test_the_native_route_answers_a_queue_jobs_body(lb_worker):
    base = lb_worker[0]
    job = {"input": {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 3}}
    status, answer = post(base + "/generate", job)
    assert status == 200 and answer["task"] == "caption" and answer["usage"]["completion_tokens"] == 3
    status, refused = post(base + "/generate", {"input": {"task": "vqa", "question": "No image?"}})
    assert status == 400 and refused["code"] == "missing_image" and refused["param"] == "image_url"
    assert json.loads(refused["error"])["error_type"] == "missing_image"
    status, _ = post(base + "/generate", "not an object")
    assert status == 400


def test_the_official_openai_client_calls_the_lb_worker(lb_worker):
    from openai import OpenAI

    client = OpenAI(base_url=lb_worker[0] + "/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    content = [{"type": "image_url", "image_url": {"url": data_uri(striped())}}, {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": content}]
    answer = client.chat.completions.create(model=model.id, messages=messages, max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens <= 4 and answer.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model.id, messages=messages, max_tokens=4, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == (
        answer.choices[0].message.content
    )
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model=model.id, messages=messages, n=2)
    assert getattr(refused.value, "status_code", None) == 400


def test_concurrent_requests_share_the_engine(lb_worker):
    from concurrent.futures import ThreadPoolExecutor

    base = lb_worker[0]
    jobs = [{"input": {"messages": [{"role": "user", "content": f"Say {n}."}], "max_new_tokens": 5}} for n in range(6)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda job: post(base + "/generate", job), jobs))
    assert [status for status, _ in answers] == [200] * 6
    assert all(answer["usage"]["completion_tokens"] <= 5 for _, answer in answers)
