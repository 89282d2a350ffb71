"""A loopback stand-in of RunPod's job queue, for the runpod SDK's production loop (runpod 1.12).

Not a test file: tests (and bench/soak.py) start a `JobQueue`, put jobs on it, start the worker with
`worker(queue, model_folder, log_path)` (`python handler.py` with the RUNPOD_WEBHOOK_* variables
pointing here) and read back what the worker posted.

What the SDK calls, read from runpod/serverless/modules/rp_job.py, rp_http.py, rp_scale.py and
rp_ping.py (1.12):
- take one job: GET  <RUNPOD_WEBHOOK_GET_JOB with $ID -> worker id>&job_in_progress=0|1
  -> 200 {"id", "input"} as application/json, or 204 when there is none (RunPod holds the request
  open a while first: a long poll; the SDK asks again at once after a 204)
- take several: GET  the same URL with /job-take/ -> /job-take-batch/, plus &batch_size=N
  -> 200 [{"id", "input"}, ...], or 204
- result: POST <RUNPOD_WEBHOOK_POST_OUTPUT with $RUNPOD_POD_ID, $ID>&isStream=false|true, the body
  the JSON of {"output": ...} or {"error": ...} (sent as x-www-form-urlencoded); a 5xx is retried
  twice (FibonacciRetry(attempts=3)), anything else is not
- stream chunk: POST <RUNPOD_WEBHOOK_POST_STREAM ...>&isStream=false, body {"output": chunk}
- stop signals: GET  the take URL with /job-take/ -> /job-stop/ (no extra query), a long poll
  answered {"jobsToStop": [ids]} as application/json, or 204
- heartbeat: GET  <RUNPOD_WEBHOOK_PING with $RUNPOD_POD_ID>&job_id=...&runpod_version=..., sent
  every RUNPOD_PING_INTERVAL ms, only when RUNPOD_AI_API_KEY and RUNPOD_POD_ID are set
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import http.server
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[1]
ENDPOINT = "loopback-endpoint"
WORKER_ID = "loopback-worker"


@dataclasses.dataclass
class Faults:
    """What the stand-in does wrong, on purpose. Fractions are of calls, drawn with `seed`."""

    result_500s: dict = dataclasses.field(default_factory=dict)  # job id -> how many of its first
    # result posts get HTTP 500 (the SDK retries a 5xx twice, after 2 s and 3 s: 3 or more lose it)
    take_500_fraction: float = 0.0  # takes answered with HTTP 500 (no job handed out)
    slow_take_fraction: float = 0.0  # takes that wait `slow_take_s` before answering
    slow_take_s: float = 0.5
    cancel: set = dataclasses.field(default_factory=set)  # job ids stopped through job-stop ...
    cancel_after_s: float = 0.2  # ... this long after they were taken (once the job is running)
    seed: int = 0


@dataclasses.dataclass
class Post:
    """One result post as the stand-in received it."""

    job_id: str
    body: Any  # the parsed JSON, or the raw text when it was not JSON
    is_stream: bool
    status: int  # what the stand-in answered: 200 accepted, 500 a fault
    at: float


class JobQueue:
    """RunPod's job queue on 127.0.0.1. Thread-safe; use as a context manager or call close()."""

    def __init__(self, faults: Faults | None = None, take_hold_s: float = 0.2, stop_hold_s: float = 0.5):
        self.faults = faults or Faults()
        self.take_hold_s = take_hold_s  # how long an empty take is held open (a long poll)
        self.stop_hold_s = stop_hold_s
        self._random = random.Random(self.faults.seed)
        self._lock = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._to_stop: list[str] = []
        self._failing_results: dict[str, int] = {}  # job id -> 500s still to give
        self.jobs: dict[str, dict] = {}  # every job ever queued, by id
        self.takes: list[dict] = []  # one entry per take call: path, query, status, ids handed out
        self.taken: dict[str, float] = {}  # job id -> when it was handed out
        self.posts: list[Post] = []  # every result post (job-done), accepted or not
        self.stream_posts: list[Post] = []
        self.pings: list[dict] = []
        self.stop_polls = 0
        self.unknown: list[str] = []  # requests to a path the stand-in does not serve
        self._server = self._start()
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---- the test's side ------------------------------------------------------------------------

    def put(self, job_input: Any, job_id: str | None = None, raw: bytes | None = None) -> str:
        """Queue a job; `raw` replaces the whole job body as sent (for bodies that are not JSON)."""
        with self._lock:
            job_id = job_id or f"job-{len(self.jobs):05d}"
            self.jobs[job_id] = {"id": job_id, "input": job_input, "raw": raw}
            self._pending.append(job_id)
            self._failing_results[job_id] = self.faults.result_500s.get(job_id, 0)
            self._lock.notify_all()
            return job_id

    def stop(self, job_id: str) -> None:
        """Signal a stop (a cancel or a timeout) for the job through the job-stop channel."""
        with self._lock:
            self._to_stop.append(job_id)
            self._lock.notify_all()

    def env(self) -> dict[str, str]:
        """The variables that point the SDK's production loop at this stand-in, its start-up checks off: they open a
        TCP connection to a public address (8.8.8.8) and probe GPUs, and nothing may leave loopback."""
        prefix = f"{self.base}/v2/{ENDPOINT}"
        return {
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
            "RUNPOD_SKIP_GPU_CHECK": "true",
            "RUNPOD_WEBHOOK_GET_JOB": f"{prefix}/job-take/$ID?gpu=loopback",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{prefix}/job-done/$RUNPOD_POD_ID/$ID?gpu=loopback",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{prefix}/job-stream/$RUNPOD_POD_ID/$ID?gpu=loopback",
            "RUNPOD_WEBHOOK_PING": f"{prefix}/ping/$RUNPOD_POD_ID?gpu=loopback",
            "RUNPOD_POD_ID": WORKER_ID,
            "RUNPOD_AI_API_KEY": "loopback-only",  # the SDK pings only when a key is set; never a real one
            "RUNPOD_PING_INTERVAL": "1000",
        }

    def accepted(self, job_id: str | None = None) -> list[Post]:
        """Result posts answered 200 (for one job, or all)."""
        with self._lock:
            return [p for p in self.posts if p.status == 200 and (job_id is None or p.job_id == job_id)]

    def answers(self) -> dict[str, list[Any]]:
        """Job id -> the bodies of its accepted result posts."""
        out: dict[str, list[Any]] = collections.defaultdict(list)
        for post in self.accepted():
            out[post.job_id].append(post.body)
        return dict(out)

    def wait_for(self, done: Callable[[JobQueue], bool], timeout: float) -> bool:
        """Wait until done(self) holds (checked at each post), at most `timeout` seconds."""
        end = time.monotonic() + timeout
        with self._lock:
            while not done(self):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.5))
            return True

    def wait_answered(self, job_ids: Iterator[str], timeout: float) -> bool:
        wanted = set(job_ids)
        return self.wait_for(lambda q: wanted <= {p.job_id for p in q.posts if p.status == 200}, timeout)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the worker's side ----------------------------------------------------------------------

    def _take(self, count: int, hold: float) -> list[dict]:
        end = time.monotonic() + hold
        with self._lock:
            while not self._pending and time.monotonic() < end:
                self._lock.wait(max(end - time.monotonic(), 0.001))
            out = []
            while self._pending and len(out) < count:
                job_id = self._pending.popleft()
                self.taken[job_id] = time.monotonic()
                if job_id in self.faults.cancel:
                    timer = threading.Timer(self.faults.cancel_after_s, self.stop, [job_id])
                    timer.daemon = True
                    timer.start()
                out.append(self.jobs[job_id])
            return out

    def _stop_signals(self) -> list[str]:
        end = time.monotonic() + self.stop_hold_s
        with self._lock:
            self.stop_polls += 1
            while not self._to_stop and time.monotonic() < end:
                self._lock.wait(max(end - time.monotonic(), 0.001))
            out, self._to_stop = self._to_stop, []
            return out

    def _record_post(self, job_id: str, body: bytes, is_stream: bool, stream_chunk: bool) -> int:
        text = body.decode("utf-8", "replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        with self._lock:
            status = 200
            if not stream_chunk and self._failing_results.get(job_id, 0) > 0:
                self._failing_results[job_id] -= 1
                status = 500
            post = Post(job_id, parsed, is_stream, status, time.monotonic())
            (self.stream_posts if stream_chunk else self.posts).append(post)
            self._lock.notify_all()
            return status

    def _start(self) -> http.server.ThreadingHTTPServer:
        queue = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp expects

            def reply(self, status: int, body: Any = None):
                data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
                self.send_response(status)
                if data:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def route(self) -> tuple[list[str], dict]:
                parts = urllib.parse.urlsplit(self.path)
                segments = [s for s in parts.path.split("/") if s]
                if len(segments) < 3 or segments[:2] != ["v2", ENDPOINT]:
                    return [], {}
                return segments[2:], dict(urllib.parse.parse_qsl(parts.query))

            def do_GET(self):
                segments, query = self.route()
                kind = segments[0] if segments else ""
                if kind in ("job-take", "job-take-batch"):
                    self.take(kind, query)
                elif kind == "job-stop":
                    ids = queue._stop_signals()
                    self.reply(200, {"jobsToStop": ids}) if ids else self.reply(204)
                elif kind == "ping":
                    with queue._lock:
                        queue.pings.append(query)
                    self.reply(200)
                else:
                    queue.unknown.append(f"GET {self.path}")
                    self.reply(404)

            def take(self, kind: str, query: dict):
                faults = queue.faults
                with queue._lock:
                    draw = queue._random.random(), queue._random.random()
                entry = {"kind": kind, "query": query, "ids": [], "status": 200}
                if draw[0] < faults.slow_take_fraction:
                    time.sleep(faults.slow_take_s)
                if draw[1] < faults.take_500_fraction:
                    entry["status"] = 500
                    queue.takes.append(entry)
                    self.reply(500, {"error": "injected fault"})
                    return
                count = int(query.get("batch_size", "1")) if kind == "job-take-batch" else 1
                jobs = queue._take(count, queue.take_hold_s)
                entry["ids"] = [job["id"] for job in jobs]
                queue.takes.append(entry)
                if not jobs:
                    entry["status"] = 204
                    self.reply(204)
                elif kind == "job-take":
                    job = jobs[0]
                    self.reply(200, job["raw"] if job["raw"] is not None else {"id": job["id"], "input": job["input"]})
                else:
                    self.reply(200, [{"id": job["id"], "input": job["input"]} for job in jobs])

            def do_POST(self):
                segments, query = self.route()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                kind = segments[0] if segments else ""
                if kind in ("job-done", "job-stream") and len(segments) == 3:
                    status = queue._record_post(
                        segments[2], body, query.get("isStream") == "true", stream_chunk=kind == "job-stream"
                    )
                    self.reply(status, {} if status == 200 else {"error": "injected fault"})
                else:
                    queue.unknown.append(f"POST {self.path}")
                    self.reply(404)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False

            def handle_error(self, request, client_address):
                pass  # a worker stopped mid-request resets its connections: expected, not news

        server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server


# ---- the worker ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Worker:
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_kib(self) -> int:
        """Resident memory of the worker process (Linux /proc), in KiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def alive(self) -> bool:
        return self.process.poll() is None


@contextlib.contextmanager
def worker(
    queue: JobQueue, model_folder: Path | str, log_path: Path | str, script: str = "handler.py", **env: str
) -> Iterator[Worker]:
    """`python handler.py` (or `script`) in the SDK's production loop against `queue`, serving a tiny
    model on CPU; stopped with SIGTERM (then SIGKILL after 30 s) on exit. `env` adds or overrides
    variables (e.g. RUNPOD_LOG_LEVEL), but not `queue.env()`'s: nothing leaves loopback."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("VLM_", "RUNPOD_"))}
    variables.update(
        VLM_MODEL=str(model_folder),
        VLM_ALLOW_ANY="true",
        VLM_DEVICE_MAP="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONUNBUFFERED="1",
    )
    variables.update(env)
    variables.update(queue.env())  # last: the loopback addresses and the checks off hold whatever `env` says
    log_path = Path(log_path)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, script],
            cwd=ROOT,
            env=variables,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the SDK's ping process goes with it
        )
        running = Worker(process, log_path)
        try:
            yield running
        finally:
            stop_worker(process)


def stop_worker(process: subprocess.Popen, grace_s: float = 30) -> int | None:
    """SIGTERM (the SDK's graceful shutdown), SIGKILL to the process group if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # what lingers, and a ping process left behind
    return process.wait(timeout=10)
