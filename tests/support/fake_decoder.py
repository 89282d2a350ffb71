"""The decoder, faked: PagedDecoder's protocol in plain Python over the real block bookkeeping."""

from __future__ import annotations

import math

from runpod_vlm.engine.blocks import BlockPool
from runpod_vlm.engine.decoder import PagedDecoder, row_buckets
from runpod_vlm.engine.host_copies import Launched
from support.fake_hub import EOS, FILLER, HUB, PAD, VOCAB
from support.fake_torch import FakeTensor
from support.stubbed_api import _quiet

# =================================================================================================
# The decoder, faked: PagedDecoder's protocol in plain Python
# =================================================================================================


class FakeChunked:
    """A chunked prompt as the fake decoder holds it: the whole prompt's inputs, fed `size` tokens a call."""

    def __init__(self, inputs, row, params, prior):
        self.inputs, self.row, self.params, self.prior, self.done = inputs, row, params, prior, 0
        self.length = sum(inputs["attention_mask"]._data[0])


class FakeStepGraphs:
    """StepGraphs' face over the fake decoder: only decode steps' graphs, each asked for ahead of need, recorded into
    HUB.captured_ahead as (bucket, compiled forward, rows busy)."""

    def __init__(self, decoder, enabled):
        self.decoder, self.enabled = decoder, enabled
        self.graphs, self.ahead = {}, []  # the buckets whose graphs are to be recorded while the engine is idle
        self.capture_lock, self.recording_wanted, self.capture_s = None, False, 0.0

    def ask_ahead(self, bucket):
        self.ahead.append(bucket)

    def due(self, ahead=True):
        return bool(self.ahead and ahead)

    def capture_one_ahead(self, ahead=True):
        if self.due(ahead):
            bucket = self.ahead.pop(0)
            decoder = self.decoder
            HUB.captured_ahead.append((bucket, decoder.forwards[bucket] is not decoder.model, bool(decoder.lengths)))

    def drop(self, bucket):
        self.graphs = {key: graph for key, graph in self.graphs.items() if key[0] != bucket}


class FakePagedDecoder(PagedDecoder):
    """The real decoder's block bookkeeping (its BlockPool, buckets, forwards) with rows that answer HUB's
    script for their prompt: the fake logits are 10 for the script's token, HUB.runner_up_logit for
    FILLER and 0 elsewhere; end tokens are blocked before min_new_tokens, the generation config's
    repetition penalty applies, and sampled rows draw at their temperature and top_p from HUB.rng.
    A resumed row (preempted, its tokens after its prompt) continues its script where it stopped; a
    chunked prompt is fed `size` tokens a call. Every step checks that each busy row holds the blocks
    of its tokens. The tensor side of the real decoder is tested on real tiny models (tests/)."""

    def __init__(
        self, model, eos_ids, rows, blocks, block_size, use_graph, interval, max_row_tokens=None, prefill_tokens=None
    ):
        self.model, self.eos_ids, self.rows = model, set(eos_ids), rows
        self.interval, self.block_size = interval, block_size
        self.pool = BlockPool(blocks, block_size)
        self.columns = self.pool.capacity + 1
        self.buckets = row_buckets(rows)
        self.forwards = {bucket: model for bucket in self.buckets}
        self.lengths, self.any_sample = {}, False
        self.any_logprobs = self.any_constrained = False  # logprobs and grammars: tested on real tiny models
        self.answers: dict = {}  # row -> its script, tokens so far, params and seen tokens
        self.decode_kernel = False  # as on the CPU
        self.eager_steps = 0
        self.step_graphs = FakeStepGraphs(self, use_graph)
        self.prompts = self  # it takes prompts itself (the real decoder's Prefill part)
        self.packs, self.prefilled = None, []
        HUB.decoders.append(self)

    def grow(self, row, tokens):
        self.pool.grow(row, tokens)

    def share(self, row, blocks):
        HUB.shared.append((row, list(blocks)))
        self.pool.share(row, blocks)

    def prefill(self, inputs, rows, params, allowed=None, prior=None):
        HUB.forward_rows.append(len(rows))
        prior = prior or [0] * len(rows)
        ids_rows = [ids[len(ids) - p :] if p else [] for ids, p in zip(inputs["input_ids"]._data, prior)]
        with _quiet():
            prompt_ids = FakeTensor([ids[: len(ids) - p] for ids, p in zip(inputs["input_ids"]._data, prior)])
            mask = inputs.get("attention_mask")
            prompt_mask = FakeTensor([m[: len(m) - p] for m, p in zip(mask._data, prior)]) if mask is not None else None
        prompts, lengths = self.model._prompts(prompt_ids, prompt_mask)
        HUB.resumed.extend(prompt for prompt, p in zip(prompts, prior) if p)
        pixels = inputs.get("pixel_values") if hasattr(inputs, "get") else None
        width = len(inputs["input_ids"]._data[0])
        HUB.prefills.append(
            dict(prompts=prompts, pixel_dtype=getattr(pixels, "_dtype", None), keys=sorted(inputs), width=width)
        )
        first = []
        for row, prompt, p, ids, done, length in zip(rows, prompts, params, prompt_ids._data, ids_rows, lengths):
            self.grow(row, length + len(done))
            self.lengths[row] = length + len(done)
            self.answers[row] = dict(script=HUB.script(prompt), tokens=list(done), params=p, seen=set(ids) | set(done))
            first.append(self._next(row))
        self.prefilled = [self.lengths[row] for row in rows]
        self.any_sample = any(a["params"].do_sample for a in self.answers.values())
        return first

    def begin_chunks(self, inputs, row, params, prior=0):
        HUB.chunked.append(row)
        return FakeChunked(inputs, row, params, prior)

    def prefill_chunk(self, chunked, size, allowed=None):
        end = min(chunked.done + size, chunked.length)
        HUB.chunks.append((chunked.row, end - chunked.done))
        self.pool.grow(chunked.row, end)
        chunked.done = end
        if end < chunked.length:
            return None
        first = self.prefill(chunked.inputs, [chunked.row], [chunked.params], allowed, [chunked.prior])
        return Launched(1, [first], (), None, (chunked.row,))

    def _next(self, row):
        answer = self.answers[row]
        p, k = answer["params"], len(answer["tokens"])
        logits = [0.0] * VOCAB
        logits[FILLER] = HUB.runner_up_logit
        logits[answer["script"][k] if k < len(answer["script"]) else EOS] = 10.0
        if HUB.repetition_penalty:
            for token in answer["seen"]:
                if token < VOCAB:
                    logits[token] = (
                        logits[token] / HUB.repetition_penalty
                        if logits[token] > 0
                        else (logits[token] * HUB.repetition_penalty)
                    )
        if k < p.min_new_tokens:
            for token in self.eos_ids:
                if token < VOCAB:
                    logits[token] = float("-inf")
        if p.do_sample:
            scaled = [x / max(p.temperature, 1e-5) for x in logits]
            top = max(scaled)
            weights = [math.exp(x - top) for x in scaled]
            total = sum(weights)
            order = sorted(range(VOCAB), key=lambda i: -weights[i])
            kept, mass = [], 0.0
            for i in order:
                if mass > p.top_p * total:
                    break
                kept.append(i)
                mass += weights[i]
            token = HUB.rng.choices(kept, [weights[i] for i in kept])[0]
        else:
            token = max(range(VOCAB), key=lambda i: logits[i])
        answer["tokens"].append(token)
        answer["seen"].add(token)
        return token

    def release(self, row):
        self.pool.release(row)
        self.lengths.pop(row, None)
        self.answers.pop(row, None)
        self.any_sample = any(a["params"].do_sample for a in self.answers.values())

    def advance(self, bucket, span=None):
        HUB.forward_rows.append(bucket)
        if self.forwards[bucket] is not self.model:
            HUB.compiled_steps.append(bucket)

    def launch(self, steps):  # the tokens are chosen at once; the engine hands them out after the next launch
        return Launched(steps, self.step(steps), (), None)

    def read(self, launched):
        return launched.tokens

    def prefill_launch(self, inputs, rows, params, allowed=None, prior=None, shared=None):
        first = self.prefill(inputs, rows, params, allowed, prior)  # computed whole, as a padded prefill
        return Launched(1, [[token] for token in first], (), None, tuple(rows))

    def step(self, steps):
        bucket = self.bucket()
        HUB.steps.append((bucket, steps, self.forwards[bucket] is not self.model))
        for row, length in self.lengths.items():  # steps past a row's budget write block 0: their tokens are dropped
            answer = self.answers[row]
            written = min(length + steps, length + answer["params"].max_new_tokens - len(answer["tokens"]))
            if self.pool.blocks_for(written) > len(self.pool.table(row)):
                HUB.protocol_errors.append(f"row {row} stepped past its blocks")
        for _ in range(steps):
            self.advance(bucket)
        for row in self.lengths:
            self.lengths[row] += steps
        return [
            [self._next(row) for _ in range(steps)] if row in self.answers else [PAD] * steps for row in range(bucket)
        ]
