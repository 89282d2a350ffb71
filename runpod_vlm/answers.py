"""Engine events back to a job: whole answers, text pieces cut at stop sequences, one stream pacer, output fields."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import time
from typing import TYPE_CHECKING, Optional

from runpod_vlm.grounding import grounding_fields
from runpod_vlm.text_deltas import TextDeltas
from runpod_vlm.vocabulary import Generation, GenerationRequest, Outcome, RequestError, StreamDelta

if TYPE_CHECKING:
    from runpod_vlm.engine.engine import Engine
    from runpod_vlm.request import RequestModel


def generate_all(
    engine: Engine, items: list[GenerationRequest], cancelled: Optional[threading.Event] = None
) -> list[Outcome]:
    """Answer items through the engine, beside other jobs' items, in input order; blocks the calling thread. Once
    `cancelled` is set (its job was cancelled), every item still queued or decoding is given up at the engine's next
    step, and this returns what has been answered (None for the rest)."""
    results: list[Optional[Outcome]] = [None] * len(items)
    finished = threading.Semaphore(0)

    def on_event(index: int, event) -> None:
        if not isinstance(event, StreamDelta):
            results[index] = event
            finished.release()

    tickets = engine.submit_all(items, [functools.partial(on_event, index) for index in range(len(items))])
    for _ in items:
        while not finished.acquire(timeout=0.05 if cancelled is not None else None):
            if cancelled.is_set():
                for ticket in tickets:
                    ticket.cancel()
                return results  # type: ignore[return-value]
    return results  # type: ignore[return-value]


def choice_items(item: GenerationRequest) -> list[GenerationRequest]:
    """The items of a request for `item.choices` choices: the same prompt, each its own seed stream (choice k of a
    request seeded s draws as a one-choice request seeded s + k, within int64; unseeded, each draws anew)."""
    if item.choices == 1:
        return [item]

    def seeded(k: int) -> Optional[int]:
        seed = item.params.seed
        return None if seed is None else (seed + k + 2**63) % 2**64 - 2**63

    return [
        dataclasses.replace(item, params=dataclasses.replace(item.params, seed=seeded(k)), choices=1)
        for k in range(item.choices)
    ]


def stream_generations(engine: Engine, items: list[GenerationRequest], stream: bool = True) -> list:
    """Submit items together and give each its events: StreamDelta events (when `stream`), then the Generation or
    RequestError; closing an item's events early cancels it. Items that are choices of one request (more than one,
    from `choice_items`) share their prompt's preparation and KV blocks. The engine streams token ids; their text is
    decoded here, on the job's side, not on the engine thread. Call from the event loop."""
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in items]
    listeners = [functools.partial(loop.call_soon_threadsafe, queue.put_nowait) for queue in queues]
    tickets = engine.submit_all(items, listeners, stream, same_prompt=len(items) > 1)
    return [_events(engine, queue, ticket) for queue, ticket in zip(queues, tickets)]


def stream_generation(engine: Engine, item: GenerationRequest, stream: bool = True):
    """One item's events (`stream_generations`)."""
    return stream_generations(engine, [item], stream)[0]


async def _events(engine: Engine, events: asyncio.Queue, ticket):
    text: Optional[TextDeltas] = None
    try:
        while True:
            event = await events.get()
            if isinstance(event, StreamDelta) and event.ids is not None:
                text = text or TextDeltas(engine.tokenizer)
                event = dataclasses.replace(event, text=text.delta(event.ids), ids=None)
            yield event
            if not isinstance(event, StreamDelta):
                return
    finally:
        ticket.cancel()  # no effect once finished; otherwise frees its row at the next step


async def generate_one(engine: Engine, item: GenerationRequest) -> Outcome:
    """The final Generation or RequestError of one item."""
    return [event async for event in stream_generation(engine, item, stream=False)][-1]


async def generate_choices(engine: Engine, item: GenerationRequest) -> list[Outcome]:
    """The final Generation or RequestError of each of an item's choices, in order."""

    async def last(events) -> Outcome:
        async with contextlib.aclosing(events):
            return [event async for event in events][-1]

    return list(await asyncio.gather(*(last(e) for e in stream_generations(engine, choice_items(item), False))))


def format_output(engine: Engine, item: GenerationRequest, generation: Generation, request: RequestModel) -> dict:
    output = {
        "response": generation.text,
        "model": engine.model_id,
        "task": item.task,
        "image_count": len(item.images),
        "finish_reason": generation.finish_reason,
        "usage": {"prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens},
    }
    if generation.logprobs is not None:
        output["logprobs"] = generation.logprobs
    if item.task == "grounding":
        output.update(grounding_fields(item, generation, engine.adapter))
    if request.batch_images is not None:
        output["batch_images"] = request.batch_images
    if request.quantize is not None and request.quantize != engine.quantize:
        output.update(
            quantize=engine.quantize,
            quantize_warning=f"the model was loaded as {engine.quantize!r}; "
            f"the requested {request.quantize!r} applies only when a request loads the model "
            "(VLM_LOAD_AT_BOOT=false)",
        )
    return output


def format_choices(engine: Engine, item: GenerationRequest, outcomes: list[Outcome], request: RequestModel):
    """A request's `n` answers as one output: the first choice's fields, then every choice, and usage as OpenAI sums
    it (the prompt once, every choice's tokens); or the first choice's error."""
    refused = next((outcome for outcome in outcomes if isinstance(outcome, RequestError)), None)
    if refused is not None:
        return refused
    output = format_output(engine, item, outcomes[0], request)
    skipped = ("model", "task", "image_count", "usage", "batch_images", "quantize", "quantize_warning")
    output["choices"] = [
        {
            "index": k,
            **{name: value for name, value in format_output(engine, item, g, request).items() if name not in skipped},
        }
        for k, g in enumerate(outcomes)
    ]
    output["usage"]["completion_tokens"] = sum(g.completion_tokens for g in outcomes)
    return output


async def answer_pieces(engine: Engine, item: GenerationRequest, stops: list[str], stream: bool, events=None):
    """Yields the answer's text as it becomes safe to show (when `stream`), then its Generation, cut
    before the first stop sequence; raises the item's RequestError. A stop or leaving early cancels the item.
    `events`: the item's events, when submitted already (`stream_generations(..., stream or bool(stops))`)."""
    events = events or stream_generation(engine, item, stream or bool(stops))
    generated, shown = "", 0  # `shown` only grows when streaming
    try:
        async for event in events:
            if isinstance(event, RequestError):
                raise event
            if isinstance(event, Generation):
                break
            generated += event.text
            cut = min((i for i in (generated.find(stop, shown) for stop in stops) if i >= 0), default=None)
            if cut is not None:
                await events.aclose()  # before anything else is sent: the row stops generating now
                event = Generation(generated[:cut], "stop", event.prompt_tokens, event.completion_tokens)
                break
            # What could begin a stop sequence waits, and so do trailing spaces (the final text is stripped).
            held = max((k for stop in stops for k in range(1, len(stop)) if generated.endswith(stop[:k])), default=0)
            ready = min(len(generated) - held, len(generated.rstrip()))
            if stream and ready > shown:
                yield generated[shown:ready]
                shown = ready
        # The engine's own text is the answer when what was shown is a prefix of it.
        if not event.text.startswith(generated[:shown]):
            event = dataclasses.replace(event, text=generated)
        if stream and len(event.text) > shown:
            yield event.text[shown:]
        yield event
    finally:
        await events.aclose()


async def paced(pieces, interval_s: float):
    """`answer_pieces(...)` at most once per `interval_s`: (text, None) for text to send now, then (the text not
    sent yet, the Generation). The first text goes at once. Closing this closes `pieces` (which cancels the item)."""
    pending, last = "", float("-inf")
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            if not isinstance(piece, str):
                yield pending, piece
                return
            pending += piece
            if pending and time.monotonic() - last >= interval_s:
                yield pending, None
                pending, last = "", time.monotonic()


async def stream_chunks(engine: Engine, item: GenerationRequest, request: RequestModel):
    """A streamed answer as `{"text": ...}` chunks, at most one per VLM_STREAM_INTERVAL_MS; the last
    one carries finish_reason, usage and the other fields of a whole answer (but `response`)."""
    interval_s = engine.settings.stream_interval_ms / 1000
    try:
        async with contextlib.aclosing(paced(answer_pieces(engine, item, [], stream=True), interval_s)) as sent:
            async for text, final in sent:
                if final is None:
                    yield {"text": text}
                    continue
                fields = format_output(engine, item, final, request)
                del fields["response"]
                yield {"text": text, **fields}
    except RequestError as error:
        yield error.to_dict()
