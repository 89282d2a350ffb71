"""The worker's Prometheus metrics: requests by route and outcome, tokens, time to first token and latency, and the
engine's queue, rows, KV blocks and caches read at each scrape. Served at /metrics in the load-balancing mode, and
summed up in one log line a minute in the queue mode (no port to scrape there)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runpod_vlm.vocabulary import Generation

log = logging.getLogger("runpod-vlm")

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 330)


class Metrics:
    """One per process (`METRICS`); its registry holds nothing else, so tests and benchmarks read it alone."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "vlm_requests", "Requests answered, by route and outcome (ok or the error code)", ["route", "outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter("vlm_prompt_tokens", "Prompt tokens of answered items", registry=self.registry)
        self.completion_tokens = Counter("vlm_completion_tokens", "Tokens generated", registry=self.registry)
        self.first_token = Histogram(
            "vlm_time_to_first_token_seconds", "From an item's submission to its first token (continuous batching)",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "vlm_item_seconds", "From an item's submission to its answer", buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self._view: Callable[[], Any] = lambda: None
        self.registry.register(_EngineCollector(lambda: self._view()))

    def watch(self, view: Callable[[], Any]) -> None:
        """Read the engine's gauges through `view()` (an EngineView, or None before the engine exists)."""
        self._view = view

    def request_done(self, route: str, outcome: str) -> None:
        self.requests.labels(route, outcome).inc()

    def item_finished(self, ticket, result) -> None:
        """An engine item's end (`Engine.on_finished`, on the engine thread)."""
        if isinstance(result, Generation):
            self.prompt_tokens.inc(result.prompt_tokens)
            self.completion_tokens.inc(result.completion_tokens)
            self.latency.observe(time.monotonic() - ticket.submitted_at)
        if ticket.first_token_at is not None:
            self.first_token.observe(ticket.first_token_at - ticket.submitted_at)

    def exposition(self) -> bytes:
        """The text format of /metrics."""
        return generate_latest(self.registry)

    def summary(self) -> str:
        """One log line of the counts so far and the engine's state now."""
        done: dict[str, int] = {}
        for sample in self.requests.collect()[0].samples:
            if sample.name == "vlm_requests_total":
                done[sample.labels["outcome"]] = done.get(sample.labels["outcome"], 0) + int(sample.value)
        view = self._view()
        engine = (
            f"queue {view.queued}, rows {view.running}, KV blocks {view.kv_blocks_used}/{view.kv_blocks} "
            f"({view.kv_blocks_cached} cached), image cache {view.image_cache_hits} hits"
            if view is not None
            else "engine not loaded"
        )
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(done.items())) or "none"
        prompt, generated = (
            int(self.registry.get_sample_value(f"vlm_{n}_tokens_total")) for n in ("prompt", "completion")
        )
        return f"metrics: requests {outcomes}; tokens {prompt} prompt, {generated} generated; {engine}"


class _EngineCollector:
    """The engine's gauges and cache counters, read at each scrape from its view."""

    def __init__(self, view: Callable[[], Any]):
        self.view = view

    def describe(self):
        return []

    def collect(self):
        view = self.view()
        if view is None:
            return
        gauges = {
            "vlm_queue_depth": ("Items waiting for a row", view.queued),
            "vlm_running_rows": ("Rows decoding (and prompts entering in chunks)", view.running + view.prefilling),
            "vlm_kv_blocks": ("KV cache blocks in all", view.kv_blocks),
            "vlm_kv_blocks_used": ("KV cache blocks held by rows", view.kv_blocks_used),
            "vlm_kv_blocks_cached": ("KV cache blocks kept for their prompt prefix", view.kv_blocks_cached),
        }
        for name, (text, value) in gauges.items():
            yield GaugeMetricFamily(name, text, value=value)
        counters = {
            "vlm_prefix_cache_hit_tokens": ("Prompt tokens read from cached blocks", "prefix_cached_tokens"),
            "vlm_prefilled_prompt_tokens": ("Prompt tokens placed in the KV cache", "prompt_tokens"),
        }
        for name, (text, key) in counters.items():
            yield CounterMetricFamily(name, text, value=view.timings.get(key, 0))
        yield CounterMetricFamily("vlm_image_cache_hits", "Images found encoded", value=view.image_cache_hits)
        yield CounterMetricFamily("vlm_image_cache_misses", "Images encoded", value=view.image_cache_misses)


def outcome_of(output: Any) -> Optional[str]:
    """An output's outcome: its error code, 'ok', or None for a stream's piece (a text chunk or an SSE event)."""
    if isinstance(output, dict):
        error = output.get("error")
        if isinstance(error, dict):
            return str(error.get("code") or error.get("type") or "error")
        if error is not None:
            return str(output.get("code") or "error")
        return None if "text" in output and "finish_reason" not in output else "ok"
    if isinstance(output, str):  # the OpenAI routes' server-sent events
        if output.startswith('data: {"error"') or "event: response.failed" in output or "event: error" in output:
            return "error"
        return "ok" if "data: [DONE]" in output or "event: response.completed" in output else None
    return None


def log_every(seconds: float, metrics: Metrics, stop: threading.Event) -> threading.Thread:
    """The queue mode's summary: one line every `seconds` while requests come (none while nothing changes)."""

    def run() -> None:
        last = None
        while not stop.wait(seconds):
            line = metrics.summary()
            if line != last:
                log.info(line)
                last = line

    thread = threading.Thread(target=run, name="vlm-metrics-log", daemon=True)
    thread.start()
    return thread


METRICS = Metrics()
