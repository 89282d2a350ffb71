"""The worker as an HTTP server: RunPod's load-balancing endpoints (VLM_ENDPOINT_TYPE=lb) and local use.

RunPod's load balancer calls a worker directly on PORT and asks `/ping` on PORT_HEALTH whether it is
ready (200), still loading (204) or unhealthy (anything else). Every route answers through the same job
path as the queue (`run_job`, handler.handler), so requests in flight share the engine's continuous batch.

  POST /generate                     a queue job's body ({"input": {...}}) -> its output; `stream` as SSE
  POST /v1/chat/completions          OpenAI's chat completions (also under /openai/v1, RunPod's path)
  POST /v1/responses                 OpenAI's Responses API (also under /openai/v1)
  GET  /v1/models                    the served model
  GET  /ping, /health                readiness: 204 while the model loads, 200 when ready, 503 if broken
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

# Imported here, not where used: FastAPI reads the routes' annotations (`request: Request`) from this module.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("runpod-vlm")

# The HTTP status of each refusal: the caller's mistakes 400, a request too large for this worker 413,
# retry elsewhere 503, the worker's own faults 500.
STATUS_OF_CODE = {
    "out_of_memory": 413,
    "gpu_failure": 503,
    "worker_stopping": 503,
    "internal_error": 500,
    "generation_failed": 500,
    "worker_misconfigured": 500,
}


def http_status(code: str) -> int:
    return STATUS_OF_CODE.get(code, 400)


def sse(output: Any) -> str:
    """An output as a server-sent event; the OpenAI route's outputs already are."""
    return output if isinstance(output, str) else f"data: {json.dumps(output)}\n\n"


def make_app(run_job: Callable[[dict], Any], readiness: Callable[[], str]):
    """A FastAPI app over `run_job(job)` (an async generator of outputs) and `readiness()`
    ("initializing", "ready" or "unhealthy")."""
    app = FastAPI(title="runpod-vlm", docs_url=None, redoc_url=None)
    jobs = itertools.count(1)

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
        try:
            return await request.json()
        except ValueError:
            return "not JSON"  # refused by the route like any body that is not an object

    @app.post("/generate")
    async def generate(request: Request):
        body = await body_of(request)
        job_input = body.get("input") if isinstance(body, dict) else None
        result = await answered(job_input if isinstance(job_input, dict) else {"not": "an input"}, sse_chunks=True)
        if isinstance(result, dict) and "error" in result and "code" in result:
            return JSONResponse(result, status_code=http_status(result["code"]))
        return result if isinstance(result, Response) else JSONResponse(result)

    async def openai(route: str, body: Any = None):
        job_input = {"openai_route": route, **({"openai_input": body} if body is not None else {})}
        result = await answered(job_input, sse_chunks=False)
        if isinstance(result, dict) and isinstance(result.get("error"), dict):
            return JSONResponse(result, status_code=500 if result["error"]["type"] == "server_error" else 400)
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post("/v1/chat/completions")
    @app.post("/openai/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai("/v1/chat/completions", await body_of(request))

    @app.post("/v1/responses")
    @app.post("/openai/v1/responses")
    async def responses(request: Request):
        return await openai("/v1/responses", await body_of(request))

    @app.get("/v1/models")
    @app.get("/openai/v1/models")
    async def models():
        return await openai("/v1/models")

    app.add_api_route("/ping", ping_route(readiness), methods=["GET"])
    app.add_api_route("/health", ping_route(readiness, with_body=True), methods=["GET"])
    return app


def ping_route(readiness: Callable[[], str], with_body: bool = False):
    async def ping():
        state = readiness()
        status = {"ready": 200, "initializing": 204}.get(state, 503)
        if with_body and status != 204:
            return JSONResponse({"status": state}, status_code=status)
        return Response(status_code=status)

    return ping


def serve(app, host: str, port: int, health_port: int, readiness: Callable[[], str]) -> None:
    """Serve `app` on host:port, and `/ping` alone on health_port when it differs, until stopped."""
    import uvicorn

    servers = [uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))]
    if health_port != port:
        health = FastAPI(docs_url=None, redoc_url=None)
        health.add_api_route("/ping", ping_route(readiness), methods=["GET"])
        health_config = uvicorn.Config(health, host=host, port=health_port, log_level="warning", access_log=False)
        servers.append(uvicorn.Server(health_config))
    log.info("listening on http://%s:%d (health: /ping on port %d)", host, port, health_port)

    async def run_all():
        await asyncio.gather(*(server.serve() for server in servers))

    asyncio.run(run_all())
