"""How many tokens the KV pool holds: a setting, or what the GPU has beside the weights and the work memory."""

from __future__ import annotations

import logging

from runpod_vlm.settings import Settings, SettingsError

log = logging.getLogger("runpod-vlm")

CPU_KV_CACHE_TOKENS = 32768


def kv_pool_tokens(model, settings: Settings, dtype, graph_tokens: int = 0, prepared_pixels: int = 0) -> int:
    """VLM_KV_CACHE_TOKENS, else what the GPU holds beside the weights and a step's measured work memory (and the
    prefill graphs' own, for prefills of up to `graph_tokens`), the image cache and the `prepared_pixels` bytes that
    may wait on it for admission, within VLM_GPU_MEMORY_UTILIZATION of the memory this process may use (its cap,
    when it has one). A VLM_KV_CACHE_TOKENS beyond that is a SettingsError at boot, not an out-of-memory later."""
    import torch

    if not str(model.device).startswith("cuda"):
        return settings.kv_cache_tokens or CPU_KV_CACHE_TOKENS
    device = model.device
    total = torch.cuda.get_device_properties(device).total_memory
    # The utilization applies to the cap too: at min(utilization, cap) a process capped to a 24 GB card's share
    # had no headroom left for a large request's vision pass, which then ran out of memory on the H200.
    limit = total * settings.gpu_memory_utilization * torch.cuda.get_per_process_memory_fraction(device)
    limit = min(limit, torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device))
    work = measured_work_memory(model, settings, dtype, graph_tokens)
    weights = torch.cuda.memory_allocated(device)
    images = settings.image_cache_mb * 2**20 + prepared_pixels
    per_token = kv_bytes_per_token(model)
    tokens = max(0, int((limit - weights - work - images) // per_token))
    log.info(
        "GPU memory for the KV pool: limit %.1f GB, weights %.1f GB, measured work memory %.1f GB, images "
        "%.1f GB -> room for %d tokens",
        limit / 1e9,
        weights / 1e9,
        work / 1e9,
        images / 1e9,
        tokens,
    )
    if settings.kv_cache_tokens > tokens:
        raise SettingsError(
            f"VLM_KV_CACHE_TOKENS={settings.kv_cache_tokens}: that KV pool needs "
            f"{settings.kv_cache_tokens * per_token / 1e9:.1f} GB, and this GPU has room for {tokens} tokens "
            f"({tokens * per_token / 1e9:.1f} GB) within VLM_GPU_MEMORY_UTILIZATION beside the weights, a step's work "
            "memory and the images; set it lower, or leave it unset to size the pool from the GPU"
        )
    return settings.kv_cache_tokens or tokens


def kv_layout(model) -> tuple[int, int, int]:
    """The text model's KV cache per token: (layers, key/value heads, head dim), from its config."""
    return config_kv_layout(model.config)


def config_kv_layout(config) -> tuple[int, int, int]:
    config = config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, dim


def kv_bytes_per_token(model) -> int:
    layers, heads, dim = kv_layout(model)
    return 2 * layers * heads * dim * model.get_output_embeddings().weight.element_size()


def measured_work_memory(model, settings: Settings, dtype, graph_tokens: int = 0) -> int:
    """Peak memory beyond the weights of a prefill at the step's token budget (text: the vision tower's
    share comes out of the headroom VLM_GPU_MEMORY_UTILIZATION leaves), plus the sampler's at full rows, plus
    that of a prefill of `graph_tokens` (the prefill graphs' memory pool holds it beside the eager prefills')."""
    vocab = model.get_output_embeddings().weight.shape[0]
    sampler = 8 * settings.max_batch_size * vocab * 4  # float32 logits, probabilities, sort, noise
    prefill = _prefill_peak(model, settings.max_batch_tokens, dtype)
    return prefill + sampler + (_prefill_peak(model, graph_tokens, dtype) if graph_tokens else 0)


def _prefill_peak(model, tokens: int, dtype) -> int:
    import torch

    device = model.device
    hidden = model.get_input_embeddings().weight.shape[1]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        embeds = torch.zeros(1, tokens, hidden, dtype=dtype, device=device)
        hidden_states = text_model(model)(inputs_embeds=embeds, use_cache=False).last_hidden_state
        model.get_output_embeddings()(hidden_states[:, -1:])
        del embeds, hidden_states
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def text_model(model):
    """The language model without its head, whose output holds the last hidden states: `get_decoder()`, or its
    inner model where that is a causal LM with its head (Llama 4's)."""
    decoder = model.get_decoder()
    inner = getattr(decoder, "model", None)
    return inner if inner is not None and hasattr(decoder, "lm_head") else decoder
