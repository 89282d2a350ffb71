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
from tools.sample_images import data_uri, striped

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


# ---- what the server trusts and refuses, in process --------------------------------------------------


def echo_app(**options):
    async def run_job(job):
        yield {"response": "ok", "input": job["input"]}

    return TestClient(make_app(run_job, lambda: "ready", **options))


def test_with_an_api_key_only_callers_who_send_it_are_answered_and_readiness_stays_open():
    client = echo_app(api_key="s3cret")
    job = {"input": {"task": "caption"}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "s3cre"}):
        refused = client.post("/generate", json=job, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", headers
    assert client.get("/v1/models").status_code == 401
    for headers in ({"Authorization": "Bearer s3cret"}, {"X-Api-Key": "s3cret"}):
        assert client.post("/generate", json=job, headers=headers).json()["response"] == "ok"
    assert client.get("/ping").status_code == 200 and client.head("/ping").status_code == 200
    assert client.head("/health").status_code == 200


def test_no_schema_of_the_routes_is_served():
    client = echo_app()
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert client.get(path).status_code == 404, path


@pytest.mark.parametrize(
    "body, code, param",
    [
        (b"{not json", "invalid_json", "body"),
        (b"[1, 2]", "invalid_request", "body"),
        (b'"a string"', "invalid_request", "body"),
        (b'{"input": "not an object"}', "invalid_request", "input"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_request", "body"),
    ],
    ids=["malformed", "list", "string", "input", "nested"],
)
def test_a_body_that_is_not_a_job_gets_an_error_object_naming_what_is_wrong(body, code, param):
    client = echo_app()
    refused = client.post("/generate", content=body, headers={"Content-Type": "application/json"})
    assert refused.status_code == 400, refused.text[:200]
    assert refused.json()["error"]["code"] == code and refused.json()["error"]["param"] == param
    if param == "body":  # what the OpenAI routes refuse before their own checks
        chat = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == code


def test_a_body_over_the_cap_is_refused_before_it_is_read_whole():
    client = echo_app(max_body_bytes=1000)
    big = {"input": {"task": "caption", "image_b64": "A" * 5000}}
    declared = client.post("/generate", json=big)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 500

    undeclared = client.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert undeclared.status_code == 413 and undeclared.json()["error"]["code"] == "body_too_large"


def test_a_native_refusal_is_an_error_object_with_its_code_and_field():
    from runpod_vlm.vocabulary import RequestError

    async def run_job(job):
        yield RequestError("missing_image", "this task needs an image", "image_url").to_dict()

    refused = TestClient(make_app(run_job, lambda: "ready")).post("/generate", json={"input": {}})
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": "image_url: this task needs an image",
            "type": "invalid_request_error",
            "param": "image_url",
            "code": "missing_image",
        }
    }


# ---- the real worker on loopback ------------------------------------------------------------------


SLOW_CLIENT_TIMEOUT_S = 2


def get(url: str, timeout: float = 5):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=AUTHORIZED), timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


API_KEY = "loopback-key"
AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}


def post(url: str, body) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **AUTHORIZED}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
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
        VLM_API_KEY=API_KEY,
        VLM_HTTP_TIMEOUT_S=str(SLOW_CLIENT_TIMEOUT_S),
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
    assert status == 400 and refused["error"]["code"] == "missing_image" and refused["error"]["param"] == "image_url"
    status, refused = post(base + "/generate", "not an object")
    assert status == 400 and refused["error"]["param"] == "body"


def test_the_official_openai_client_calls_the_lb_worker(lb_worker):
    from openai import OpenAI

    client = OpenAI(base_url=lb_worker[0] + "/v1", api_key=API_KEY, max_retries=0)
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
        client.chat.completions.create(model=model.id, messages=messages, n=99)
    assert getattr(refused.value, "status_code", None) == 400


def test_concurrent_requests_share_the_engine(lb_worker):
    from concurrent.futures import ThreadPoolExecutor

    base = lb_worker[0]
    jobs = [{"input": {"messages": [{"role": "user", "content": f"Say {n}."}], "max_new_tokens": 5}} for n in range(6)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda job: post(base + "/generate", job), jobs))
    assert [status for status, _ in answers] == [200] * 6
    assert all(answer["usage"]["completion_tokens"] <= 5 for _, answer in answers)


def slow_connection(base: str, head: bytes, every_s: float, limit_s: float) -> float:
    """Send `head` a byte every `every_s`; how long the server kept the connection (at most `limit_s`)."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=limit_s) as connection:
        for byte in head:
            try:
                connection.sendall(bytes([byte]))
                if connection.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    break  # closed by the server
            except BlockingIOError:
                pass
            except OSError:
                break
            if time.monotonic() - started > limit_s:
                break
            time.sleep(every_s)
    return time.monotonic() - started


def test_a_client_that_sends_its_head_or_body_a_byte_at_a_time_is_cut_off(lb_worker):
    base = lb_worker[0]
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"X-Pad: a\r\n" * 40
    assert slow_connection(base, head, 0.05, 30) < SLOW_CLIENT_TIMEOUT_S + 3
    body_head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n"
    body_head += f"Authorization: Bearer {API_KEY}\r\n\r\n".encode() + b" " * 500
    assert slow_connection(base, body_head, 0.02, 30) < SLOW_CLIENT_TIMEOUT_S + 3
    assert post(base + "/generate", {"input": {"messages": [{"role": "user", "content": "Hi."}]}})[0] == 200


def test_the_real_server_asks_for_its_key(lb_worker):
    base, health = lb_worker[0], lb_worker[1]
    request = urllib.request.Request(base + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401
    assert urllib.request.urlopen(urllib.request.Request(health, method="HEAD"), timeout=5).status == 200


# ---- a model that cannot load ---------------------------------------------------------------------


@pytest.fixture
def broken_model(tmp_path):
    """A model folder broken on purpose: its config names no known model type."""
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-family", "architectures": ["Nothing"]}))
    return folder


def test_a_model_that_cannot_load_answers_every_queue_job_with_the_reason_and_loads_once(broken_model, monkeypatch):
    import asyncio

    import handler
    from runpod_vlm.engine import engine as engine_module

    monkeypatch.setenv("VLM_MODEL", str(broken_model))
    monkeypatch.setenv("VLM_ALLOW_ANY", "true")
    monkeypatch.setenv("VLM_DEVICE_MAP", "cpu")
    loads = []
    real_load = engine_module.load_model
    monkeypatch.setattr(engine_module, "load_model", lambda *a: loads.append(a) or real_load(*a))
    handler.reset_engine()
    try:
        job = {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 3}
        chat = {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "Hi"}]},
        }
        for payload in (job, job, chat):
            out = asyncio.run(handler.local_test_answer({"id": "j", "input": payload}))
            error = out["error"] if "openai_route" in payload else json.loads(out["error"])
            code = error["code"] if "openai_route" in payload else out["code"]
            message = error["message"] if "openai_route" in payload else error["error_message"]
            assert code == "model_load_failed" and "could not be loaded" in message, out
            assert "Traceback" not in message and "no-such-family" in message, message
        models = asyncio.run(handler.local_test_answer({"id": "m", "input": {"openai_route": "/v1/models"}}))
        assert models == {"object": "list", "data": []}
        assert len(loads) == 1  # tried once, not at every job
    finally:
        handler.reset_engine()


def test_a_model_that_cannot_load_keeps_the_lb_worker_up_and_unhealthy(broken_model):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLM_", "RUNPOD_"))}
    env.update(VLM_ENDPOINT_TYPE="lb", VLM_MODEL=str(broken_model), VLM_ALLOW_ANY="true", HF_HUB_OFFLINE="1")
    env.update(VLM_DEVICE_MAP="cpu", PORT=str(port), VLM_API_KEY=API_KEY)
    process = subprocess.Popen(
        [sys.executable, "handler.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    try:
        while True:
            assert process.poll() is None and time.monotonic() < deadline
            try:
                if get(base + "/ping")[0] == 503:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        status, body = get(base + "/v1/models")
        assert status == 200 and json.loads(body)["data"] == []
        status, refused = post(base + "/generate", {"input": {"messages": [{"role": "user", "content": "Hi."}]}})
        assert status == 503 and refused["error"]["code"] == "model_load_failed", refused
        assert process.poll() is None  # up, saying why, not restarting in a loop
    finally:
        process.terminate()
        process.wait(timeout=30)


def scrape(base: str) -> dict:
    """/metrics parsed by prometheus_client's own parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = get(base + "/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def test_metrics_parse_and_move_with_a_request(lb_worker):
    base = lb_worker[0]
    before = scrape(base)
    ok = ("vlm_requests_total", (("outcome", "ok"), ("route", "generate")))
    refused = ("vlm_requests_total", (("outcome", "missing_image"), ("route", "generate")))
    job = {"input": {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 3, "min_new_tokens": 3}}
    assert post(base + "/generate", job)[0] == 200
    assert post(base + "/generate", {"input": {"task": "vqa", "question": "No image?"}})[0] == 400
    after = scrape(base)
    assert after[ok] == before.get(ok, 0) + 1 and after[refused] == before.get(refused, 0) + 1
    generated = ("vlm_completion_tokens_total", ())
    assert after[generated] == before.get(generated, 0) + 3
    first = ("vlm_time_to_first_token_seconds_count", ())
    assert after[first] == before.get(first, 0) + 1
    assert after[("vlm_kv_blocks", ())] > 0 and after[("vlm_running_rows", ())] == 0
    assert after[("vlm_kv_blocks_used", ())] == 0 and after[("vlm_queue_depth", ())] == 0
    assert urllib.request.urlopen(base + "/ping", timeout=5).status == 200
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(base + "/metrics", timeout=5)
    assert unauthorized.value.code == 401
