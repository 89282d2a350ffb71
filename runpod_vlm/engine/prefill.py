"""How new prompts enter a paged decoder's blocks: prefilled together (packed, or padded through the whole model),
or one long prompt in chunks."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional

from runpod_vlm.engine.host_copies import Launched, to_device
from runpod_vlm.engine.intake import on_device
from runpod_vlm.engine.long_rope import chooses_by_row
from runpod_vlm.engine.memory import text_model
from runpod_vlm.engine.paged_attention import PagedStep, paged
from runpod_vlm.vocabulary import GenerationParams


def beside_fx_traces(forward, rewind=None, **kwargs):
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


def placeholder_counts_on_the_host(model) -> bool:
    """Make the model's `get_placeholder_mask` skip its check that the prompt's image and video tokens match the
    features, when it has one: the check (and its message's count) reads a GPU tensor back, which waits for every
    prefill launched before. `Prefill.check_placeholders` checks the same on the host. False if not made."""
    import inspect

    inner = getattr(model, "model", None)
    method = getattr(inner, "get_placeholder_mask", None)
    if method is None or getattr(method, "checked_on_the_host", False):
        return method is not None
    if not {"image_features", "video_features"} <= set(inspect.signature(method).parameters):
        return False

    def get_placeholder_mask(input_ids, inputs_embeds=None, image_features=None, video_features=None, **kwargs):
        return method(input_ids, inputs_embeds=inputs_embeds, **kwargs)

    get_placeholder_mask.checked_on_the_host = True
    inner.get_placeholder_mask = get_placeholder_mask
    return True


class _Captured(Exception):
    """Stops a forward at the language model, once the family's own code has built its inputs."""


class ChunkedPrefill:
    """A prompt entering one chunk at a time: its embeddings (vision merged in) and positions are held
    until its last chunk; `done` tokens are in its blocks so far."""

    def __init__(self, row: int, embeds, positions, position_ids, input_ids, params, prior: int):
        self.row, self.embeds, self.positions, self.input_ids = row, embeds, positions, input_ids
        self.last_position = position_ids[..., -1:]  # as the whole model takes positions (decode steps)
        self.params, self.prior, self.done = params, prior, 0

    @property
    def length(self) -> int:
        return self.embeds.shape[1]


class Prefill:
    """New prompts into a decoder's rows' blocks (the decoder's `prompts`, made with it): a batch packed or padded,
    or one long prompt in chunks; each row then starts decoding (`PagedDecoder.start_rows`). It reads the decoder's
    pool, slots and graphs, and holds what only prompts need."""

    def __init__(self, decoder, vision_graphs_unit: int = 0):
        """`vision_graphs_unit`: patches a feature merges, where placeholders are counted on the host (else 0)."""
        import torch

        self.decoder, self.model, self.vision_graphs_unit = decoder, decoder.model, vision_graphs_unit
        # Whether prompts prefill packed (known at the first prefill; `prefill`). Not where the rotary's factors follow
        # each row's length (LongRoPE's): a chunk's forward, or a cached prefix, would have another's.
        self.packs: Optional[bool] = False if chooses_by_row(self.model) else None
        self.prefilled: list = []  # the tokens each prompt of the last prefill computed (its shared blocks' not)
        # A 4-D mask the language model hands on untouched (`through_language_model`).
        self.no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=decoder.offsets.device)

    def _within_limits(self, tokens: int) -> bool:
        """Whether a prompt of `tokens` may go packed or in chunks: every layer attends to all of them (`limits`: a
        longer one prefills whole through the model's own masks; FlashAttention's varlen kernel takes no chunk mask)."""
        limits = self.decoder.limits
        return limits is None or tokens <= min(limit for pair in limits for limit in pair if limit)

    def _vision_graphs_engaged(self):
        graphs = self.decoder.vision_graphs
        return graphs.engaged() if graphs is not None else contextlib.nullcontext()

    def check_placeholders(self, inputs) -> None:
        """What the model's own check would raise (`placeholder_counts_on_the_host`): each image's or video's
        merged patches (its grid, from the host) against its placeholder tokens in the prompts."""
        unit, config = self.vision_graphs_unit, self.model.config
        for grid_name, token_name in (("image_grid_thw", "image_token_id"), ("video_grid_thw", "video_token_id")):
            grid, token = inputs.get(grid_name), getattr(config, token_name, None)
            if grid is None or token is None:
                continue
            features = int(grid.cpu().prod(-1).sum()) // unit
            tokens = int((inputs["input_ids"].cpu() == token).sum())
            if tokens != features:
                raise ValueError(f"{grid_name}: {features} features for {tokens} placeholder tokens")

    def _on_device(self, inputs):
        """`inputs` on the GPU, their placeholders checked on the host first where the model's check is skipped; a
        graphed tower's image grids stay on the host, where the family's code reads them (`.tolist()` of a GPU tensor
        waits for everything the GPU was given before, the prefill before this one too) and the tower takes them
        through its helpers (vision_graphs.py)."""
        if self.vision_graphs_unit:
            self.check_placeholders(inputs)
        kept = ("image_grid_thw", "video_grid_thw") if self.decoder.vision_graphs is not None else ()
        return on_device(inputs, self.decoder.offsets.device, kept=kept)

    def prefill(self, inputs, rows: list[int], params: list[GenerationParams], allowed=None, prior=None) -> list[int]:
        """`prefill_launch`, then each row's first token."""
        return [token for (token,) in self.decoder.read(self.prefill_launch(inputs, rows, params, allowed, prior))]

    def prefill_launch(
        self, inputs, rows: list[int], params: list[GenerationParams], allowed=None, prior=None, shared=None
    ):
        """Run new items' prompts (a left-padded batch) and place them in `rows`, each with the blocks of its own
        tokens. `prior`: per row, the tokens it had already generated (a preempted row resumed: they end its
        prompt). Returns the rows' first tokens on their way to the host (`read`), without waiting for the GPU.

        Where the family's language model takes only embeddings and positions (`packs`), the prompts go through
        it packed into one sequence without their padding, each token's keys and values written straight into
        its blocks, and each prompt's `shared` leading blocks (`blocks.SharedPrefix`: cached, or an earlier
        prompt's of this prefill) are read, not computed; else the whole model runs the padded batch into a scratch
        cache copied into the blocks. `prefilled` then tells how many tokens of each prompt were computed."""
        position_ids = self._positions(inputs)
        kept = inputs["attention_mask"].bool().cpu()  # counted on the host: a count on the GPU waits for it
        inputs = self._on_device(inputs)
        packed = None
        if self.packs is not False and self._within_limits(int(kept.sum(dim=1).max())):
            packed = self._language_model_inputs(inputs, position_ids)
            self.packs = packed is not None
        if packed is None:
            logits, lengths = self._prefill_padded(inputs, position_ids, rows)
            self.prefilled = lengths
        else:
            logits, lengths = self._prefill_packed(kept, *packed, rows, shared)
        return self.decoder.start_rows(
            rows, lengths, logits, position_ids[..., -1:], inputs["input_ids"], params, allowed, prior
        )

    def _positions(self, inputs):
        """Each prompt token's position, as generate() continues them (M-RoPE's too), computed from host copies of
        the prompt's small inputs: transformers' M-RoPE index is tens of small ops and host syncs, which on the GPU
        took the engine thread 2-3 ms a prefill."""
        import torch

        host = {
            name: value.cpu() if torch.is_tensor(value) and not name.startswith("pixel_values") else value
            for name, value in inputs.items()
        }
        position_ids = self.model._prepare_position_ids_for_generation(host["input_ids"], host)
        return to_device(position_ids, self.decoder.offsets.device)

    def _prefill_padded(self, inputs, position_ids, rows: list[int]):
        from transformers import DynamicCache

        model = self.model

        def forward():  # each try from an empty cache: one cut off midway has some layers' keys already
            # Every layer keeps all its keys (the pool holds them all; a sliding-window layer's cache, its last only).
            windowed = self.decoder.limits
            scratch = DynamicCache() if windowed else DynamicCache(config=model.config.get_text_config(decoder=True))
            return model(
                **inputs, position_ids=position_ids, past_key_values=scratch, use_cache=True, logits_to_keep=1
            ), scratch

        with self._vision_graphs_engaged():
            output, scratch = beside_fx_traces(forward)
        kept = inputs["attention_mask"].bool()  # left padding is not copied
        lengths = kept.sum(dim=1).tolist()
        slots, _ = self._grow_rows(rows, lengths)
        for pool_keys, pool_values, layer in zip(self.decoder.keys, self.decoder.values, scratch.layers):
            pool_keys.index_copy_(0, slots, layer.keys.transpose(1, 2)[kept].to(pool_keys.dtype))
            pool_values.index_copy_(0, slots, layer.values.transpose(1, 2)[kept].to(pool_values.dtype))
        return output.logits[:, -1, :], lengths

    def _prefill_packed(self, kept, embeds, positions, rows: list[int], shared=None):
        """The prompts' embeddings [rows, width, hidden] and positions [..., rows, width] (left-padded; `kept`
        [rows, width] their tokens, on the host) through the language model as one sequence of their tokens only,
        less each one's `shared` blocks, which its tokens attend to in the pool (an earlier prompt's written there
        by the same layer first). Nothing here waits for the GPU: a mask indexing a GPU tensor, or a blocking copy
        to it, would."""
        import torch

        from runpod_vlm.engine import varlen

        lengths = kept.sum(dim=1).tolist()
        skipped = [0] * len(rows) if shared is None else [s.count * self.decoder.block_size for s in shared]
        new = [length - skip for length, skip in zip(lengths, skipped)]
        computed = kept & (kept.cumsum(dim=1) > torch.tensor(skipped)[:, None])
        tokens = to_device(computed.flatten().nonzero()[:, 0], embeds.device)
        embeds, positions = embeds.flatten(0, 1)[tokens][None], positions.flatten(-2)[..., tokens].unsqueeze(-2)
        slots, key_slots = self._grow_rows(rows, lengths, shared)
        self.prefilled = new
        ends = torch.tensor(new).cumsum(0).to(embeds.device, non_blocking=True)
        if self._graphs_take(embeds, len(slots), len(key_slots), len(lengths)):
            hidden = self.decoder.prefill_graphs.run(embeds, positions, slots, key_slots, new, lengths)
            return self.model.get_output_embeddings()(hidden[0, ends - 1]), lengths
        if varlen.takes(embeds):
            starts = torch.nn.functional.pad(ends, (1, 0)).to(torch.int32)
            step = PagedStep(self.decoder.keys, self.decoder.values, slots, starts=starts, longest=max(new))
            if any(skipped):
                key_ends = torch.tensor(lengths).cumsum(0).to(embeds.device, non_blocking=True)
                step.key_slots, step.longest_keys = key_slots, max(lengths)
                step.key_starts = torch.nn.functional.pad(key_ends, (1, 0)).to(torch.int32)
        else:  # each token sees its own prompt's tokens up to its own, through the gathering path
            prompt = torch.arange(len(rows))
            query_prompt, key_prompt = (
                prompt.repeat_interleave(torch.tensor(new)),
                prompt.repeat_interleave(torch.tensor(lengths)),
            )
            query_at = torch.cat([torch.arange(skip, length) for skip, length in zip(skipped, lengths)])
            key_at = torch.cat([torch.arange(length) for length in lengths])
            visible = (query_prompt[:, None] == key_prompt[None, :]) & (key_at[None, :] <= query_at[:, None])
            visible = to_device(visible, embeds.device)
            step = PagedStep(self.decoder.keys, self.decoder.values, slots, key_slots[None, :], visible[None, None])
        hidden = self.through_language_model(step, embeds, positions)
        return self.model.get_output_embeddings()(hidden[0, ends - 1]), lengths

    def _graphs_take(self, embeds, tokens: int, keys: int, sequences: int) -> bool:
        """Whether a prefill of this size goes through `prefill_graphs` (on the GPU, through varlen)."""
        from runpod_vlm.engine import varlen

        graphs = self.decoder.prefill_graphs if self.decoder.step_graphs.enabled else None
        return bool(graphs and graphs.fits(tokens, keys, sequences)) and varlen.takes(embeds)

    def through_language_model(self, step: PagedStep, embeds, positions):
        """The language model's last hidden states for `embeds` at `positions`, attending through `step`."""
        with paged(step):  # a run cut off midway wrote some layers' slots: run again, it writes them again
            # A 4-D mask is taken as made: the paged attention needs none, and making one read the positions back.
            return beside_fx_traces(
                text_model(self.model),
                inputs_embeds=embeds,
                attention_mask=self.no_mask,
                position_ids=positions,
                use_cache=False,
            ).last_hidden_state

    def _grow_rows(self, rows: list[int], lengths: list[int], shared=None):
        """Blocks for each row's prompt, its `shared` leading ones first (all cached ones before any row grows: a
        growing row may take a cached block no row holds); the pool slots of the tokens to compute, then of all,
        row after row."""
        import torch

        shared = shared or [None] * len(rows)
        for row, reuse in zip(rows, shared):
            if reuse and reuse.cached:
                self.decoder.share(row, reuse.cached)
        for row, length, reuse in zip(rows, lengths, shared):
            if reuse and reuse.earlier is not None:
                self.decoder.share(row, self.decoder.pool.table(rows[reuse.earlier])[: reuse.count])
            self.decoder.grow(row, length)
        skipped = [reuse.count * self.decoder.block_size if reuse else 0 for reuse in shared]
        slots = torch.cat([self.decoder.host_slots(row, skip, n) for row, skip, n in zip(rows, skipped, lengths)])
        key_slots = (
            torch.cat([self.decoder.host_slots(row, 0, n) for row, n in zip(rows, lengths)]) if any(skipped) else slots
        )
        device = self.decoder.offsets.device
        slots = to_device(slots, device)
        return slots, (slots if key_slots is slots else to_device(key_slots, device))

    def _language_model_inputs(self, inputs, position_ids):
        """The embeddings (vision merged in) and positions the family's own forward hands its language model
        (the vision tower runs here); None when that language model takes more than embeddings, positions and a
        causal mask (Qwen3-VL's deepstack features, which a chunk could not slice; PaliGemma's and Gemma 3's
        masks of their own)."""
        model = self.model
        language_model, captured = model.get_decoder(), {}
        this_thread = threading.get_ident()

        def capture(module, args, kwargs):
            # The hook is on the module both threads run (the engine's and the compile thread's shadow decoder).
            if threading.get_ident() == this_thread:
                captured.update(kwargs)
                raise _Captured

        def up_to_the_language_model():
            try:
                model(**inputs, position_ids=position_ids, use_cache=False)
            except _Captured:
                pass

        handle = language_model.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            with self._vision_graphs_engaged():
                beside_fx_traces(up_to_the_language_model, rewind=captured.clear)
        finally:
            handle.remove()
        plain = {"input_ids", "inputs_embeds", "position_ids", "attention_mask", "past_key_values", "cache_position"}
        if any(v is not None and k not in plain and hasattr(v, "shape") for k, v in captured.items()):
            return None
        # A mask the family built itself (4D, or one per layer kind) may let tokens attend both ways
        # (PaliGemma's prefix, Gemma 3's images): a causal one would lose that.
        mask = captured.get("attention_mask")
        if isinstance(mask, dict) or getattr(mask, "ndim", 2) > 2:
            return None
        embeds = captured.get("inputs_embeds")
        if embeds is None:
            embeds = language_model.get_input_embeddings()(inputs["input_ids"])
        positions = captured.get("position_ids")  # as the language model takes them
        return embeds, position_ids if positions is None else positions

    def begin_chunks(self, inputs, row: int, params: GenerationParams, prior: int = 0) -> Optional[ChunkedPrefill]:
        """A one-item prompt's embeddings and positions (`_language_model_inputs`) to enter in chunks; None
        where its family's language model takes more, or some of its layers see fewer keys: prefill it whole."""
        if self.packs is False or not self._within_limits(inputs["input_ids"].shape[1] + prior):
            return None
        position_ids = self._positions(inputs)
        inputs = self._on_device(inputs)
        found = self._language_model_inputs(inputs, position_ids)
        if found is None:
            return None
        embeds, positions = found
        return ChunkedPrefill(row, embeds, positions, position_ids, inputs["input_ids"], params, prior)

    def follow_with(self, chunked: ChunkedPrefill, ids: list[int]) -> None:
        """A chunked prompt followed by tokens it had generated (a preempted row resumed), as its decode steps
        took them: embedded from the table, each one position on."""
        import torch

        tail = torch.tensor([ids], dtype=chunked.input_ids.dtype, device=chunked.embeds.device)
        embedded = self.model.get_decoder().get_input_embeddings()(tail).to(chunked.embeds.dtype)
        steps = torch.arange(1, len(ids) + 1, dtype=chunked.positions.dtype, device=chunked.positions.device)
        chunked.embeds = torch.cat([chunked.embeds, embedded], dim=1)
        chunked.positions = torch.cat([chunked.positions, chunked.positions[..., -1:] + steps], dim=-1)
        chunked.last_position = chunked.last_position + len(ids)
        chunked.input_ids = torch.cat([chunked.input_ids, tail], dim=1)

    def prefill_chunk(self, chunked: ChunkedPrefill, size: int, allowed=None) -> Optional[Launched]:
        """Run the next `size` tokens of a chunked prompt into its blocks; at its last chunk the row starts
        decoding and its first token is returned on its way to the host (`read`), as `prefill_launch`'s."""
        import torch

        start, end = chunked.done, min(chunked.done + size, chunked.length)
        self.decoder.grow(chunked.row, end)
        index = self.decoder.slots(chunked.row, 0, end)
        if self._graphs_take(chunked.embeds, end - start, end, 1):
            embeds, positions = chunked.embeds[:, start:end], chunked.positions[..., start:end]
            hidden = self.decoder.prefill_graphs.run(embeds, positions, index[start:end], index, [end - start], [end])
        else:
            positions = torch.arange(end, device=index.device)
            visible = positions[None, :] <= positions[start:end, None]  # causal, after the earlier chunks
            step = PagedStep(
                self.decoder.keys, self.decoder.values, index[start:end], index[None, :], visible[None, None]
            )
            # Copied, strides and all: a slice's (of a dimension of one too) follow the whole prompt's length, and
            # the compiled layers guard on them.
            embeds, positions = (
                part.clone(memory_format=torch.contiguous_format)
                for part in (chunked.embeds[:, start:end], chunked.positions[..., start:end])
            )
            hidden = self.through_language_model(step, embeds, positions)
        chunked.done = end
        if end < chunked.length:
            return None
        logits = self.model.get_output_embeddings()(hidden[:, -1:, :])[:, -1, :]
        prior = [chunked.prior] if chunked.prior else None
        return self.decoder.start_rows(
            [chunked.row], [end], logits, chunked.last_position, chunked.input_ids, [chunked.params], allowed, prior
        )
