"""Tiny GLM-4V and Phi-4-multimodal (with its vision LoRA)."""

from __future__ import annotations

from pathlib import Path

from tools.tiny_families.shapes import TINY_TEXT, TINY_VISION
from tools.tiny_families.tokenizer import byte_level_tokenizer

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


def glm4v_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        GLM4V_SPECIAL, eos="<|endoftext|>", pad="<|endoftext|>", image_token="<|image|>", video_token="<|video|>"
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_SPECIAL}
    text = dict(
        vocab_size=len(tokenizer),
        **TINY_TEXT,
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


# microsoft/Phi-4-multimodal-instruct's config.json (its Phi-4-mini language model; the vision tower's are the config's
# defaults): head_dim 128, 3/4 of it rotated, so 48 LongRoPE factors.
PHI4_TEXT = {
    "tiny": lambda vocab: dict(vocab_size=vocab, **TINY_TEXT),
    "phi4-multimodal-6b": lambda vocab: dict(
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
    ),
}


def phi4_multimodal_parts(family: str, shape: str):
    import transformers as tf

    tokenizer = byte_level_tokenizer(
        PHI4_SPECIAL, eos="<|endoftext|>", pad="<|endoftext|>", image_token="<|image|>", audio_token="<|audio|>"
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in PHI4_SPECIAL}
    # The processor writes 256 + ... tokens per image whatever its size: the vision side keeps the real
    # 448 px crops of 14 px patches; at the tiny shape everything else is tiny (the audio encoder is built but never
    # used).
    vision = dict(image_size=448, patch_size=14, crop_size=448, image_token_id=ids["<|image|>"])
    if shape == "tiny":
        vision.update(TINY_VISION)
    factors = 6 if shape == "tiny" else 48
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
        **PHI4_TEXT[shape](len(tokenizer)),
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        sliding_window=262144,  # as the real config: LongRoPE
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0] * factors,
            "long_factor": [1.5] * factors,
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


def save_vision_lora(model, folder: Path) -> None:
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
