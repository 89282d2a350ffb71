"""Tiny Gemma 3 and PaliGemma."""

from __future__ import annotations

from tools.tiny_families.shapes import TINY_TEXT, TINY_VISION
from tools.tiny_families.tokenizer import byte_level_tokenizer

GEMMA_SPECIAL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]


# google/gemma-3-*-it: BOS in the template, a system turn folded into the first user turn, the
# assistant called "model", <start_of_image> where each image goes.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


GEMMA3_TEXT = {
    "tiny": lambda vocab: dict(
        vocab_size=vocab,
        **TINY_TEXT,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # google/gemma-3-4b-it's config.json: 34 layers, five of sliding window (1,024) to one global.
    "gemma3-4b": lambda vocab: dict(
        vocab_size=262208,
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=["full_attention" if (n + 1) % 6 == 0 else "sliding_attention" for n in range(34)],
    ),
}
GEMMA3_VISION = {  # SigLIP so400m at 896x896, patches of 14
    "tiny": TINY_VISION,
    "gemma3-4b": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16),
}


def gemma3_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        GEMMA_SPECIAL,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
        boi_token="<start_of_image>",
        eoi_token="<end_of_image>",
        image_token="<image_soft_token>",
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_SPECIAL}
    text = tf.Gemma3TextConfig(
        **GEMMA3_TEXT[shape](len(tokenizer)),
        max_position_embeddings=4096 if shape == "tiny" else 131072,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    side, image_tokens = (32, 4) if shape == "tiny" else (896, 256)
    vision = tf.SiglipVisionConfig(**GEMMA3_VISION[shape], image_size=side, patch_size=8 if shape == "tiny" else 14)
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=image_tokens,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    processor = tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessor(size={"height": side, "width": side}),
        tokenizer=tokenizer,
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=image_tokens,
    )
    return (
        config,
        tf.Gemma3ForConditionalGeneration,
        processor,
        dict(eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]], pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"]),
    )


def paligemma_parts(family: str, shape: str):
    """google/paligemma2-*-mix: no chat template; the processor writes `<image>`s, BOS, the task
    prefix and a newline, and adds the 1024 <loc> and 128 <seg> tokens to the tokenizer."""
    import transformers as tf

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
    tokenizer = byte_level_tokenizer(
        specials, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True, image_token="<image>"
    )
    processor = tf.PaliGemmaProcessor(
        image_processor=tf.SiglipImageProcessor(size={"height": 32, "width": 32}, image_seq_length=16),
        tokenizer=tokenizer,
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    vision = tf.SiglipVisionConfig(
        **TINY_VISION,
        image_size=32,
        patch_size=8,
        projection_dim=64,
    )
    text = tf.GemmaConfig(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
        head_dim=16,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    config = tf.PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        projection_dim=64,
        hidden_size=64,
        vocab_size=len(tokenizer),
    )
    return (
        config,
        tf.PaliGemmaForConditionalGeneration,
        processor,
        dict(eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"]),
    )
