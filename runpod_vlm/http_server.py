"""The worker as an HTTP server: RunPod's load-balancing endpoints (VLM_ENDPOINT_TYPE=lb) and local use.

RunPod's load balancer calls a worker directly on PORT and asks `/ping` on PORT_HEALTH whether it is
ready (200), still loading (204) or unhealthy (anything else). Every route answers through the same job
path as the queue (`run_job`, handler.handler), so requests in flight share the engine's continuous batch.

  POST /generate                     a queue job's body ({"input": {...}}) -> its output; `stream` as SSE
  POST /v1/chat/completions          OpenAI's chat completions (also under /openai/v1, RunPod's path)
  POST /v1/responses                 OpenAI's Responses API (also under /openai/v1)
  GET  /v1/models                    the served model
  GET  /metrics                      Prometheus metrics
  GET|HEAD /ping, /health            readiness: 204 while the model loads, 200 when ready, 503 if broken

What it trusts (docs/security.md): nobody, unless VLM_API_KEY is set, then whoever sends it (every route but
/ping and /health). A request's head and then its body must each arrive within VLM_HTTP_TIMEOUT_S, a body is at
most VLM_MAX_BODY_BYTES, and no schema of the routes is served. Every refusal is an error object:
`{"error": {"message", "type", "param", "code"}}`, OpenAI's shape, on the native route too.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any, Optional

import h11

# Imported here, not where used: FastAPI reads the routes' annotations (`request: Request`) from this module.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from runpod_vlm.openai_route import openai_error
from runpod_vlm.vocabulary import RequestError

log = logging.getLogger("runpod-vlm")

# The HTTP status of each refusal: the caller's mistakes 400, a request too large for this worker 413,
# retry elsewhere 503, the worker's own faults 500.
STATUS_OF_CODE = {
    "unauthorized": 401,
    "request_timeout": 408,
    "body_too_large": 413,
    "out_of_memory": 413,
    "gpu_failure": 503,
    "worker_stopping": 503,
    "model_load_failed": 503,
    "internal_error": 500,
    "generation_failed": 500,
    "worker_misconfigured": 500,
}
OPEN_PATHS = ("/ping", "/health")  # RunPod's load balancer asks them without the worker's key


def http_status(code: str) -> int:
    return STATUS_OF_CODE.get(code, 400)


def sse(output: Any) -> str:
    """An output as a server-sent event; the OpenAI route's outputs already are."""
    return output if isinstance(output, str) else f"data: {json.dumps(output)}\n\n"


def refusal(error: RequestError) -> JSONResponse:
    """A refusal as an HTTP response: OpenAI's error object, the code's status."""
    return JSONResponse(openai_error(error), status_code=http_status(error.code))


def native_refusal(output: dict) -> Optional[RequestError]:
    """The RequestError a native route's output carries (the queue's shape: its message as JSON text), if any."""
    if not (isinstance(output, dict) and "error" in output and "code" in output):
        return None
    try:
        message = json.loads(output["error"])["error_message"]
    except (TypeError, ValueError, KeyError):
        message = str(output["error"])
    param = output.get("param")
    if param and message.startswith(f"{param}: "):
        message = message[len(param) + 2 :]
    return RequestError(output["code"], message, param)


def make_app(
    run_job: Callable[[dict], Any],
    readiness: Callable[[], str],
    api_key: str = "",
    max_body_bytes: int = 30_000_000,
    timeout_s: float = 30.0,
    metrics: Optional[Callable[[], bytes]] = None,
):
    """A FastAPI app over `run_job(job)` (an async generator of outputs) and `readiness()` ("initializing", "ready"
    or "unhealthy"); with `api_key`, every route but /ping and /health asks for it; `metrics()`: the text of
    /metrics."""
    app = FastAPI(title="runpod-vlm", docs_url=None, redoc_url=None, openapi_url=None)
    jobs = itertools.count(1)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path not in OPEN_PATHS and not carries_key(request, api_key):
            return refusal(RequestError("unauthorized", "a valid API key is required (Bearer or X-Api-Key)"))
        return await call_next(request)

    async def answered(job_input: dict, sse_chunks: bool):
        """The job's first output, and a response that sends the rest as server-sent events when it streams."""
        outputs = run_job({"id": f"http-{next(jobs)}", "input": job_input})
        first = await anext(outputs)
        if isinstance(first, str) or (sse_chunks and isinstance(first, dict) and "text" in first):

            async def events():
                try:
                    yield sse(first)
                    async for output in outputs:
                        yield sse(output)
                finally:
                    await outputs.aclose()  # the client left: the engine frees the row

            return StreamingResponse(events(), media_type="text/event-stream")
        await outputs.aclose()
        return first

    async def body_of(request: Request) -> Any:
        """The request's JSON body, read within `timeout_s` and `max_body_bytes`; raises the RequestError that says
        what was wrong with it."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise RequestError("body_too_large", f"the body is over {max_body_bytes} bytes", "body")
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise RequestError("body_too_large", f"the body is over {max_body_bytes} bytes", "body")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:
            raise RequestError("request_timeout", f"the body did not arrive within {timeout_s:g}s", "body") from None
        try:
            return await asyncio.to_thread(json.loads, b"".join(chunks))
        except RecursionError:
            raise RequestError("invalid_request", "the body is nested too deep", "body") from None
        except ValueError:
            raise RequestError("invalid_json", "the body is not JSON", "body") from None

    async def object_body(request: Request) -> dict:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise RequestError("invalid_request", "the body must be a JSON object", "body")
        return body

    @app.post("/generate")
    async def generate(request: Request):
        try:
            job_input = (await object_body(request)).get("input")
            if not isinstance(job_input, dict):
                raise RequestError("invalid_request", "the body needs an 'input' object", "input")
        except RequestError as error:
            return refusal(error)
        result = await answered(job_input, sse_chunks=True)
        refused = native_refusal(result)
        if refused is not None:
            return refusal(refused)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def openai(route: str, request: Optional[Request] = None):
        if request is not None:
            try:
                body = await object_body(request)
            except RequestError as error:
                return refusal(error)
        job_input = {"openai_route": route, **({"openai_input": body} if request is not None else {})}
        result = await answered(job_input, sse_chunks=False)
        if isinstance(result, dict) and isinstance(result.get("error"), dict):
            error = result["error"]
            status = http_status(error.get("code") or "")
            server_side = error["type"] == "server_error" and status == 400
            return JSONResponse(result, status_code=500 if server_side else status)
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post("/v1/chat/completions")
    @app.post("/openai/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai("/v1/chat/completions", request)

    @app.post("/v1/responses")
    @app.post("/openai/v1/responses")
    async def responses(request: Request):
        return await openai("/v1/responses", request)

    @app.get("/v1/models")
    @app.get("/openai/v1/models")
    async def models():
        return await openai("/v1/models")

    if metrics is not None:

        @app.get("/metrics")
        async def prometheus():
            return Response(await asyncio.to_thread(metrics), media_type="text/plain; version=0.0.4")

    app.add_api_route("/ping", ping_route(readiness), methods=["GET", "HEAD"])
    app.add_api_route("/health", ping_route(readiness, with_body=True), methods=["GET", "HEAD"])
    return app


def carries_key(request: Request, api_key: str) -> bool:
    """Whether the request carries `api_key`: as `Authorization: Bearer <key>`, or in `X-Api-Key` (behind RunPod's
    load balancer, whose own key may take the Authorization header)."""
    bearer = request.headers.get("authorization", "")
    offered = [bearer[7:] if bearer[:7].lower() == "bearer " else "", request.headers.get("x-api-key", "")]
    return any(hmac.compare_digest(key.encode(), api_key.encode()) for key in offered if key)


def ping_route(readiness: Callable[[], str], with_body: bool = False):
    async def ping(request: Request):
        state = readiness()
        status = {"ready": 200, "initializing": 204}.get(state, 503)
        if with_body and status != 204 and request.method == "GET":
            return JSONResponse({"status": state}, status_code=status)
        return Response(status_code=status)

    return ping


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head (uvicorn has none: a client sending a byte a
    second kept its connection, and a task, for as long as it liked). The body's deadline is the app's."""

    head_timeout_s = 30.0

    answered = 0  # responses sent on this connection

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        self.answered += 1
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self.loop.call_later(self.head_timeout_s, self._head_overdue, self.answered)

    def _head_overdue(self, answered: int) -> None:
        """Close the connection if it still waits for the head of the request it awaited when armed."""
        waiting = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
        if waiting and answered == self.answered and not self.transport.is_closing():
            self.transport.close()


def serve(app, host: str, port: int, health_port: int, readiness: Callable[[], str], timeout_s: float = 30.0) -> None:
    """Serve `app` on host:port, and `/ping` alone on health_port when it differs, until stopped."""
    import uvicorn

    protocol = type("HeadDeadline", (HeadDeadlineProtocol,), {"head_timeout_s": timeout_s})
    options = dict(host=host, log_level="warning", access_log=False, http=protocol, timeout_keep_alive=5)
    servers = [uvicorn.Server(uvicorn.Config(app, port=port, **options))]
    if health_port != port:
        health = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        health.add_api_route("/ping", ping_route(readiness), methods=["GET", "HEAD"])
        servers.append(uvicorn.Server(uvicorn.Config(health, port=health_port, **options)))
    log.info("listening on http://%s:%d (health: /ping on port %d)", host, port, health_port)

    async def run_all():
        await asyncio.gather(*(server.serve() for server in servers))

    asyncio.run(run_all())
