"""A decode step's attention on the GPU: one query token per row over that row's own KV blocks (a Triton
kernel, split over each row's length, then a second one merging the splits by their log-sum-exps).

Hand-written: FlexAttention over a block mask needs 64-token blocks and, measured in our layout, ran only
1.6x faster than gathering every row's slots (300-400 GB/s, bench/results/decode-attention-08ae8b8.json);
FlashInfer and flash-attn compile their kernels at run time with nvcc, which a worker image lacks."""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future

from runpod_vlm.engine.blocks import BLOCK_SIZE

log = logging.getLogger("runpod-vlm")

SPLITS_TARGET = 2048  # programs a step aims at (rows x kv heads x splits): enough to fill an H200's 132 SMs
TILE = 64  # tokens one program reads per iteration
NUM_WARPS = 4
# Two, not Triton's default three: 2-16% faster in each of six mixes of rows and lengths on the H200 (12-16% at 16-64
# rows of 300-1,300 tokens), in two sweeps (bench/decode_attention.py --sweep).
NUM_STAGES = 2


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # One build per model, whatever its rows and its layers' windows.
    @triton.jit(do_not_specialize=["stride_table", "splits", "window", "chunk"])
    def paged_decode(
        query,  # [rows, heads, dim]
        keys,  # [slots, kv heads, dim]
        values,
        table,  # [rows, columns] block ids
        visible,  # [rows] tokens each row holds (its new one included)
        window,  # > 0: a sliding window, the row's last `window` tokens only
        chunk,  # > 0: chunked attention, the tokens of the new one's chunk only
        partial_out,  # [rows, heads, splits, dim] fp32
        partial_lse,  # [rows, heads, splits] fp32
        scale,
        stride_q_row,
        stride_q_head,
        stride_slot,
        stride_kv_head,
        stride_table,
        splits,
        GROUP: tl.constexpr,  # query heads per kv head, padded to a power of two >= 16
        HEADS_PER_KV: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK: tl.constexpr,  # the pool's block size
        TILE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(visible + row)
        first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        chunk_start = (length - 1) // tl.maximum(chunk, 1) * chunk
        first = tl.where(chunk > 0, tl.maximum(first, chunk_start), first)
        per_split = tl.cdiv(tl.cdiv(length - first, splits), TILE) * TILE
        start = first + split * per_split
        end = tl.minimum(start + per_split, length)
        group = tl.arange(0, GROUP)
        heads = kv_head * HEADS_PER_KV + group
        in_group = group < HEADS_PER_KV
        dims = tl.arange(0, DIM)
        q = tl.load(
            query + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
            mask=in_group[:, None],
            other=0.0,
        )
        best = tl.full([GROUP], float("-inf"), tl.float32)
        total = tl.zeros([GROUP], tl.float32)
        acc = tl.zeros([GROUP, DIM], tl.float32)
        for tile_start in range(start, end, TILE):
            tokens = tile_start + tl.arange(0, TILE)
            seen = tokens < end
            block = tl.load(table + row * stride_table + tokens // BLOCK, mask=seen, other=0)
            slots = block.to(tl.int64) * BLOCK + tokens % BLOCK
            where = slots[:, None] * stride_slot + kv_head * stride_kv_head + dims[None, :]
            k = tl.load(keys + where, mask=seen[:, None], other=0.0)
            if IEEE:  # fp32 models: exact products, as SDPA gives them
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            rescale = tl.exp(best - new_best)
            p = tl.exp(scores - new_best[:, None])
            total = total * rescale + tl.sum(p, 1)
            v = tl.load(values + where, mask=seen[:, None], other=0.0)
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            best = new_best
        safe_total = tl.where(total > 0, total, 1.0)
        out_at = ((row * tl.num_programs(1) * HEADS_PER_KV + heads) * splits + split) * DIM
        tl.store(partial_out + out_at[:, None] + dims[None, :], acc / safe_total[:, None], mask=in_group[:, None])
        lse = tl.where(total > 0, best + tl.log(safe_total), float("-inf"))
        tl.store(partial_lse + (row * tl.num_programs(1) * HEADS_PER_KV + heads) * splits + split, lse, mask=in_group)

    # One kernel, not five (softmax, nan_to_num, mul, sum, cast): at one row a step is bound by launches.
    @triton.jit(do_not_specialize=["splits"])
    def merge_splits(
        partial_out,  # [rows x heads, splits, dim] fp32
        partial_lse,  # [rows x heads, splits] fp32
        output,  # [rows x heads, dim]
        splits,
        SPLITS: tl.constexpr,  # splits, padded to a power of two
        DIM: tl.constexpr,
    ):
        at = tl.program_id(0)
        split = tl.arange(0, SPLITS)
        used = split < splits
        lse = tl.load(partial_lse + at * splits + split, mask=used, other=float("-inf"))
        best = tl.max(lse, 0)
        weights = tl.where(lse > float("-inf"), tl.exp(lse - best), 0.0)  # a split with no tokens weighs 0
        total = tl.sum(weights, 0)
        weights = weights / tl.where(total > 0, total, 1.0)
        dims = tl.arange(0, DIM)
        where = (at * splits + split)[:, None] * DIM + dims[None, :]
        parts = tl.load(partial_out + where, mask=used[:, None], other=0.0)
        tl.store(output + at * DIM + dims, tl.sum(parts * weights[:, None], 0).to(output.dtype.element_ty))

    return paged_decode, merge_splits


_builds: dict[tuple, Future] = {}  # (heads, kv heads, head dim, dtype) -> whether the kernel built and ran
_builds_lock = threading.Lock()


def usable(model) -> bool:
    """Whether the kernel computes this model's decode attention as SDPA does (on CUDA with Triton, no logit
    softcapping, grouped heads, a power-of-two head dim) and is built: waits for `build_ahead`'s build."""
    if model.device.type != "cuda":
        return False
    return _build(model.config, model.get_output_embeddings().weight.dtype).result()


def build_ahead(config, dtype) -> None:
    """Start building the kernel for this model on a thread, while its weights load: Triton's first build
    takes seconds, which would otherwise come before a new worker's first answer."""
    _build(config, dtype)


def _build(config, dtype) -> Future:
    from runpod_vlm.engine.memory import config_kv_layout

    if not _triton_available():
        return _done(False)
    text = config.get_text_config(decoder=True)
    _, kv_heads, dim = config_kv_layout(config)
    if getattr(text, "attn_logit_softcapping", None) is not None or text.num_attention_heads % kv_heads:
        return _done(False)
    if dim < 16 or dim & (dim - 1):
        return _done(False)
    key = (text.num_attention_heads, kv_heads, dim, dtype)
    with _builds_lock:
        if key in _builds:
            return _builds[key]
        _builds[key] = future = Future()
    threading.Thread(target=_run_once, args=(key, future), name="vlm-kernel-build", daemon=True).start()
    return future


def _done(result: bool) -> Future:
    future = Future()
    future.set_result(result)
    return future


def _run_once(key: tuple, future: Future) -> None:
    """Build the kernel by running it on a tiny pool with the model's strides (Triton builds per stride class)."""
    import torch

    heads, kv_heads, dim, dtype = key
    try:
        with torch.inference_mode():
            keys = torch.randn(2 * BLOCK_SIZE, kv_heads, dim, device="cuda", dtype=dtype)
            query = torch.randn(1, heads, 1, dim, device="cuda", dtype=dtype)
            table = torch.tensor([[1, 0]], device="cuda")
            seen = torch.tensor([5], device="cuda")
            output = paged_decode_attention(query, keys, keys, table, seen, BLOCK_SIZE, dim**-0.5)
            torch.cuda.synchronize()
        future.set_result(bool(torch.isfinite(output).all()))
    except Exception:  # the decode steps gather each row's slots instead
        log.warning("the paged decode kernel did not build; decode steps gather instead", exc_info=True)
        future.set_result(False)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def paged_decode_attention(
    query, keys, values, table, visible, block_size: int, scale: float, window: int = 0, chunk: int = 0
):
    """query [rows, heads, 1, dim]; keys/values [slots, kv heads, dim]; table [rows, columns]; visible [rows] the
    tokens each row holds, of which it attends to its last `window` (a sliding-window layer) or those of its new
    token's `chunk` (a chunked-attention layer), where given. Returns [rows, heads, 1, dim]."""
    import torch
    import triton

    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    per_kv = heads // kv_heads
    splits = max(1, min(32, SPLITS_TARGET // (rows * kv_heads)))
    partial_out = torch.empty((rows, heads, splits, dim), dtype=torch.float32, device=query.device)
    partial_lse = torch.empty((rows, heads, splits), dtype=torch.float32, device=query.device)
    q = query[:, :, 0, :]
    q = q if q.stride(-1) == 1 else q.contiguous()
    paged_decode, merge_splits = _kernel()
    paged_decode[(rows, kv_heads, splits)](
        q,
        keys,
        values,
        table,
        visible,
        window,
        chunk,
        partial_out,
        partial_lse,
        scale,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        table.stride(0),
        splits,
        GROUP=max(16, triton.next_power_of_2(per_kv)),
        HEADS_PER_KV=per_kv,
        DIM=dim,
        BLOCK=block_size,
        TILE=TILE,
        IEEE=query.dtype == torch.float32,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    output = torch.empty((rows, heads, 1, dim), dtype=query.dtype, device=query.device)
    merge_splits[(rows * heads,)](
        partial_out, partial_lse, output, splits, SPLITS=triton.next_power_of_2(splits), DIM=dim
    )
    return output
