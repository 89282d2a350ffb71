"""Tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL (and the real shapes of Qwen2-VL-2B/7B, random weights)."""

from __future__ import annotations

from tools.tiny_families.shapes import TINY_TEXT
from tools.tiny_families.tokenizer import byte_level_tokenizer

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


# The Qwen2.5 chat template's tools branches (Hermes-style <tool_call> blocks, <tool_response> in a user turn),
# with the VL templates' image and video blocks: Qwen2.5-VL-*-Instruct's tokenizer template (its processor's has
# no tools) and Qwen3-VL-*-Instruct's processor template, less their vision-id and reasoning branches.
QWEN_TOOLS_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'video' or 'video' in part -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{- part.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- render(messages[0].content) -}}"
    "{%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\n' + render(messages[0].content) + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) -%}"
    "{{- '<|im_start|>' + message.role + '\n' + render(message.content) + '<|im_end|>\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}{%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
    '{{- \'\n<tool_call>\n{"name": "\' + call.name + \'", "arguments": \' + (call.arguments | tojson) '
    "+ '}\n</tool_call>' -}}{%- endfor -%}{{- '<|im_end|>\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + render(message.content) + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


# Real Qwen2-VL sizes (config.json of Qwen/Qwen2-VL-2B-Instruct and -7B-Instruct).
QWEN2_VL_TEXT = {
    "tiny": dict(
        **TINY_TEXT,
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


def qwen2_parts(family: str, shape: str):
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
    if family != "qwen2-vl":
        tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return (
        config,
        model_class,
        processor,
        dict(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"]),
    )


# Qwen3-VL-*-Instruct: the template with tools; patches of 16 merged 2x2 (boxes relative to 1000).
def qwen3_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(QWEN_SPECIAL, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
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
        chat_template=QWEN_TOOLS_TEMPLATE,
    )
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return (
        config,
        tf.Qwen3VLForConditionalGeneration,
        processor,
        dict(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"]),
    )
