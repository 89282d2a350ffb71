"""Continuous-batching decoding over a paged KV cache: rows join and leave at step boundaries."""

from __future__ import annotations

import itertools
import logging
import types
from typing import Optional

from runpod_vlm.engine import decode_kernel
from runpod_vlm.engine.blocks import BlockPool
from runpod_vlm.engine.decoder_graphs import StepGraphs
from runpod_vlm.engine.host_copies import Launched, to_device, to_host
from runpod_vlm.engine.long_rope import by_position
from runpod_vlm.engine.memory import kv_layout
from runpod_vlm.engine.paged_attention import PagedStep, attention_limits, paged
from runpod_vlm.engine.prefill import Prefill, beside_fx_traces, placeholder_counts_on_the_host
from runpod_vlm.engine.prefill_graphs import GRAPH_TOKENS, PrefillGraphs
from runpod_vlm.engine.sampling import Sampler, row_seed
from runpod_vlm.engine.vision_graphs import VisionGraphs, tower
from runpod_vlm.vocabulary import GenerationParams

log = logging.getLogger("runpod-vlm")


SPAN_BUCKETS_FROM = 256  # a decode step gathers each row's slots up to a power-of-two multiple of this


def row_buckets(rows: int) -> list[int]:
    """The row counts a decode step runs at: powers of two from 8, and all rows."""
    return sorted({b for b in (8, 16, 32, 64, 128) if b < rows} | {rows})


# Whether any busy row samples, wants logprobs, is constrained, samples within a top_p below 1: each step's graph is
# recorded for one combination (`StepGraphs.key`).
STEP_FLAGS = ("any_sample", "any_logprobs", "any_constrained", "any_top_p")


def row_flags(params: GenerationParams) -> tuple:
    """A row's `PagedDecoder.flags`, in STEP_FLAGS' order."""
    return params.do_sample, params.logprobs, params.json_schema is not None, params.do_sample and params.top_p < 1


class PagedDecoder:
    """Continuous-batching decoding state: up to `rows` sequences over a pool of KV blocks.

    A row holds the blocks of its own tokens (its block table); a decode step writes each row's new
    key/value at its own next slot and attends to its own slots only: on the GPU through a kernel that
    reads each row's blocks (a step has fixed shapes per row bucket and replays as a CUDA graph), else
    gathered up to a length bucket (fixed shapes per row and length bucket). New prompts are prefilled
    together (`prefill`); a long one enters in chunks written straight into its blocks
    (`begin_chunks`/`prefill_chunk`). A step runs the smallest bucket of leading rows holding every busy
    row. Greedy rows give `model.generate(do_sample=False)`'s tokens, alone or beside others."""

    pending_logprobs: Optional[dict] = None  # row -> (logprob, top ids, top logprobs) per new token

    def __init__(
        self,
        model,
        eos_ids: set,
        rows: int,
        blocks: int,
        block_size: int,
        use_graph: bool,
        interval: int,
        max_row_tokens: Optional[int] = None,
        prefill_tokens: int = GRAPH_TOKENS,
    ):
        """`max_row_tokens`: the most one row holds (the model's context), which bounds its block table;
        `prefill_tokens`: the most tokens one prefill takes (the step's token budget)."""
        import torch

        with torch.inference_mode():  # like every tensor made later, on the engine or compile thread
            self._make_state(model, eos_ids, rows, blocks, block_size, interval, max_row_tokens)
            self._make_graphs(model, rows, use_graph, prefill_tokens)

    def _make_state(self, model, eos_ids, rows, blocks, block_size, interval, max_row_tokens) -> None:
        import torch

        device = model.device
        self.model, self.rows, self.interval = model, rows, interval
        self.pool = BlockPool(blocks, block_size)
        self.block_size = block_size
        self.buckets = row_buckets(rows)
        self.forwards = {bucket: model for bucket in self.buckets}  # `use_forward` swaps in compiled ones
        self.decode_kernel = decode_kernel.usable(model)  # else a step gathers each row's slots (span)
        limits = attention_limits(model.config.get_text_config(decoder=True))
        self.limits = limits if any(window or chunk for window, chunk in limits) else None
        self.keys, self.values = self._allocate(model)  # per layer [slots, kv heads, head dim]
        self.sampler = Sampler(model, eos_ids)
        vocab, top_k = self.sampler.vocab, self.sampler.top_k
        longest = min(self.pool.capacity_tokens, max_row_tokens or self.pool.capacity_tokens)
        self.columns = self.pool.blocks_for(longest + interval) + 1  # a block table's width
        self.offsets = torch.arange(self.columns * block_size, device=device)
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.ring_index = zeros(1)
        self.table = zeros(rows, self.columns)  # block ids; 0 (never handed out) past a row's own
        self.state = types.SimpleNamespace(
            token=zeros(rows, 1),
            length=zeros(rows),  # tokens in the row's blocks before its next step
            busy=zeros(rows),
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
            ring_top_id=zeros(rows, interval, top_k),
            ring_top_logprob=zeros(rows, interval, top_k, dtype=torch.float),
            seen=zeros(rows, vocab, dtype=torch.bool) if self.sampler.penalty else None,
        )
        self.position = self._position_buffer(model, rows)  # each row's next position, as the family's position ids
        self.lengths: dict[int, int] = {}  # busy row -> tokens in its blocks (host copy of state.length)
        self.flags: dict[int, tuple] = {}  # busy row -> its `row_flags`
        self.table_writes: list[tuple] = []  # (row, column, block) not yet in `table` (`write_table`)
        self.set_step_flags((False,) * len(STEP_FLAGS))
        self.eager_steps = 0  # steps run without a graph (benchmarks)

    def _make_graphs(self, model, rows: int, use_graph: bool, prefill_tokens: int) -> None:
        # Made before the graphs' memory pool, so that they go first at teardown (made after: an abort at exit).
        self.prefill_graphs = PrefillGraphs(self, rows, prefill_tokens)
        visual = tower(model)
        self.vision_graphs = VisionGraphs(visual) if visual is not None and use_graph else None
        unit = visual.spatial_merge_size**2 if visual is not None and placeholder_counts_on_the_host(model) else 0
        self.prompts = Prefill(self, unit)
        self.step_graphs = StepGraphs(self, use_graph)  # after the passes' graphs: its memory pool goes last

    # ---- blocks -----------------------------------------------------------------------------

    def free_rows(self) -> list[int]:
        return [row for row in range(self.rows) if row not in self.lengths]

    def grow(self, row, tokens: int) -> None:
        """Give `row` the blocks for `tokens` tokens; raises PoolExhausted. Only decode steps read the GPU's block
        table: its new entries wait for the next `step`, which writes every row's in one copy."""
        held = len(self.pool.table(row))
        new = self.pool.grow(row, tokens)
        self.table_writes.extend((row, held + n, block) for n, block in enumerate(new))

    def share(self, row, blocks: list[int]) -> None:
        """`row` (holding nothing) starts with cached blocks of a prompt prefix."""
        self.pool.share(row, blocks)
        self.table_writes.extend((row, n, block) for n, block in enumerate(blocks))

    def write_table(self) -> None:
        """The block-table entries given since the last step, in one copy that does not wait for the GPU."""
        import torch

        if self.table_writes:
            rows, columns, blocks = to_device(torch.tensor(self.table_writes, dtype=torch.long).T, self.table.device)
            self.table[rows, columns] = blocks
            self.table_writes = []

    def slots(self, row, start: int, end: int):
        """The pool slots of a holder's tokens [start, end)."""
        return to_device(self.host_slots(row, start, end), self.offsets.device)

    def host_slots(self, row, start: int, end: int):
        import torch

        blocks = torch.tensor(self.pool.table(row), dtype=torch.long)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()[start:end]

    def release(self, row: int) -> None:
        """Free a row and its blocks: it may be given to a new item. Nothing here waits for the GPU, which runs the
        next interval meanwhile (a number assigned to one element, `busy[row] = 0`, is a copy from the host that
        waits for it)."""
        self.pool.release(row)
        self.lengths.pop(row, None)
        self.flags.pop(row, None)
        self.table_writes = [write for write in self.table_writes if write[0] != row]
        for tensor in (self.table, self.state.busy, self.state.length):
            tensor[row].zero_()
        self._update_any_sample()

    def _allocate(self, model) -> tuple[list, list]:
        """The pool, made with the decoder (not at the first prefill, so that an idle worker records its decode steps'
        graphs before any request): keys and values per layer [slots, kv heads, head dim], as its config lays them
        out."""
        import torch

        layers, heads, dim = kv_layout(model)
        slots = (self.pool.capacity + 1) * self.block_size
        dtype, device = model.get_input_embeddings().weight.dtype, model.device
        keys = [torch.zeros(slots, heads, dim, dtype=dtype, device=device) for _ in range(layers)]
        values = [torch.zeros_like(k) for k in keys]
        for tensor in (*keys, *values):
            torch._dynamo.mark_static_address(tensor)
        return keys, values

    @staticmethod
    def _position_buffer(model, rows: int):
        """Zeros shaped as the family's position ids of one token per row (M-RoPE's have a leading axis)."""
        import torch

        ids = torch.zeros((1, 1), dtype=torch.long)
        one = model._prepare_position_ids_for_generation(
            ids, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        )
        shape = list(one[..., -1:].shape)
        shape[-2] = rows
        return torch.zeros(shape, dtype=one.dtype, device=model.device)

    def start_rows(self, rows, lengths, logits, last_position, input_ids, params, allowed, prior) -> Launched:
        """Rows whose prompts are in their blocks: their settings and first tokens, chosen from `logits` and on
        their way to the host (`read`)."""
        import torch

        state = self.state
        index = torch.tensor(rows).to(logits.device, non_blocking=True)
        self.position.index_copy_(-2, index, last_position + 1)

        # One copy to the GPU for all the rows' settings, each a column of float64 (exact for these ints: a seed goes
        # as its two 32-bit halves), instead of one synchronizing copy per setting.
        seeds = [row_seed(p.seed) for p in params]
        kinds = {
            "count": (prior or [0] * len(rows), torch.long),
            "min_new": ([p.min_new_tokens for p in params], torch.long),
            "sample": ([p.do_sample for p in params], torch.bool),
            "temperature": ([p.temperature for p in params], torch.float),
            "top_p": ([p.top_p for p in params], torch.float),
            "seed": ([low for low, _ in seeds], torch.long),
            "seed_high": ([high for _, high in seeds], torch.long),
            "logprobs": ([p.logprobs for p in params], torch.bool),
            "constrained": ([p.json_schema is not None for p in params], torch.bool),
            "length": (lengths, torch.long),
            "busy": ([1] * len(rows), torch.long),
        }
        table = torch.tensor([values for values, _ in kinds.values()], dtype=torch.float64)
        table = to_device(table, index.device)
        new = types.SimpleNamespace(
            **{name: column.to(dtype) for (name, (_, dtype)), column in zip(kinds.items(), table)},
            seen=None,
            allowed=None if allowed is None else to_device(allowed, index.device),
        )
        new.seed.bitwise_or_(new.seed_high << 32)  # the whole 64 bits, two's complement
        if self.sampler.penalty:
            new.seen = torch.zeros((len(rows), state.seen.shape[1]), dtype=torch.bool, device=index.device)
            new.seen.scatter_(1, input_ids, True)
        wants_logprobs = any(p.logprobs for p in params)
        flags = [row_flags(p) for p in params]
        token, logprobs = self.sampler.choose(
            logits, new, any(f[0] for f in flags), wants_logprobs, allowed is not None, any(f[3] for f in flags)
        )
        names = ("min_new", "sample", "temperature", "top_p", "seed", "logprobs", "constrained", "allowed", "seen")
        for name in (*names, "length", "busy"):
            if getattr(new, name) is not None:
                getattr(state, name)[index] = getattr(new, name)
        state.token[index] = token[:, None]
        state.count[index] = new.count + 1
        self.lengths.update(zip(rows, lengths))
        self.flags.update(zip(rows, flags))
        self._update_any_sample()
        per_row = [part[:, None] for part in logprobs] if wants_logprobs else []  # one step per row, as a launch's
        return to_host(1, token[:, None], per_row, tuple(rows))

    def _update_any_sample(self) -> None:
        flags = list(self.flags.values())
        self.set_step_flags(any(f[n] for f in flags) for n in range(len(STEP_FLAGS)))

    def step_flags(self) -> tuple:
        """The STEP_FLAGS a step now runs with."""
        return tuple(getattr(self, name) for name in STEP_FLAGS)

    def set_step_flags(self, flags) -> None:
        for name, value in zip(STEP_FLAGS, flags, strict=True):
            setattr(self, name, value)

    def set_allowed(self, rows: list[int], allowed) -> None:
        """The tokens each of `rows` may take at the next step (a grammar's masks, CPU int32 [len(rows), words])."""
        import torch

        device = self.state.allowed.device
        self.state.allowed[torch.tensor(rows, device=device)] = to_device(allowed, device)

    # ---- decoding ---------------------------------------------------------------------------

    def _rows_of(self, bucket: int) -> types.SimpleNamespace:
        """The per-row tensors of the first `bucket` rows, as views."""
        return types.SimpleNamespace(**{k: v if v is None else v[:bucket] for k, v in vars(self.state).items()})

    def advance(self, bucket: int, span: int) -> None:
        """One step of the first `bucket` rows, each attending to its first `span` slots at most: their
        last tokens go through the model, the next are chosen."""
        rows = self._rows_of(bucket)
        position = self.position[..., :bucket, :]
        table = self.table[:bucket]
        length = rows.length
        block = table.gather(1, (length // self.block_size)[:, None])[:, 0]
        # An idle row writes block 0's first slot: its table may hold a prompt entering in chunks.
        slots = (block * self.block_size + length % self.block_size) * rows.busy
        if self.decode_kernel:
            step = PagedStep(self.keys, self.values, slots, table=table, seen=length + 1, block_size=self.block_size)
        else:
            offsets = self.offsets[:span]
            index = table[:, offsets // self.block_size] * self.block_size + offsets % self.block_size
            visible = (offsets[None, :] <= length[:, None])[:, None, None, :]
            step = PagedStep(self.keys, self.values, slots, index, visible, query_positions=length[:, None])
        step.limits = self.limits  # Gemma 3's sliding windows, Llama 4's chunks
        with paged(step), by_position():
            output = beside_fx_traces(
                self.forwards[bucket],
                input_ids=rows.token,
                position_ids=position,
                use_cache=False,
                logits_to_keep=1,
            )
        token, logprobs = self.sampler.choose(output.logits[:, -1, :], rows, *self.step_flags())
        rows.ring.index_copy_(1, self.ring_index, token[:, None])
        if logprobs is not None:
            chosen, top_id, top_logprob = logprobs
            rows.ring_logprob.index_copy_(1, self.ring_index, chosen[:, None])
            rows.ring_top_id.index_copy_(1, self.ring_index, top_id[:, None])
            rows.ring_top_logprob.index_copy_(1, self.ring_index, top_logprob[:, None])
        self.ring_index += 1
        rows.count += 1
        rows.length.add_(rows.busy)  # an idle row stays at its one slot of block 0
        rows.token.copy_(token[:, None])
        position += 1

    def bucket(self) -> int:
        busy = max(self.lengths, default=0) + 1
        return next(b for b in self.buckets if b >= busy)

    def span(self, steps: int) -> int:
        """The slots a step gathers per row: a length bucket holding every busy row's tokens after `steps` more
        (0 with the decode kernel, which reads each row's own length)."""
        if self.decode_kernel:
            return 0
        longest = max(self.lengths.values(), default=0) + steps
        span = SPAN_BUCKETS_FROM
        while span < longest:
            span *= 2
        return min(span, self.columns * self.block_size)

    def launch(self, steps: int) -> Launched:
        """Launch `steps` (at most `interval`) decode steps and the copy of their tokens to the host, without waiting
        for the GPU (`read` waits). Every busy row must hold the blocks for `steps` more tokens (`grow`). A row steps
        until it is released: one that ended in steps not yet read steps on, into block 0 past its blocks."""
        self.write_table()
        bucket, span = self.bucket(), self.span(steps)
        graph = self.step_graphs.before_step(bucket, span)
        self.ring_index.zero_()
        kept = self.keep_rows() if graph is None else None
        try:
            for _ in range(steps):
                graph.replay() if graph is not None else self.advance(bucket, span)
        except Exception:
            if kept is not None:  # eager steps that failed midway (out of memory): the rows where they were
                self.put_back(kept)
            raise
        self.eager_steps += 0 if graph is not None else steps
        for row in self.lengths:
            self.lengths[row] += steps
        state = self.state
        rings = [state.ring_logprob, state.ring_top_id, state.ring_top_logprob] if self.any_logprobs else []
        # Copied now: the next launch writes the rings again.
        return to_host(steps, state.ring[:bucket, :steps], [ring[:bucket, :steps] for ring in rings])

    def read(self, launched: Launched) -> list[list[int]]:
        """The tokens of `launched` steps, per row of their bucket (a prefill's first tokens: per row of
        `launched.rows`, in order), once the GPU has run them; their log-probabilities (row -> entries), when a row
        asked, in `take_logprobs`."""
        if launched.done is not None:
            launched.done.synchronize()
        if launched.logprobs:
            per_row = zip(*(part.tolist() for part in launched.logprobs))
            rows = launched.rows or itertools.count()
            self.pending_logprobs = {row: list(zip(*entries)) for row, entries in zip(rows, per_row)}
        return launched.tokens.tolist()

    def step(self, steps: int) -> list[list[int]]:
        """`launch` and `read`: each bucket row's tokens of `steps` decode steps."""
        return self.read(self.launch(steps))

    def take_logprobs(self) -> Optional[dict]:
        """The log-probabilities the last prefill or steps recorded (row -> one entry per new token), once."""
        pending, self.pending_logprobs = self.pending_logprobs, None
        return pending

    def use_forward(self, bucket: int, forward) -> None:
        """Step `bucket` with another forward (the compiled one); its graphs are recorded anew."""
        self.forwards[bucket] = forward
        self.step_graphs.drop(bucket)

    def keep_rows(self) -> list:
        """Copies of what a step advances in the rows' state (its KV slots are written again by the next step)."""
        state = self.state
        advanced = (state.token, self.position, state.count, state.length, state.seen)
        return [(tensor, tensor.clone()) for tensor in advanced if tensor is not None]

    @staticmethod
    def put_back(kept: list) -> None:
        for tensor, value in kept:
            tensor.copy_(value)

    def steps_only_with(self, forward) -> bool:
        """Whether every bucket steps with `forward` (the compiled one)."""
        return all(f is forward for f in self.forwards.values())
