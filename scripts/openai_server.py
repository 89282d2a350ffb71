"""A local OpenAI-compatible server for development and tests, on the worker's own OpenAI route.

    python scripts/openai_server.py --port 8000

then `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")`. POST /v1/chat/completions and GET
/v1/models (also under /openai/v1/..., the path RunPod's gateway serves) become the jobs RunPod's
gateway makes, {"openai_route": ..., "openai_input": <body>}, answered by `handler.handler`:
streamed answers as text/event-stream, errors with status 400 (invalid_request_error) or 500
(server_error). The model loads before the port opens; the worker's VLM_* settings apply.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

import handler  # noqa: E402

app = FastAPI(title="runpod-vlm, OpenAI-compatible (local)")


async def answer(route: str, body: Optional[Any] = None):
    job_input = {"openai_route": route}
    if body is not None:
        job_input["openai_input"] = body
    answers = handler.handler({"id": "local-openai", "input": job_input})  # the RunPod job's own path
    first = await anext(answers)
    if isinstance(first, str):  # a streamed answer: server-sent events, as the handler yields them

        async def events():
            try:
                yield first
                async for event in answers:
                    yield event
            finally:
                await answers.aclose()  # the client left: the engine frees the row

        return StreamingResponse(events(), media_type="text/event-stream")
    await answers.aclose()
    status = 200
    if "error" in first:
        status = 500 if first["error"]["type"] == "server_error" else 400
    return JSONResponse(first, status_code=status)


async def read_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return "not JSON"  # refused by the route like any body that is not an object


@app.post("/v1/chat/completions")
@app.post("/openai/v1/chat/completions")
async def chat_completions(request: Request):
    return await answer("/v1/chat/completions", await read_body(request))


@app.get("/v1/models")
@app.get("/openai/v1/models")
async def models():
    return await answer("/v1/models")


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("VLM_LOG_LEVEL", "INFO"))
    handler.get_engine().warm_up()  # as the worker does: load (and on a GPU compile) before serving
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
