"""Continuous-batching decoding over one static KV cache: rows join and leave at step boundaries."""

from __future__ import annotations

import copy
import logging
import random
import time
import types
from typing import Any, Optional

from runpod_vlm.vocabulary import GenerationParams

log = logging.getLogger("runpod-vlm")

MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound


def use_grouped_query_decode_attention(model) -> None:
    """Decode steps attend with SDPA's own grouped-query attention. transformers' SDPA path copies
    K/V for every query head (repeat_kv) whenever a mask is passed, which every decode step of a
    batch with rows of different lengths does: at 64 rows that copy was most of the step."""
    text_config = model.config.get_text_config(decoder=True)
    if getattr(text_config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is None or query.shape[2] != 1 or getattr(module, "num_key_value_groups", 1) == 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        import torch

        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True
        )
        return output.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sdpa_gqa_decode", attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa_gqa_decode", sdpa_mask)
    try:  # the text model only: the vision tower keeps its own attention
        model.set_attn_implementation({"text_config": "sdpa_gqa_decode"})
    except Exception:
        log.warning("grouped-query decode attention unavailable; using transformers' SDPA", exc_info=True)


def _beside_fx_traces(forward, rewind=None, **kwargs):
    """`forward(**kwargs)`, run again after a torch.fx trace (inductor's, compiling in the background) patched
    nn.Module.__call__ for the whole process under it; `rewind()` first undoes what the cut-off run moved."""
    import torch

    try:
        return forward(**kwargs)
    except NameError as error:
        if "not installed as a submodule" not in str(error) or (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        ):
            raise
    deadline = time.monotonic() + 60
    while torch.nn.Module.__call__ is not torch.nn.Module._wrapped_call_impl and time.monotonic() < deadline:
        time.sleep(0.001)
    if rewind is not None:
        rewind()
    return forward(**kwargs)


class SlotDecoder:
    """Continuous-batching decoding state: `rows` sequences over one static KV cache of `length` slots.

    Every row writes its next token at the same slot (the shared pointer), so a step has fixed shapes
    and replays as one CUDA graph whatever rows join or leave. A new row's prompt is prefilled alone,
    its keys/values copied into the slots just before the pointer; the mask hides the slots a row
    does not own. For room, all rows' slots shift at once (rotary positions live in the keys and per
    row, so a shift changes no result). A step runs the smallest bucket of leading rows holding every
    busy row. Greedy rows give `model.generate(do_sample=False)`'s tokens, alone or beside others."""

    pending_logprobs: Optional[dict] = None  # row -> (logprob, top ids, top logprobs) per new token

    def __init__(self, model, eos_ids: set, rows: int, length: int, use_graph: bool, interval: int):
        import torch

        with torch.inference_mode():  # like every tensor made later, on the engine or compile thread
            self._make_state(model, eos_ids, rows, length, use_graph, interval)

    def _make_state(self, model, eos_ids, rows, length, use_graph, interval) -> None:
        import torch

        device = model.device
        self.model, self.rows, self.length = model, rows, length
        self.use_graph, self.interval = use_graph, interval
        self.buckets = sorted({b for b in (8,) if b < rows} | {rows})
        self.forwards = {bucket: model for bucket in self.buckets}  # `use_forward` swaps in compiled ones
        self.graphs: dict = {}  # (bucket, any sampled row) -> CUDA graph of one step
        self.text_config = copy.copy(model.config.get_text_config(decoder=True))
        self.text_config.sliding_window, self.text_config.layer_types = None, None  # length <= window
        self.caches: dict[int, Any] = {}  # bucket -> StaticCache over the first `bucket` rows
        vocab = model.get_output_embeddings().weight.shape[0]
        self.eos_index = torch.tensor(sorted(i for i in eos_ids if i < vocab), dtype=torch.long, device=device)
        self.top_k = min(MAX_TOP_LOGPROBS, vocab)  # alternatives recorded per token when a row asks for logprobs
        self.vocab_index = torch.arange(vocab, device=device)
        self.mask_word, self.mask_bit = self.vocab_index // 32, self.vocab_index % 32  # a token's place in `allowed`
        penalty = getattr(model.generation_config, "repetition_penalty", None) or 1.0
        self.penalty = penalty if penalty != 1.0 else None
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.cache_position, self.ring_index = zeros(1), zeros(1)
        self.state = types.SimpleNamespace(
            token=zeros(rows, 1),
            mask=zeros(rows, length),
            count=zeros(rows),
            min_new=zeros(rows),
            sample=zeros(rows, dtype=torch.bool),
            temperature=zeros(rows, dtype=torch.float),
            top_p=zeros(rows, dtype=torch.float),
            seed=zeros(rows),
            logprobs=zeros(rows, dtype=torch.bool),
            constrained=zeros(rows, dtype=torch.bool),
            allowed=zeros(rows, (vocab + 31) // 32, dtype=torch.int32),  # bit-packed: 32 tokens a word
            ring=zeros(rows, interval),
            ring_logprob=zeros(rows, interval, dtype=torch.float),
            ring_top_id=zeros(rows, interval, self.top_k),
            ring_top_logprob=zeros(rows, interval, self.top_k, dtype=torch.float),
            seen=zeros(rows, vocab, dtype=torch.bool) if self.penalty else None,
        )
        self.position = None  # shaped like the family's position ids at the first prefill
        self.pointer = 0  # the slot the next step writes (host copy of cache_position)
        self.spans: dict[int, tuple[int, int]] = {}  # row -> (first slot, slot past its last token)
        self.any_sample = self.any_logprobs = self.any_constrained = False
        self.capture_failures = 0  # e.g. voided by the background compile's GPU work

    # ---- admission --------------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        """Whether the KV cache exists yet (it is shaped from the first prefill's keys)."""
        return bool(self.caches)

    def length_to_hold(self, prompt_length: int, max_new_tokens: int) -> int:
        """The cache length, doubling this one's, a decoder needs to hold one such request."""
        length = self.length
        while length < prompt_length + max_new_tokens + self.interval:
            length *= 2
        return length

    def free_rows(self) -> list[int]:
        return [row for row in range(self.rows) if row not in self.spans]

    def plan(self, prompt_length: int, max_new_tokens: int) -> Optional[int]:
        """The shift that makes room for a new row (0: none needed), or None if it cannot fit now."""
        if prompt_length + max_new_tokens + self.interval > self.length:
            return None
        if not self.spans:
            return prompt_length - self.pointer
        low, high = min(s for s, _ in self.spans.values()), max(e for _, e in self.spans.values())
        if self.pointer >= prompt_length and self.pointer + max_new_tokens + self.interval <= self.length:
            return 0
        shift = max(prompt_length - self.pointer, -low)
        fits = high + shift <= self.length and self.pointer + shift + max_new_tokens + self.interval <= self.length
        return shift if fits else None

    def shift(self, delta: int) -> None:
        """Move every row's slots by `delta` (negative: left)."""
        import torch

        if delta == 0:
            return
        full = self.caches.get(self.rows)
        for layer in full.layers if full else ():
            layer.keys.copy_(torch.roll(layer.keys, delta, dims=2))
            layer.values.copy_(torch.roll(layer.values, delta, dims=2))
        mask = self.state.mask
        mask.copy_(torch.roll(mask, delta, dims=1))
        if delta > 0:
            mask[:, :delta] = 0  # what wrapped around from the end
        else:
            mask[:, self.length + delta :] = 1  # future slots: hidden by causality until written
        self._set_pointer(self.pointer + delta)
        self.spans = {row: (s + delta, e + delta) for row, (s, e) in self.spans.items()}

    def _set_pointer(self, pointer: int) -> None:
        self.pointer = pointer
        self.cache_position.fill_(pointer)
        for cache in self.caches.values():  # transformers' StaticLayer writes at its own counter
            for layer in cache.layers:
                layer.cumulative_length.fill_(pointer)

    def _allocate(self, keys, values) -> None:
        """The static cache of all rows, shaped from a prefill's keys/values; each smaller bucket's
        cache holds views of its leading rows."""
        import torch
        from transformers import StaticCache

        caches = {}  # kept only whole: an allocation that runs out of memory leaves none
        for bucket in self.buckets:
            caches[bucket] = StaticCache(config=self.text_config, max_cache_len=self.length)
            for layer, k, v in zip(caches[bucket].layers, keys, values):
                layer.lazy_initialization(k[:1].expand(bucket, -1, -1, -1), v[:1].expand(bucket, -1, -1, -1))
        self.caches, full = caches, caches[self.rows]
        for bucket, cache in self.caches.items():
            if bucket != self.rows:
                for layer, whole in zip(cache.layers, full.layers):
                    layer.keys, layer.values = whole.keys[:bucket], whole.values[:bucket]
                    torch._dynamo.mark_static_address(layer.keys)
                    torch._dynamo.mark_static_address(layer.values)
        self._set_pointer(self.pointer)

    def prefill(self, inputs, rows: list[int], params: list[GenerationParams], allowed=None) -> list[int]:
        """Run new items' prompts (one left-padded batch) and place them in `rows`, whose slots end
        at the pointer (the caller made room with `plan`/`shift`). Returns each row's first token."""
        import torch
        from transformers import DynamicCache

        model, state = self.model, self.state
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        count, prompt_length = input_ids.shape
        # Positions continue from the prompt's exactly as generate() continues them (M-RoPE too).
        position_ids = model._prepare_position_ids_for_generation(input_ids, dict(inputs))

        def forward():  # each try from an empty cache: one cut off midway has some layers' keys already
            scratch = DynamicCache(config=model.config.get_text_config(decoder=True))
            return model(
                **inputs, position_ids=position_ids, past_key_values=scratch, use_cache=True, logits_to_keep=1
            ), scratch

        output, scratch = _beside_fx_traces(forward)
        if not self.caches:
            self._allocate([layer.keys for layer in scratch.layers], [layer.values for layer in scratch.layers])
        index = torch.tensor(rows, device=input_ids.device)
        start, end = self.pointer - prompt_length, self.pointer
        for layer, new in zip(self.caches[self.rows].layers, scratch.layers):
            layer.keys[index, :, start:end] = new.keys
            layer.values[index, :, start:end] = new.values
        state.mask[index] = 0
        state.mask[index, start:end] = attention_mask
        state.mask[index, end:] = 1
        if self.position is None:
            shape = list(position_ids.shape)
            shape[-2], shape[-1] = self.rows, 1
            self.position = torch.zeros(shape, dtype=position_ids.dtype, device=position_ids.device)
        self.position.index_copy_(-2, index, position_ids[..., -1:] + 1)

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=index.device)

        new = types.SimpleNamespace(
            count=torch.zeros(count, dtype=torch.long, device=index.device),
            seen=None,
            min_new=column([p.min_new_tokens for p in params], torch.long),
            sample=column([p.do_sample for p in params], torch.bool),
            temperature=column([p.temperature for p in params], torch.float),
            top_p=column([p.top_p for p in params], torch.float),
            seed=column([row_seed(p.seed) for p in params], torch.long),
            logprobs=column([p.logprobs for p in params], torch.bool),
            constrained=column([p.json_schema is not None for p in params], torch.bool),
            allowed=None if allowed is None else allowed.to(index.device),
        )
        if self.penalty:
            new.seen = torch.zeros((count, state.seen.shape[1]), dtype=torch.bool, device=index.device)
            new.seen.scatter_(1, input_ids, True)
        wants_logprobs = any(p.logprobs for p in params)
        constrained = allowed is not None
        token, logprobs = self._choose(
            output.logits[:, -1, :], new, any(p.do_sample for p in params), wants_logprobs, constrained
        )
        if wants_logprobs:
            self.pending_logprobs = {
                row: [entry] for row, entry in zip(rows, zip(*(part.tolist() for part in logprobs)))
            }
        for name in ("min_new", "sample", "temperature", "top_p", "seed", "logprobs", "constrained", "allowed", "seen"):
            if getattr(new, name) is not None:
                getattr(state, name)[index] = getattr(new, name)
        state.token[index] = token[:, None]
        state.count[index] = 1
        for row, p in zip(rows, params):
            self.spans[row] = (start, end + p.max_new_tokens + self.interval)
        self._update_any_sample()
        return token.tolist()

    def release(self, row: int) -> None:
        """Free a row: its slots are hidden from now on and it may be given to a new item."""
        self.spans.pop(row, None)
        self.state.mask[row, : self.pointer] = 0
        self._update_any_sample()

    def _update_any_sample(self) -> None:
        busy = sorted(self.spans)
        self.any_sample = bool(self.state.sample[busy].any()) if busy else False
        self.any_logprobs = bool(self.state.logprobs[busy].any()) if busy else False
        self.any_constrained = bool(self.state.constrained[busy].any()) if busy else False

    def set_allowed(self, rows: list[int], allowed) -> None:
        """The tokens each of `rows` may take at the next step (a grammar's masks, CPU int32 [len(rows), words])."""
        import torch

        self.state.allowed[torch.tensor(rows, device=self.state.allowed.device)] = allowed.to(self.state.allowed.device)

    # ---- decoding ---------------------------------------------------------------------------

    def _choose(
        self, logits, rows: types.SimpleNamespace, any_sample: bool, with_logprobs: bool = False, masked: bool = False
    ):
        """Each row's next token from its logits; with `with_logprobs`, also each token's log-probability and the
        `top_k` most likely tokens': log_softmax of the model's own logits, before the repetition penalty, the
        end-token block of min_new_tokens, temperature and top-p (as generate()'s output_logits, and vLLM's)."""
        import torch

        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1) if with_logprobs else None  # before the in-place edits below
        if rows.seen is not None:  # as transformers' RepetitionPenaltyLogitsProcessor
            penalized = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = torch.where(rows.seen, penalized, logits)
        if self.eos_index.numel():  # no end token before min_new_tokens
            early = (rows.count < rows.min_new)[:, None]
            logits[:, self.eos_index] = logits[:, self.eos_index].masked_fill(early, float("-inf"))
        if masked:  # a constrained row takes only what its grammar allows
            allowed = (rows.allowed[:, self.mask_word] >> self.mask_bit) & 1
            logits = logits.masked_fill((allowed == 0) & rows.constrained[:, None], float("-inf"))
        token = logits.argmax(dim=-1)
        if any_sample:
            token = torch.where(rows.sample, self._sampled(logits, rows), token)
        if rows.seen is not None:
            rows.seen.scatter_(1, token[:, None], True)
        if logprobs is None:
            return token, None
        top_logprob, top_id = logprobs.topk(self.top_k, dim=-1)
        return token, (logprobs.gather(1, token[:, None])[:, 0], top_id, top_logprob)

    def _sampled(self, logits, rows: types.SimpleNamespace):
        """Temperature and top-p sampling, drawn as argmax(p / Exp(1)) so a CUDA graph can hold it. The
        Exp(1) noise is a function of the row's seed, its token's index and the vocabulary index alone, so
        a seeded row draws the same tokens alone, batched or beside any other rows."""
        import torch

        probs = torch.softmax(logits / rows.temperature.clamp(min=1e-5)[:, None], dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > rows.top_p[:, None]
        probs = probs.scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
        return (probs / -torch.log(counter_uniform(rows.seed, rows.count, self.vocab_index))).argmax(dim=-1)

    def _rows_of(self, bucket: int) -> types.SimpleNamespace:
        """The per-row tensors of the first `bucket` rows, as views."""
        return types.SimpleNamespace(**{k: v if v is None else v[:bucket] for k, v in vars(self.state).items()})

    def _advance(self, bucket: int) -> None:
        """One step of the first `bucket` rows: their last tokens go through the model, the next
        are chosen."""
        rows = self._rows_of(bucket)
        position = self.position[..., :bucket, :]
        cache = self.caches[bucket]  # each layer counts its writes: a step cut off midway moved some counters
        output = _beside_fx_traces(
            self.forwards[bucket],
            lambda: [n.cumulative_length.copy_(self.cache_position[0]) for n in cache.layers],
            input_ids=rows.token,
            attention_mask=rows.mask,
            position_ids=position,
            past_key_values=cache,
            cache_position=self.cache_position,
            use_cache=True,
            logits_to_keep=1,
        )
        token, logprobs = self._choose(
            output.logits[:, -1, :], rows, self.any_sample, self.any_logprobs, self.any_constrained
        )
        rows.ring.index_copy_(1, self.ring_index, token[:, None])
        if logprobs is not None:
            chosen, top_id, top_logprob = logprobs
            rows.ring_logprob.index_copy_(1, self.ring_index, chosen[:, None])
            rows.ring_top_id.index_copy_(1, self.ring_index, top_id[:, None])
            rows.ring_top_logprob.index_copy_(1, self.ring_index, top_logprob[:, None])
        self.ring_index += 1
        rows.count += 1
        rows.token.copy_(token[:, None])
        position += 1
        self.cache_position += 1

    def bucket(self) -> int:
        busy = max(self.spans, default=0) + 1
        return next(b for b in self.buckets if b >= busy)

    def step(self, steps: int) -> list[list[int]]:
        """Run `steps` (at most `interval`) decode steps; each busy bucket row's new tokens."""
        bucket = self.bucket()
        self._set_pointer(self.pointer)  # another bucket's steps moved only its own counters
        self.ring_index.zero_()
        graph = self.graphs.get(self._graph_key(bucket))
        for _ in range(steps):
            graph.replay() if graph is not None else self._advance(bucket)
        self.pointer += steps
        tokens = self.state.ring[:bucket, :steps].tolist()
        if self.any_logprobs:
            state = self.state
            parts = (state.ring_logprob, state.ring_top_id, state.ring_top_logprob)
            per_row = zip(*(part[:bucket, :steps].tolist() for part in parts))
            self.pending_logprobs = {row: list(zip(*entries)) for row, entries in enumerate(per_row)}
        if self.use_graph and graph is None and self.spans and self.pointer < self.length:
            try:
                self._capture(bucket)
            except Exception:  # still correct without the graph, only slower; tried again at later steps
                self.capture_failures += 1
                log.warning("CUDA graph capture failed (%d of 3 tries)", self.capture_failures, exc_info=True)
                self.use_graph = self.capture_failures < 3
        return tokens

    def _graph_key(self, bucket: int) -> tuple:
        return bucket, self.any_sample, self.any_logprobs, self.any_constrained

    def take_logprobs(self) -> Optional[dict]:
        """The log-probabilities the last prefill or steps recorded (row -> one entry per new token), once."""
        pending, self.pending_logprobs = self.pending_logprobs, None
        return pending

    def steps_only_with(self, forward) -> bool:
        """Whether every bucket steps with `forward` (the compiled one)."""
        return all(f is forward for f in self.forwards.values())

    def use_forward(self, bucket: int, forward) -> None:
        """Step `bucket` with another forward (the compiled one); its graphs are recorded anew."""
        self.forwards[bucket] = forward
        self.graphs = {key: graph for key, graph in self.graphs.items() if key[0] != bucket}

    def _capture(self, bucket: int) -> None:
        """Record one step as a CUDA graph; the steps run to record it write only the pointer's slot."""
        import torch

        state = self.state  # what the recording steps advance, put back after
        kept = [(t, t.clone()) for t in (state.token, self.position, state.count, state.seen) if t is not None]
        pointer = self.pointer
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._set_pointer(pointer)
                self.ring_index.zero_()
                self._advance(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        self._set_pointer(pointer)
        self.ring_index.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._advance(bucket)
        self._set_pointer(pointer)
        for tensor, value in kept:
            tensor.copy_(value)
        self.graphs[self._graph_key(bucket)] = graph


def row_seed(seed: Optional[int]) -> int:
    """A row's sampling seed: the request's (any int, folded into 31 bits), else a fresh random one."""
    return (seed if seed is not None else random.getrandbits(31)) & 0x7FFFFFFF


def counter_uniform(seed, step, index):
    """Uniform draws in (0, 1) for every (row, index): a hash of (the row's seed, its step, index), made of
    integer tensor ops a CUDA graph can hold; products stay under 2**63 (31-bit odd constants, 32-bit values).
    Hand-written: torch's generators hold one state for a whole tensor, not a counter per row."""
    import torch

    mask = 0xFFFFFFFF
    x = (seed[:, None] * 0x27D4EB2F + step[:, None] * 0x165667B1 + index[None, :] * 0x61C88647) & mask
    for multiplier in (0x7FEB352D, 0x6A09E667, 0x5BD1E995):
        x = ((x ^ (x >> 15)) * multiplier) & mask
    x = x ^ (x >> 16)
    return ((x >> 9).to(torch.float32) + 0.5) / float(1 << 23)  # 23 bits: exact in float32, never 0 or 1
