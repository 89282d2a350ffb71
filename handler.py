"""runpod-vlm: a RunPod serverless worker that serves one vision-language model.

The path of a request (the parts live in runpod_vlm/, whose __init__ maps them):

  handler(job)                 an async generator, one asyncio task per job
    read_request               runpod_vlm.request: fields checked, turns built
    read_images                runpod_vlm.media: images fetched and decoded under the media policy
    read_videos                runpod_vlm.video: videos fetched, probed, and the card's frames decoded
    Engine.submit              runpod_vlm.engine: the engine thread batches it with other jobs' items
    generate_one / stream_chunks / format_output
                               runpod_vlm.answers: the engine's events back to the job, output fields
  openai_answers               runpod_vlm.openai_route: RunPod's /openai/v1 jobs, the same path
  responses_answers            runpod_vlm.responses_route: /v1/responses, the same path

Importing this module is cheap: torch, transformers and runpod are imported where they are used,
and the model loads at boot under `python handler.py` (or on the first job).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from runpod_vlm.answers import (
    format_choices,
    format_output,
    generate_all,
    generate_choices,
    generate_one,
    stream_chunks,
)
from runpod_vlm.engine.engine import Engine
from runpod_vlm.media import read_images
from runpod_vlm.metrics import METRICS, log_every, outcome_of
from runpod_vlm.openai_route import openai_answers
from runpod_vlm.request import read_request
from runpod_vlm.responses_route import responses_answers
from runpod_vlm.settings import Settings, SettingsError
from runpod_vlm.video import read_videos
from runpod_vlm.vocabulary import RequestError, as_request_error, cut_text, join_param

log = logging.getLogger("runpod-vlm")

METRICS_LOG_EVERY_S = 60.0
_RUNPOD_CONFIG: dict = {}  # the runpod SDK's config (main() fills it); a fatal GPU error sets refresh_worker
_engine: Optional[Engine] = None
_engine_lock = threading.Lock()
_load_failure: Optional[RequestError] = None  # the model could not be loaded: every job is told so, none retries


def get_engine(quantize: Optional[str] = None) -> Engine:
    """The process's engine, loaded on first use with `quantize` if the caller asked for one. A model that fails
    to load raises `model_load_failed` with the reason, then and for every later call."""
    global _engine, _load_failure
    if _engine is None:
        with _engine_lock:
            if _load_failure is not None:
                raise _load_failure
            if _engine is None:
                try:
                    engine = Engine(Settings.from_env(), quantize=quantize, on_fatal=_ask_for_a_new_worker)
                except SettingsError:
                    raise  # the operator's setting: each job says which, until it is fixed
                except Exception as failure:
                    log.exception("the model could not be loaded: every request is answered model_load_failed")
                    _load_failure = load_failed(failure)
                    raise _load_failure from None
                log.info("ready: %s", json.dumps({**engine.describe(), **_limits(engine.settings)}))
                engine.on_finished = METRICS.item_finished
                METRICS.watch(engine.view)
                _engine = engine
    return _engine


SECRET_SHAPES = re.compile(r"\b(hf|sk|rpa)_[A-Za-z0-9_-]{16,}|(?<=://)[^/@\s]+@")  # tokens, URL credentials


def load_failed(failure: Exception) -> RequestError:
    """What a caller is told of a model that failed to load: the exception's first line, with anything shaped like
    a token or a URL's credentials blanked; no traceback."""
    lines = str(failure).strip().splitlines()
    first = SECRET_SHAPES.sub("[redacted]", cut_text(lines[0], 300)) if lines else ""
    reason = f"{type(failure).__name__}: {first}" if first else type(failure).__name__
    return RequestError("model_load_failed", f"the model could not be loaded ({reason})")


def _limits(settings: Settings) -> dict:
    """The settings a caller meets, for the boot log."""
    names = ("max_concurrency", "max_new_tokens", "max_images", "max_total_pixels", "max_text_chars")
    media = settings.media
    return {
        **{name: getattr(settings, name) for name in names},
        "endpoint_type": settings.endpoint_type,
        "image_urls": "internal too" if media.allow_internal else ", ".join(media.allowed_domains) or "public https",
    }


def reset_engine() -> None:
    """Close and forget the loaded engine, or its load failure (tests, and benchmarks that load another in the
    same process)."""
    global _engine, _load_failure
    engine, _engine, _load_failure = _engine, None, None
    if engine is not None:
        engine.close()


def _ask_for_a_new_worker() -> None:
    """A fatal GPU error: the SDK reads refresh_worker after each job and stops this worker."""
    _RUNPOD_CONFIG["refresh_worker"] = True


def served_model() -> tuple[Settings, str]:
    """The settings and model id in force: the loaded engine's, else the environment's; raises `model_load_failed`
    once the model failed to load (before any image of the request is fetched)."""
    if _engine is not None:
        return _engine.settings, _engine.model_id
    if _load_failure is not None:
        raise _load_failure
    settings = Settings.from_env()
    return settings, settings.model


def read_job_item(raw: Any, settings: Settings, model_id: str, param: Optional[str] = None):
    """A request read and its images and videos fetched and decoded (blocks: call off the event loop)."""
    request, item = read_request(raw, settings, model_id, param)
    read_images(item, settings)
    read_videos(item, settings)
    return request, item


async def handler(job: dict):
    """RunPod entry, an async generator: a streamed request yields its answer in pieces, any other
    job yields one output (an answer, a batch's answers, or an error). Each job is counted by route and outcome."""
    route, outcome = route_of(job), "cancelled"
    try:
        async for output in answers_to(job):
            outcome = outcome_of(output) or outcome
            yield output
    finally:
        METRICS.request_done(route, outcome)


def route_of(job: Any) -> str:
    payload = job.get("input") if isinstance(job, dict) else None
    if not isinstance(payload, dict):
        return "invalid"
    if "openai_route" in payload:
        return str(payload["openai_route"]).removeprefix("/v1/").replace("/", "_")[:32] or "openai"
    return "batch" if "requests" in payload else "generate"


async def answers_to(job: dict):
    """The job's outputs (`handler`)."""
    _bound_the_shutdown()
    try:
        payload = job.get("input") if isinstance(job, dict) else None
        if not isinstance(payload, dict):
            raise RequestError("invalid_request", "the job needs an 'input' object", "input")
        if "openai_route" in payload:  # RunPod's /openai/v1/... gateway
            responses = payload["openai_route"] == "/v1/responses"
            async for answer in (responses_answers if responses else openai_answers)(get_engine, served_model, payload):
                yield answer
            return
        if "requests" in payload:
            cancelled = threading.Event()
            try:
                yield await asyncio.to_thread(answer_batch, job, payload, cancelled)
            finally:  # the job's task cancelled (RunPod's /cancel, a client gone): its rows stop at the next step
                cancelled.set()
            return
        settings, model_id = served_model()
        request, item = await asyncio.to_thread(read_job_item, payload, settings, model_id, None)
        engine = await asyncio.to_thread(get_engine, request.quantize)
        if request.stream:
            async for chunk in stream_chunks(engine, item, request):
                yield chunk
            return
        if item.choices > 1:
            result = format_choices(engine, item, await generate_choices(engine, item), request)
        else:
            result = await generate_one(engine, item)
            result = result if isinstance(result, RequestError) else format_output(engine, item, result, request)
        yield result.to_dict() if isinstance(result, RequestError) else result
    except Exception as failure:
        yield as_request_error(failure).to_dict()


def answer_batch(job: dict, payload: dict, cancelled: Optional[threading.Event] = None) -> dict:
    """A `{"requests": [...]}` call: every item answered (or refused) on its own; given up once `cancelled` is set."""
    extra = set(payload) - {"requests"}
    if extra:
        raise RequestError("invalid_request", "unknown field beside 'requests'", sorted(extra)[0])
    raw_items = payload["requests"]
    settings, model_id = served_model()
    if not isinstance(raw_items, list) or not raw_items:
        raise RequestError("invalid_request", "must be a non-empty list of requests", "requests")
    if len(raw_items) > settings.max_batch_requests:
        raise RequestError("too_many_requests", f"at most {settings.max_batch_requests} requests per call", "requests")

    def read_item(index: int, raw: Any):
        param = f"requests[{index}]"
        try:
            request, item = read_job_item(raw, settings, model_id, param)
            if request.stream or request.n > 1:
                field, what = ("stream", "cannot stream") if request.stream else ("n", "have one choice each")
                raise RequestError("invalid_request", f"items of a batch call {what}", join_param(param, field))
            return request, item
        except (RequestError, SettingsError) as error:
            return error
        except Exception:
            log.exception("could not read %s", param)
            return RequestError("internal_error", "this request could not be read", param)

    # Side by side: their images download and decode in parallel (Pillow's decoders release the GIL).
    with ThreadPoolExecutor(max_workers=min(8, len(raw_items))) as pool:
        outcomes = list(pool.map(read_item, range(len(raw_items)), raw_items))
    for outcome in outcomes:
        if isinstance(outcome, SettingsError):
            raise outcome
    results = [outcome.to_dict() if isinstance(outcome, RequestError) else None for outcome in outcomes]
    parsed = [(index, outcome) for index, outcome in enumerate(outcomes) if not isinstance(outcome, RequestError)]
    if parsed:  # the first request asking for a quantization decides it if this call loads the model
        engine = get_engine(next((request.quantize for _, (request, _) in parsed if request.quantize), None))
        answers = generate_all(engine, [item for _, (_, item) in parsed], cancelled)
        for (index, (request, item)), result in zip(parsed, answers):
            if result is None:  # cancelled: nobody reads this call's answer
                continue
            refused = isinstance(result, RequestError)
            results[index] = result.to_dict() if refused else format_output(engine, item, result, request)
    return {"model": model_id, "count": len(results), "id": job.get("id"), "results": results}


async def local_test_answer(job: dict) -> Any:
    """The job's whole output: its one output, or the list of a streamed job's chunks (what RunPod's
    `return_aggregate_stream` gives /runsync). For `--test_input`, which cannot iterate a generator."""
    outputs = [output async for output in handler(job)]
    return outputs[0] if len(outputs) == 1 and "text" not in outputs[0] else outputs


@functools.cache
def _bound_the_shutdown() -> None:
    """On SIGTERM the runpod SDK stops taking jobs and waits for those in flight, however long: this
    bounds the wait (VLM_SHUTDOWN_GRACE). Set by the first job in the SDK's loop, after the SDK's own."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if _engine is not None:
            _engine.stop_after(_engine.settings.shutdown_grace)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


def main() -> None:
    os.environ.setdefault("RUNPOD_LOG_LEVEL", "INFO")  # the SDK's DEBUG default logs every answer
    logging.basicConfig(level=os.environ.get("VLM_LOG_LEVEL", "INFO"))
    settings = Settings.from_env()
    if settings.endpoint_type == "lb":
        port, health_port = int(os.environ.get("PORT") or 80), int(os.environ.get("PORT_HEALTH") or 0) or None
        serve_http(settings, "0.0.0.0", port, health_port)
        return
    import runpod

    if settings.load_at_boot:
        try:
            get_engine().warm_up()  # load before taking jobs; the compiled step follows in the background
        except RequestError:
            pass  # model_load_failed, logged: every job is told so instead of the worker restarting in a loop
    local_test = any(arg.startswith("--test_input") for arg in sys.argv)
    if not local_test:
        log_every(METRICS_LOG_EVERY_S, METRICS, threading.Event())  # no port to scrape in the queue mode
    _RUNPOD_CONFIG.update(
        {
            "handler": local_test_answer if local_test else handler,
            "return_aggregate_stream": True,
            "concurrency_modifier": lambda current: 0 if _engine and _engine.broken else settings.max_concurrency,
        }
    )
    runpod.serverless.start(_RUNPOD_CONFIG)


def serve_http(settings: Settings, host: str, port: int, health_port: Optional[int] = None) -> None:
    """The worker as an HTTP server (RunPod's load-balancing endpoints, local use): it answers /ping
    at once (204 until the model is loaded, which happens meanwhile) and serves requests through `handler`."""
    from runpod_vlm.http_server import make_app, serve

    failed = threading.Event()

    def load() -> None:
        try:
            get_engine().warm_up()
        except Exception as failure:
            if not isinstance(failure, RequestError):  # model_load_failed is logged where it is raised
                log.exception("the worker could not start: /ping answers 503")
            failed.set()

    def readiness() -> str:
        if failed.is_set() or (_engine is not None and _engine.broken):
            return "unhealthy"
        return "ready" if _engine is not None else "initializing"

    threading.Thread(target=load, name="vlm-load", daemon=True).start()
    app = make_app(
        handler, readiness, settings.api_key, settings.max_body_bytes, settings.http_timeout_s, METRICS.exposition
    )
    serve(app, host, port, health_port or port, readiness, settings.http_timeout_s)


if __name__ == "__main__":
    main()
