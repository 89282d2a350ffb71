"""A decode step's attention on the GPU: one query token per row over that row's own KV blocks (a Triton
kernel, split over each row's length, then a log-sum-exp merge of the splits).

Hand-written: FlexAttention over a block mask needs 64-token blocks and, measured in our layout, ran only
1.6x faster than gathering every row's slots (300-400 GB/s, bench/results/decode-attention.json);
FlashInfer and flash-attn compile their kernels at run time with nvcc, which a worker image lacks."""

from __future__ import annotations

import functools

SPLITS_TARGET = 2048  # programs a step aims at (rows x kv heads x splits): enough to fill an H200's 132 SMs
TILE = 64  # tokens one program reads per iteration


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        query,  # [rows, heads, dim]
        keys,  # [slots, kv heads, dim]
        values,
        table,  # [rows, columns] block ids
        visible,  # [rows] tokens each row sees (its new one included)
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
        per_split = tl.cdiv(tl.cdiv(length, splits), TILE) * TILE
        start, end = split * per_split, tl.minimum(split * per_split + per_split, length)
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

    return paged_decode


def usable(model) -> bool:
    """Whether the kernel computes this model's decode attention as SDPA does: on CUDA with Triton, no
    logit softcapping, grouped heads and a power-of-two head dim."""
    from runpod_vlm.engine.memory import kv_layout

    config = model.config.get_text_config(decoder=True)
    _, kv_heads, dim = kv_layout(model)
    return (
        model.device.type == "cuda"
        and getattr(config, "attn_logit_softcapping", None) is None
        and config.num_attention_heads % kv_heads == 0
        and dim >= 16
        and dim & (dim - 1) == 0
        and _triton_available()
    )


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def paged_decode_attention(query, keys, values, table, visible, block_size: int, scale: float):
    """query [rows, heads, 1, dim]; keys/values [slots, kv heads, dim]; table [rows, columns]; visible [rows].
    Returns [rows, heads, 1, dim]."""
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
    _kernel()[(rows, kv_heads, splits)](
        q,
        keys,
        values,
        table,
        visible,
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
    )
    weights = torch.softmax(partial_lse, dim=-1).nan_to_num_(0.0)  # a split with no tokens weighs 0
    return (partial_out * weights[..., None]).sum(dim=2, keepdim=True).to(query.dtype)
