"""Tiny SmolVLM (Idefics3) and InternVL (its transformers port)."""

from __future__ import annotations

from tools.tiny_families.qwen import QWEN_SPECIAL
from tools.tiny_families.shapes import TINY_TEXT, TINY_VISION
from tools.tiny_families.tokenizer import byte_level_tokenizer

SMOLVLM_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<video>",
]


# HuggingFaceTB/SmolVLM2-*-Instruct: starts with <|im_start|>, which is also the tokenizer's BOS.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}{% elif line['type'] == 'image' %}{{ '<image>' }}"
    "{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def smolvlm_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        SMOLVLM_SPECIAL,
        bos="<|im_start|>",
        eos="<end_of_utterance>",
        pad="<|endoftext|>",
        add_bos=True,
        image_token="<image>",
        fake_image_token="<fake_token_around_image>",
        global_image_token="<global-img>",
        end_of_utterance_token="<end_of_utterance>",
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SMOLVLM_SPECIAL}
    vision = dict(**TINY_VISION, image_size=32, patch_size=8)
    text = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config = tf.SmolVLMConfig(
        vision_config=vision,
        text_config=text,
        scale_factor=2,
        image_token_id=ids["<image>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    sizes = dict(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = tf.SmolVLMProcessor(
        image_processor=tf.SmolVLMImageProcessor(**sizes),
        # SmolVLM2's own video_sampling: a frame a second, at most 64 (its card's processor config)
        video_processor=tf.SmolVLMVideoProcessor(
            **sizes, video_sampling={"fps": 1, "max_frames": 64, "video_size": sizes["size"]}
        ),
        tokenizer=tokenizer,
        chat_template=SMOLVLM_TEMPLATE,
        image_seq_len=4,
    )
    return (
        config,
        tf.SmolVLMForConditionalGeneration,
        processor,
        dict(
            eos_token_id=ids["<end_of_utterance>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|im_start|>"]
        ),
    )


INTERNVL_SPECIAL = QWEN_SPECIAL + ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]


# OpenGVLab/InternVL3-*-hf: ChatML; each image is <IMG_CONTEXT> on its own line.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def internvl_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        INTERNVL_SPECIAL,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        start_image_token="<img>",
        end_image_token="</img>",
        context_image_token="<IMG_CONTEXT>",
        video_token="<video>",
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in INTERNVL_SPECIAL}
    vision = tf.InternVLVisionConfig(
        **TINY_VISION,
        image_size=[32, 32],
        patch_size=[8, 8],
    )
    text = tf.Qwen2Config(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config = tf.InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=4,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    patches = dict(size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1, max_patches=4)
    processor = tf.InternVLProcessor(
        image_processor=tf.GotOcr2ImageProcessor(**patches),
        video_processor=tf.InternVLVideoProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        chat_template=INTERNVL_TEMPLATE,
        image_seq_length=4,
    )
    return (
        config,
        tf.InternVLForConditionalGeneration,
        processor,
        dict(
            eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
            pad_token_id=ids["<|endoftext|>"],
            bos_token_id=ids["<|endoftext|>"],
        ),
    )
