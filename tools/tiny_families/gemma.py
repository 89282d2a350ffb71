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
        vocab_size=len(tokenizer),
        **TINY_TEXT,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    vision = tf.SiglipVisionConfig(**TINY_VISION, image_size=32, patch_size=8)
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    processor = tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=4,
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
