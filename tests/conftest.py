"""Shared fixtures: tiny offline models built once per session, and the worker pointed at one."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import handler  # noqa: E402
import tools.tiny_models as tiny_models  # noqa: E402
from runpod_vlm.settings import Settings  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(family, eos_bias=False, vision_lora=False)` -> folder of a tiny random model, built on first use."""
    built: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def get(family: str, eos_bias: bool = False, vision_lora: bool = False) -> Path:
        key = (family, eos_bias, vision_lora)
        if key not in built:
            name = family + ("-eos" if eos_bias else "") + ("-vision-lora" if vision_lora else "")
            built[key] = tiny_models.build(family, root / name, eos_bias=eos_bias, vision_lora=vision_lora)
        return built[key]

    return get


@pytest.fixture
def serve(monkeypatch):
    """`serve(folder)` -> the worker's engine serving that folder on CPU, as the env would set it."""

    def start(folder: Path, **env: str):
        monkeypatch.setenv("VLM_MODEL", str(folder))
        monkeypatch.setenv("VLM_ALLOW_ANY", "true")
        monkeypatch.setenv("VLM_DEVICE_MAP", "cpu")
        for name in ("VLM_QUANTIZE", "VLM_MIN_PIXELS", "VLM_MAX_PIXELS", "VLM_MAX_BATCH_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        current = handler._engine
        if env or current is None or current.settings != Settings.from_env():
            handler.reset_engine()
            special.append(bool(env))
        return handler.get_engine()

    special: list[bool] = []
    yield start
    if any(special):
        handler.reset_engine()  # an engine loaded with test-only settings must not leak


STARTUP_LIMIT_S = 180  # a deadline for a server to come up, not a performance assertion


@pytest.fixture
def forward_calls_of(monkeypatch):
    """`forward_calls_of(engine)`: what that engine's model is handed and chooses from now on, independent of how
    the worker drives it: `prompts`, the input ids and attention mask of each call of its forward (a prefill's
    first: the prompt, left padding included), and `choices`, the greedy choice at each row's last position at
    each use of its output layer (a prefill's, packed or not, and each decode step's)."""

    def record(engine):
        calls = types.SimpleNamespace(prompts=[], choices=[])
        model = engine.model
        real_forward = getattr(model.forward, "__wrapped_forward__", model.forward)

        @functools.wraps(real_forward)  # generate() reads the forward's signature
        def recording_forward(*args, **kwargs):
            calls.prompts.append({"input_ids": kwargs.get("input_ids"), "attention_mask": kwargs.get("attention_mask")})
            return real_forward(*args, **kwargs)

        head = model.get_output_embeddings()
        real_head = getattr(head.forward, "__wrapped_forward__", head.forward)

        def recording_head(hidden_states):
            logits = real_head(hidden_states)
            calls.choices.append(logits.reshape(logits.shape[0], -1, logits.shape[-1])[:, -1].argmax(-1))
            return logits

        recording_forward.__wrapped_forward__, recording_head.__wrapped_forward__ = real_forward, real_head
        monkeypatch.setattr(model, "forward", recording_forward)
        monkeypatch.setattr(head, "forward", recording_head)
        return calls

    return record


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(command: list, env: dict, port: int, probe: str, log_path: Path):
    """Start `command` (a server on 127.0.0.1:`port`), wait until GET `probe` answers, yield its
    base URL, and stop it afterwards; its output goes to `log_path`, shown if it dies."""
    log = log_path.open("w+")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_LIMIT_S
    try:
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"{command[1]} exited with {process.returncode}:\n{log.read()[-4000:]}")
            try:
                urllib.request.urlopen(base + probe, timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    pytest.fail(f"{command[1]} did not come up")
                time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@contextlib.contextmanager
def openai_server(model_folder, log_path: Path, **env: str):
    """scripts/openai_server.py serving `model_folder` on the CPU, offline and on loopback (`env` adds variables);
    yields its base URL."""
    port = free_port()
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("VLM_", "RUNPOD_"))}
    variables.update(VLM_MODEL=str(model_folder), VLM_ALLOW_ANY="true", VLM_DEVICE_MAP="cpu", HF_HUB_OFFLINE="1")
    variables.update(TRANSFORMERS_OFFLINE="1", **env)
    command = [sys.executable, "scripts/openai_server.py", "--port", str(port)]
    with running_server(command, variables, port, "/v1/models", log_path) as base:
        yield base


class ImageServer:
    """A loopback HTTP server (127.0.0.1 only) serving one file (a PNG at /x.png unless told); it records each
    request's path and Accept header."""

    def __init__(self, body: bytes, path: str = "/x.png", content_type: str = "image/png"):
        self.requests: list[str] = []
        self.accepts: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                owner.requests.append(self.path)
                owner.accepts.append(self.headers.get("Accept"))
                if self.path != path:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def image_server():
    """A loopback image server for one test (see ImageServer)."""
    from tools.sample_images import encode, striped

    server = ImageServer(encode(striped((64, 48))))
    yield server
    server.close()
