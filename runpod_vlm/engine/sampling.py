"""A decode step's next token per row from its logits: the repetition penalty, min_new_tokens, a grammar's
mask, greedy or temperature and top-p sampling, and log-probabilities; tensor ops alone, so that a CUDA graph
holds them."""

from __future__ import annotations

import random
import types
from typing import Optional

MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound
SAMPLED_TOGETHER = 64  # rows whose sampling temporaries are held at once


class Sampler:
    """The vocabulary-wide tensors a step's choice reads, made once per decoder on the model's device."""

    def __init__(self, model, eos_ids: set):
        import torch

        device = model.device
        self.vocab = vocab = model.get_output_embeddings().weight.shape[0]
        self.eos_index = torch.tensor(sorted(i for i in eos_ids if i < vocab), dtype=torch.long, device=device)
        self.top_k = min(MAX_TOP_LOGPROBS, vocab)  # alternatives recorded per token when a row asks for logprobs
        self.vocab_index = torch.arange(vocab, device=device)
        self.mask_word, self.mask_bit = self.vocab_index // 32, self.vocab_index % 32  # a token's place in `allowed`
        penalty = getattr(model.generation_config, "repetition_penalty", None) or 1.0
        self.penalty = penalty if penalty != 1.0 else None

    def choose(
        self,
        logits,
        rows: types.SimpleNamespace,
        any_sample: bool,
        with_logprobs: bool = False,
        masked: bool = False,
        any_top_p: bool = True,
    ):
        """Each row's next token from its logits; with `with_logprobs`, also each token's log-probability and the
        `top_k` most likely tokens': log_softmax of the model's own logits, before the repetition penalty, the
        end-token block of min_new_tokens, temperature and top-p (as generate()'s output_logits, and vLLM's).
        `any_top_p`: whether a sampled row's top_p is below 1 (`sampled`)."""
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
            token = torch.where(rows.sample, self.sampled(logits, rows, any_top_p), token)
        if rows.seen is not None:
            rows.seen.scatter_(1, token[:, None], True)
        if logprobs is None:
            return token, None
        top_logprob, top_id = logprobs.topk(self.top_k, dim=-1)
        return token, (logprobs.gather(1, token[:, None])[:, 0], top_id, top_logprob)

    def sampled(self, logits, rows: types.SimpleNamespace, top_p: bool = True):
        """Temperature and top-p sampling, drawn as argmax(p / Exp(1)) so a CUDA graph can hold it. The
        Exp(1) noise is a function of the row's seed, its token's index and the vocabulary index alone, so
        a seeded row draws the same tokens alone, batched or beside any other rows. A row whose top_p is 1 keeps
        every token (generate() adds no top-p warper for it), and without `top_p` (no row's below 1) the vocabulary
        is not sorted at all. SAMPLED_TOGETHER rows at a time, in place where it can be: each [rows, vocab] float
        is 155 MB at 256 rows of a 152k vocabulary, and a 256-row step's graph, recorded ahead capped to 24 GB, ran
        out of memory in its sort (bench/README.md)."""
        import torch

        starts = range(0, logits.shape[0], SAMPLED_TOGETHER)
        parts = [self._sampled_rows(logits, rows, slice(start, start + SAMPLED_TOGETHER), top_p) for start in starts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _sampled_rows(self, logits, rows: types.SimpleNamespace, part: slice, top_p: bool):
        import torch

        probs = torch.softmax(logits[part] / rows.temperature[part].clamp(min=1e-5)[:, None], dim=-1)
        if top_p:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)  # the mass of the tokens more likely than each
            limit = rows.top_p[part, None]
            sorted_probs.masked_fill_((before > limit) & (limit < 1), 0.0)
            del before
            probs.scatter_(1, order, sorted_probs)
            del sorted_probs, order
        noise = counter_uniform(rows.seed[part], rows.count[part], self.vocab_index).log_().neg_()  # Exp(1)
        return probs.div_(noise).argmax(dim=-1)


def row_seed(seed: Optional[int]) -> tuple[int, int]:
    """A row's sampling seed as its low and high 32 bits: the request's (an int64, checked when read), else a fresh
    random one. All 64 bits key the row's draws: seeds that differ anywhere draw differently."""
    seed = (seed if seed is not None else random.getrandbits(64)) & 0xFFFFFFFFFFFFFFFF
    return seed & 0xFFFFFFFF, seed >> 32


def counter_uniform(seed, step, index):
    """Uniform draws in (0, 1) for every (row, index): a hash of (the row's 64-bit seed, its step, index), made of
    integer tensor ops a CUDA graph can hold; products stay under 2**63 (31-bit odd constants, 32-bit values).
    Hand-written: torch's generators hold one state for a whole tensor, not a counter per row."""
    import torch

    mask = 0xFFFFFFFF
    low, high = seed.bitwise_and(mask), (seed >> 32).bitwise_and(mask)
    x = ((low * 0x27D4EB2F + step * 0x165667B1)[:, None] + index[None, :] * 0x61C88647).bitwise_and_(mask)
    for multiplier in (0x7FEB352D, 0x6A09E667):  # in place: x is [rows, vocab] of int64
        x.bitwise_xor_(x >> 15).mul_(multiplier).bitwise_and_(mask)
    x.bitwise_xor_((high * 0x3C6EF373 + 0x9E3779B9).bitwise_and_(mask)[:, None])  # the high half (odd: a bijection)
    for multiplier in (0x5BD1E995, 0x2545F491):
        x.bitwise_xor_(x >> 15).mul_(multiplier).bitwise_and_(mask)
    x.bitwise_xor_(x >> 16).bitwise_right_shift_(9)
    return x.to(torch.float32).add_(0.5).div_(float(1 << 23))  # 23 bits: exact in float32, never 0 or 1
