"""Build offline, random-weight VLM folders that `from_pretrained` loads like the real models.

Support script for tests and GPU benchmarks; not part of the worker. Nothing is downloaded: the
tokenizer is a byte-level BPE (256 byte tokens, no merges) plus each family's special tokens, and
the chat templates are short copies of the real models' templates.

    python tools/tiny_models.py qwen2-vl /tmp/tiny-qwen2-vl
    python tools/tiny_models.py qwen2-vl /tmp/qwen2-vl-7b --shape qwen2-vl-7b --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
from pathlib import Path

FAMILIES = (
    "qwen2-vl",
    "qwen2.5-vl",
    "llava",
    "llava-next",
    "qwen3-vl",
    "gemma3",
    "llava-onevision",
    "paligemma",
    "smolvlm",
    "internvl-hf",
    "mistral3",
    "llama4",
    "glm4v",
    "phi4-multimodal",
)
SHAPES = ("tiny", "qwen2-vl-2b", "qwen2-vl-7b")

QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
LLAVA_SPECIAL = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]

# Qwen2-VL-*-Instruct's template, less the vision-id branches.
QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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

# Real Qwen2-VL sizes (config.json of Qwen/Qwen2-VL-2B-Instruct and -7B-Instruct).
QWEN2_VL_TEXT = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=None,
        mrope_section=[2, 3, 3],
        tie=False,
    ),
    "qwen2-vl-2b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        mrope_section=[16, 24, 24],
        tie=True,
    ),
    "qwen2-vl-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        mrope_section=[16, 24, 24],
        tie=False,
    ),
}
QWEN2_VL_VISION = {
    "tiny": dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2),
    "real": dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4),
}


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


def _qwen_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(QWEN_SPECIAL, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(QWEN2_VL_TEXT[shape])
    mrope, tie = text.pop("mrope_section"), text.pop("tie")
    text["vocab_size"] = text["vocab_size"] or len(tokenizer)
    text.update(
        rope_scaling={"type": "mrope", "mrope_section": mrope},
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=tie,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(QWEN2_VL_VISION["tiny" if shape == "tiny" else "real"])
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    token_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    if family == "qwen2-vl":
        vision["hidden_size"] = text["hidden_size"]
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **token_ids)
        model_class, processor_class = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor
    else:
        vision = dict(
            depth=vision["depth"],
            hidden_size=vision["embed_dim"],
            intermediate_size=vision["embed_dim"] * vision["mlp_ratio"],
            num_heads=vision["num_heads"],
            out_hidden_size=text["hidden_size"],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[vision["depth"] - 1],
        )
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **token_ids)
        model_class, processor_class = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor
    pixels = dict(min_pixels=56 * 56, max_pixels=(112 * 112 if shape == "tiny" else 28 * 28 * 16384))
    processor = processor_class(
        image_processor=tf.Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, **pixels),
        video_processor=tf.Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, **pixels),
        tokenizer=tokenizer,
        chat_template=QWEN_TEMPLATE,
    )
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return (
        config,
        model_class,
        processor,
        dict(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"]),
    )


def _llava_parts(family: str, shape: str):
    import transformers as tf

    if shape != "tiny":
        raise ValueError(f"{family} has only the 'tiny' shape")
    tokenizer = byte_level_tokenizer(LLAVA_SPECIAL, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>", add_bos=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL}
    vision = tf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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


# Qwen3-VL-*-Instruct: Qwen2-VL's template; patches of 16 merged 2x2 (boxes relative to 1000).
def _qwen3_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(QWEN_SPECIAL, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    config = tf.Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    pixels = dict(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128})
    processor = tf.Qwen3VLProcessor(
        image_processor=tf.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, **pixels),
        video_processor=tf.Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, **pixels),
        tokenizer=tokenizer,
        chat_template=QWEN_TEMPLATE,
    )
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return (
        config,
        tf.Qwen3VLForConditionalGeneration,
        processor,
        dict(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"]),
    )


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


def _gemma3_parts(family: str, shape: str):
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
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
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


def _llava_onevision_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        ONEVISION_SPECIAL, eos="<|im_end|>", pad="<|endoftext|>", image_token="<image>", video_token="<video>"
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ONEVISION_SPECIAL}
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    text = tf.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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


def _paligemma_parts(family: str, shape: str):
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
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        projection_dim=64,
    )
    text = tf.GemmaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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


def _smolvlm_parts(family: str, shape: str):
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
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    text = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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


def _internvl_parts(family: str, shape: str):
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
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=[32, 32],
        patch_size=[8, 8],
    )
    text = tf.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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


def _mistral3_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(MISTRAL3_SPECIAL, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>", add_bos=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in MISTRAL3_SPECIAL}
    vision = tf.PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=8,
        image_size=64,
        patch_size=8,
    )
    text = tf.MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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


def _llama4_parts(family: str, shape: str):
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


GLM4V_SPECIAL = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
    "<|begin_of_box|>",
    "<|end_of_box|>",
]
# zai-org/GLM-4.1V-9B-Thinking: [gMASK]<sop> opens the prompt; each image between its markers.
GLM4V_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for msg in messages %}{{ '<|' + msg['role'] + '|>\n' }}"
    "{% if msg['content'] is string %}{{ msg['content'] }}{% else %}"
    "{% for item in msg['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _glm4v_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        GLM4V_SPECIAL, eos="<|endoftext|>", pad="<|endoftext|>", image_token="<|image|>", video_token="<|video|>"
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_SPECIAL}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.5,
        },
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        image_size=28,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = tf.Glm4vConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
    )
    pixels = dict(
        size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112}, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    processor = tf.Glm4vProcessor(
        image_processor=tf.Glm4vImageProcessor(**pixels),
        video_processor=tf.Glm4vVideoProcessor(**pixels),
        tokenizer=tokenizer,
        chat_template=GLM4V_TEMPLATE,
    )
    return (
        config,
        tf.Glm4vForConditionalGeneration,
        processor,
        dict(eos_token_id=[ids["<|endoftext|>"], ids["<|user|>"]], pad_token_id=ids["<|endoftext|>"]),
    )


PHI4_SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|image|>", "<|audio|>"]
# microsoft/Phi-4-multimodal-instruct's tokenizer template: <|role|>content<|end|> per turn (text contents),
# then <|assistant|>; each image is an <|image|> in the text that the processor expands.
PHI4_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


def _phi4_multimodal_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        PHI4_SPECIAL, eos="<|endoftext|>", pad="<|endoftext|>", image_token="<|image|>", audio_token="<|audio|>"
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in PHI4_SPECIAL}
    # The processor writes 256 + ... tokens per image whatever its size: the vision side keeps the real
    # 448 px crops of 14 px patches; everything else is tiny (the audio encoder is built but never used).
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=448,
        patch_size=14,
        crop_size=448,
        image_token_id=ids["<|image|>"],
    )
    audio = dict(
        hidden_size=32,
        intermediate_size=64,
        num_blocks=1,
        num_attention_heads=4,
        ext_pw_out_channel=32,
        depthwise_separable_out_channel=32,
        nemo_conv_channels=32,
        audio_token_id=ids["<|audio|>"],
    )
    config = tf.Phi4MultimodalConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        sliding_window=262144,  # as the real config: LongRoPE
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0] * 6,
            "long_factor": [1.5] * 6,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        vision_config=vision,
        audio_config=audio,
    )
    processor = tf.Phi4MultimodalProcessor(
        image_processor=tf.Phi4MultimodalImageProcessor(),
        audio_processor=tf.Phi4MultimodalFeatureExtractor(),
        tokenizer=tokenizer,
        chat_template=PHI4_TEMPLATE,
    )
    return (
        config,
        tf.Phi4MultimodalForCausalLM,
        processor,
        dict(
            eos_token_id=[ids["<|endoftext|>"], ids["<|end|>"]],
            pad_token_id=ids["<|endoftext|>"],
            bos_token_id=ids["<|endoftext|>"],
        ),
    )


# The vision-lora/adapter_config.json of microsoft/Phi-4-multimodal-instruct's transformers format, as transformers'
# conversion script writes it (r 256, alpha 512): LoRA on every decoder layer's attention and MLP projections.
PHI4_VISION_LORA_TARGETS = r"model.layers.\d+.((self_attn.(qkv|o)_proj)|(mlp.(gate_up|down)_proj))"


def _save_vision_lora(model, folder: Path) -> None:
    """A random LoRA where Phi-4-multimodal keeps its vision adapter; nothing zero, so that it changes the answers."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=PHI4_VISION_LORA_TARGETS,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )  # False: lora_B random, not zeros
    get_peft_model(model, config).save_pretrained(folder)


PARTS = {
    "qwen2-vl": "_qwen_parts",
    "qwen2.5-vl": "_qwen_parts",
    "llava": "_llava_parts",
    "llava-next": "_llava_parts",
    "qwen3-vl": "_qwen3_parts",
    "gemma3": "_gemma3_parts",
    "llava-onevision": "_llava_onevision_parts",
    "paligemma": "_paligemma_parts",
    "smolvlm": "_smolvlm_parts",
    "internvl-hf": "_internvl_parts",
    "mistral3": "_mistral3_parts",
    "llama4": "_llama4_parts",
    "glm4v": "_glm4v_parts",
    "phi4-multimodal": "_phi4_multimodal_parts",
}


def _make_sensitive(model) -> None:
    """Widen the random weights so that the next token depends on every input: with the usual
    0.02 init a tiny model answers the same token whatever it is shown, and a test comparing two
    decoding paths could not tell a wrong position or a lost image from a right one."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name and parameter.dim() > 1:
                parameter.normal_(0.0, 0.3)


def _favour_eos(model, eos_id: int) -> None:
    """Make greedy decoding end at once: every token embedding carries a large constant in
    dimension 0 that survives the (tiny, random) layers and the final norm, and only the end
    token's lm_head row reads that dimension."""
    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 5.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[eos_id, 0] = 50.0


def build(
    family: str,
    out_dir,
    shape: str = "tiny",
    *,
    eos_bias: bool = False,
    device: str = "cpu",
    dtype: str = "fp32",
    seed: int = 0,
    vision_lora: bool = False,
) -> Path:
    """Write a random-weight model + processor + tokenizer + chat template into `out_dir`; `vision_lora`
    (Phi-4-multimodal) adds a random `vision-lora` PEFT adapter, as the real checkpoint ships."""
    import torch
    from transformers import GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
    if shape != "tiny" and family != "qwen2-vl":
        raise ValueError(f"shape {shape!r} is for the qwen2-vl family")
    if vision_lora and family != "phi4-multimodal":
        raise ValueError("vision_lora is for the phi4-multimodal family")
    config, model_class, processor, token_ids = globals()[PARTS[family]](family, shape)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(config, dtype=torch_dtype).eval()
    if shape == "tiny" and not eos_bias:
        _make_sensitive(model)
    if eos_bias:
        if shape != "tiny":
            raise ValueError("eos_bias is for tiny models")
        first_eos = token_ids["eos_token_id"]
        _favour_eos(model, first_eos[0] if isinstance(first_eos, list) else first_eos)
    model.generation_config = GenerationConfig(**token_ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    if vision_lora:
        _save_vision_lora(model, out / "vision-lora")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out_dir")
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--eos-bias", action="store_true", help="make greedy decoding stop at once")
    parser.add_argument("--device", default="cpu", help="where to initialise weights, e.g. cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--vision-lora", action="store_true", help="phi4-multimodal: add a random vision-lora adapter")
    args = parser.parse_args()
    out = build(
        args.family,
        args.out_dir,
        args.shape,
        eos_bias=args.eos_bias,
        device=args.device,
        dtype=args.dtype,
        vision_lora=args.vision_lora,
    )
    print(out)


if __name__ == "__main__":
    main()
