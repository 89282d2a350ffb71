"""Tiny LLaVA, LLaVA-NeXT and LLaVA-OneVision."""

from __future__ import annotations

from tools.tiny_families.qwen import QWEN_SPECIAL
from tools.tiny_families.shapes import TINY_TEXT, TINY_VISION
from tools.tiny_families.tokenizer import byte_level_tokenizer

LLAVA_SPECIAL = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]


# llava-hf/llava-1.5-*-hf: images first, then text; a system turn is printed without a prefix.
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


# llava-hf/llava-v1.6-mistral-7b-hf: Mistral [INST] turns, images before text.
LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\n' + message['content'][0]['text'] + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{ ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'][0]['text'] + '</s> ' }}"
    "{% endif %}{% endfor %}"
)


def llava_parts(family: str, shape: str):
    import transformers as tf

    if shape != "tiny":
        raise ValueError(f"{family} has only the 'tiny' shape")
    tokenizer = byte_level_tokenizer(LLAVA_SPECIAL, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>", add_bos=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL}
    vision = tf.CLIPVisionConfig(**TINY_VISION, image_size=32, patch_size=8)
    text = dict(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    common = dict(
        image_token_id=ids["<image>"],
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    image_kwargs = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor_kwargs = dict(
        patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token="<image>"
    )
    if family == "llava":
        config = tf.LlavaConfig(vision_config=vision, text_config=tf.LlamaConfig(**text), image_seq_length=16, **common)
        processor = tf.LlavaProcessor(
            image_processor=tf.CLIPImageProcessor(**image_kwargs),
            tokenizer=tokenizer,
            chat_template=LLAVA_TEMPLATE,
            **processor_kwargs,
        )
        model_class = tf.LlavaForConditionalGeneration
    else:
        pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
        config = tf.LlavaNextConfig(
            vision_config=vision,
            text_config=tf.MistralConfig(**text),
            image_grid_pinpoints=pinpoints,
            image_seq_length=16,
            **common,
        )
        processor = tf.LlavaNextProcessor(
            image_processor=tf.LlavaNextImageProcessor(image_grid_pinpoints=pinpoints, **image_kwargs),
            tokenizer=tokenizer,
            chat_template=LLAVA_NEXT_TEMPLATE,
            **processor_kwargs,
        )
        model_class = tf.LlavaNextForConditionalGeneration
    return (
        config,
        model_class,
        processor,
        dict(eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"]),
    )


ONEVISION_SPECIAL = QWEN_SPECIAL + ["<image>", "<video>"]


# llava-hf/llava-onevision-qwen2-*-ov-hf: ChatML, every image of a turn first, then its videos, then its text.
ONEVISION_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llava_onevision_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        ONEVISION_SPECIAL, eos="<|im_end|>", pad="<|endoftext|>", image_token="<image>", video_token="<video>"
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ONEVISION_SPECIAL}
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    vision = tf.SiglipVisionConfig(**TINY_VISION, image_size=32, patch_size=8)
    text = tf.Qwen2Config(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config = tf.LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_kwargs = dict(size={"height": 32, "width": 32}, image_grid_pinpoints=pinpoints)
    processor = tf.LlavaOnevisionProcessor(
        image_processor=tf.LlavaOnevisionImageProcessor(**image_kwargs),
        video_processor=tf.LlavaOnevisionVideoProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        chat_template=ONEVISION_TEMPLATE,
        num_image_tokens=16,
        vision_feature_select_strategy="full",
    )
    return (
        config,
        tf.LlavaOnevisionForConditionalGeneration,
        processor,
        dict(
            eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
            pad_token_id=ids["<|endoftext|>"],
            bos_token_id=ids["<|endoftext|>"],
        ),
    )
