"""Tiny Mistral 3 and Llama 4."""

from __future__ import annotations

from tools.tiny_families.shapes import TINY_TEXT, TINY_VISION
from tools.tiny_families.tokenizer import byte_level_tokenizer

MISTRAL3_SPECIAL = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]


# mistralai/Mistral-Small-3.1-24B-Instruct-2503: BOS in the template, [SYSTEM_PROMPT] and [INST] turns.
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT]' + messages[0]['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST]' }}"
    "{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}{% elif block['type'] == 'image' %}{{ '[IMG]' }}{% endif %}"
    "{% endfor %}{{ '[/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'][0]['text'] + eos_token }}{% endif %}"
    "{% endfor %}"
)


def mistral3_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(MISTRAL3_SPECIAL, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>", add_bos=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in MISTRAL3_SPECIAL}
    vision = tf.PixtralVisionConfig(
        **TINY_VISION,
        head_dim=8,
        image_size=64,
        patch_size=8,
    )
    text = tf.MistralConfig(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
        head_dim=16,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    config = tf.Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["[IMG]"],
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    processor = tf.PixtralProcessor(
        image_processor=tf.PixtralImageProcessor(size={"longest_edge": 64}, patch_size=8),
        tokenizer=tokenizer,
        chat_template=MISTRAL3_TEMPLATE,
        patch_size=8,
        spatial_merge_size=2,
    )
    return (
        config,
        tf.Mistral3ForConditionalGeneration,
        processor,
        dict(eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"]),
    )


LLAMA4_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eot|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
    "<|python_start|>",
    "<|python_end|>",
]


def llama4_parts(family: str, shape: str):
    """meta-llama/Llama-4-Scout-17B-16E-Instruct: a mixture-of-experts text model; the processor's
    own chat template (the card's); 32px tiles of 8px patches, pixel-shuffled to 4 tokens."""
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        LLAMA4_SPECIAL, bos="<|begin_of_text|>", eos="<|eot|>", pad="<|finetune_right_pad|>", add_bos=True
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAMA4_SPECIAL}
    vision = tf.Llama4VisionConfig(
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
        pixel_shuffle_ratio=0.5,
    )
    text = tf.Llama4TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=64,
        no_rope_layer_interval=2,  # a chunked layer with RoPE, then a full one without (Scout: 3 and 1)
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|eot|>"],
        pad_token_id=ids["<|finetune_right_pad|>"],
    )
    config = tf.Llama4Config(
        vision_config=vision,
        text_config=text,
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
    )
    processor = tf.Llama4Processor(
        image_processor=tf.Llama4ImageProcessor(size={"height": 32, "width": 32}, max_patches=4),
        tokenizer=tokenizer,
        patch_size=8,
        pixel_shuffle_ratio=0.5,
    )
    return (
        config,
        tf.Llama4ForConditionalGeneration,
        processor,
        dict(
            eos_token_id=[ids["<|eot|>"], ids["<|end_of_text|>"]],
            pad_token_id=ids["<|finetune_right_pad|>"],
            bos_token_id=ids["<|begin_of_text|>"],
        ),
    )
