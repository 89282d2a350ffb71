"""The worker as a local HTTP server: the OpenAI routes, the native route and /ping, as a RunPod
load-balancing worker serves them (runpod_vlm/http_server.py), on a port of your choice.

    python scripts/openai_server.py --port 8000

then `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")`. POST /v1/chat/completions and GET
/v1/models (also under /openai/v1/..., the path RunPod's gateway serves), POST /generate with a queue
job's body, GET /ping, /health and /metrics. Streamed answers come as text/event-stream; errors with
their HTTP status (400 the caller's, 500 the worker's). VLM_API_KEY, if set, is asked of every caller.
The model loads once the port is open (/ping says when it is ready); the worker's VLM_* settings apply.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import handler  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("VLM_LOG_LEVEL", "INFO"))
    handler.serve_http(handler.Settings.from_env(), args.host, args.port)


if __name__ == "__main__":
    main()
