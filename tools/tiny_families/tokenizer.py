"""The tiny models' tokenizer: 256 byte tokens, no merges, and a family's special tokens."""

from __future__ import annotations


def byte_level_tokenizer(
    special_tokens: list[str], bos=None, eos=None, pad=None, unk=None, add_bos=False, **named_tokens
):
    """256 byte tokens + `special_tokens`, wrapped as a transformers fast tokenizer; `named_tokens`
    (e.g. image_token="<image>") become attributes, as the real tokenizers' configs declare them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(sorted(ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        additional_special_tokens=[t for t in special_tokens if t not in (bos, eos, pad, unk)],
        **named_tokens,
    )
    if add_bos:  # LLaMA/Mistral tokenizers start every text with <s>
        bos_id = tokenizer.convert_tokens_to_ids(bos)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer
