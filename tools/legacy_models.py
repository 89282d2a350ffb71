"""Build tiny random-weight models of the remote-code families from their repositories' own code.

Support script for tests/test_remote_code_real.py; not part of the worker. MiniCPM-V 2.6, Phi-3-vision
and InternVL2 are served through the Python files of their Hugging Face repositories
(trust_remote_code), which run on the legacy line only (transformers 4.45-4.48). This project does not
carry that code: point CODE_DIR at a folder with one subfolder per family holding the repository's
files as published (Python files, config.json, tokenizer and processor files; no weights needed):

    CODE_DIR/internvl_chat/   OpenGVLab/InternVL2-2B or -8B (InternLM2 language model)
    CODE_DIR/phi3_v/          microsoft/Phi-3-vision-128k-instruct
    CODE_DIR/minicpmv/        openbmb/MiniCPM-V-2_6 (its Python files suffice: without config.json,
                              preprocessor_config.json or a tokenizer, the values below and a byte-level
                              stand-in tokenizer are used)

Each model keeps the repository's code, tokenizer, chat template, processor and config (so its
auto_map, image token counts and attention setting), with the layers shrunk and random weights.

    python tools/legacy_models.py internvl2 CODE_DIR /tmp/tiny-internvl2
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

from tools.tiny_models import _favour_eos, _make_sensitive

FAMILIES = {"internvl2": "internvl_chat", "phi3-vision": "phi3_v", "minicpm-v": "minicpmv"}
MODELING_FILES = {
    "internvl2": "modeling_internvl_chat.py",
    "phi3-vision": "modeling_phi3_v.py",
    "minicpm-v": "modeling_minicpmv.py",
}

# openbmb/MiniCPM-V-2_6's config.json and preprocessor_config.json values (Qwen2 7B + SigLIP 400M,
# 64 query tokens per slice, up to 9 slices of 448px with image ids), written here from its model
# page for a copy of its code that lacks those files; the layers are shrunk below, the token ids
# taken from the tokenizer.
MINICPM_V_2_6_CONFIG = {
    "architectures": ["MiniCPMV"],
    "model_type": "minicpmv",
    "auto_map": {
        "AutoConfig": "configuration_minicpm.MiniCPMVConfig",
        "AutoModel": "modeling_minicpmv.MiniCPMV",
        "AutoModelForCausalLM": "modeling_minicpmv.MiniCPMV",
    },
    "attention_dropout": 0.0,
    "batch_vision_input": True,
    "drop_vision_last_layer": False,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "image_size": 448,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "patch_size": 14,
    "query_num": 64,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "slice_config": {"max_slice_nums": 9, "model_type": "minicpmv", "patch_size": 14, "scale_resolution": 448},
    "slice_mode": True,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_image_id": True,
    "use_sliding_window": False,
    "vision_batch_size": 16,
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 980,
        "intermediate_size": 4304,
        "model_type": "siglip",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
    },
    "vocab_size": 151666,
}
MINICPM_V_2_6_PREPROCESSOR = {
    "image_processor_type": "MiniCPMVImageProcessor",
    "processor_class": "MiniCPMVProcessor",
    "auto_map": {
        "AutoProcessor": "processing_minicpmv.MiniCPMVProcessor",
        "AutoImageProcessor": "image_processing_minicpmv.MiniCPMVImageProcessor",
    },
    "max_slice_nums": 9,
    "scale_resolution": 448,
    "patch_size": 14,
    "use_image_id": True,
    "image_feature_size": 64,
    "im_start": "<image>",
    "im_end": "</image>",
    "slice_start": "<slice>",
    "slice_end": "</slice>",
    "unk": "<unk>",
    "im_id_start": "<image_id>",
    "im_id_end": "</image_id>",
    "slice_mode": True,
    "norm_mean": [0.5, 0.5, 0.5],
    "norm_std": [0.5, 0.5, 0.5],
    "version": 2.6,
}
MINICPM_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<unk>",
    "<image>",
    "</image>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<quad>",
    "</quad>",
    "<point>",
    "</point>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
]
CHATML_TEMPLATE = (  # Qwen2's template, which MiniCPM-V 2.6's tokenizer carries
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _shrink_internvl2(config: dict, out: Path) -> str:
    # The 448px tiles and 256 image tokens per tile stay as published; only the layers shrink.
    config["llm_config"].update(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return "AutoModel"


def _shrink_phi3_vision(config: dict, out: Path) -> str:
    head_dim = 16
    config.update(
        hidden_size=4 * head_dim,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    rope = config.get("rope_scaling") or {}
    for key in ("long_factor", "short_factor"):
        if key in rope:
            rope[key] = rope[key][: head_dim // 2]
    # Its image embedding builds a CLIP ViT-L/14-336 whatever the config says; one crop (plus the
    # global view) per image keeps a CPU forward short. num_crops is a documented processor option.
    processor_file = out / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text())
    processor["num_crops"] = 1
    processor_file.write_text(json.dumps(processor, indent=2))
    return "AutoModelForCausalLM"


def _shrink_minicpm_v(config: dict, out: Path) -> str:
    if not (out / "tokenizer_config.json").is_file():  # a byte-level stand-in for its Qwen2 vocabulary
        from tools.tiny_families.tokenizer import byte_level_tokenizer

        tokenizer = byte_level_tokenizer(MINICPM_SPECIAL, eos="<|im_end|>", pad="<|endoftext|>", unk="<unk>")
        tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.save_pretrained(out)
        settings = json.loads((out / "tokenizer_config.json").read_text())
        settings.update(
            tokenizer_class="MiniCPMVTokenizerFast",
            auto_map={"AutoTokenizer": [None, "tokenization_minicpmv_fast.MiniCPMVTokenizerFast"]},
        )
        (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
        config.update(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.eos_token_id,
        )
    if not (out / "preprocessor_config.json").is_file():
        (out / "preprocessor_config.json").write_text(json.dumps(MINICPM_V_2_6_PREPROCESSOR, indent=2))
    # The resampler has hidden_size // 128 heads.
    config.update(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return "AutoModel"


SHRINK = {"internvl2": _shrink_internvl2, "phi3-vision": _shrink_phi3_vision, "minicpm-v": _shrink_minicpm_v}


def build(family: str, code_dir, out_dir, *, eos_bias: bool = False, seed: int = 0) -> Path:
    """Write a random-weight `family` model, with the repository files from `code_dir`, into `out_dir`."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    source = Path(code_dir) / FAMILIES[family]
    if not (source / MODELING_FILES[family]).is_file():
        raise FileNotFoundError(f"{source} lacks {MODELING_FILES[family]}: put the {family} repository's files there")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and "index.json" not in path.name:
            shutil.copy(path, out / path.name)
    if (source / "config.json").is_file():
        config = json.loads((source / "config.json").read_text())
    elif family == "minicpm-v":
        config = copy.deepcopy(MINICPM_V_2_6_CONFIG)
    else:
        raise FileNotFoundError(f"{source} lacks config.json: put the {family} repository's files there")
    if family == "minicpm-v":
        _give_torch_functional_list()
    auto_class = SHRINK[family](config, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))

    torch.manual_seed(seed)
    model_config = transformers.AutoConfig.from_pretrained(out, trust_remote_code=True)
    model = getattr(transformers, auto_class).from_config(
        model_config, trust_remote_code=True, torch_dtype=torch.float32, attn_implementation="eager"
    )
    if eos_bias:
        tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        _favour_eos(model, end_token_id(family, tokenizer))
    else:
        _make_sensitive(model)
    # Phi-3-vision's image embedding shares the token embedding, which safetensors refuses to store twice.
    model.save_pretrained(out, safe_serialization=family != "phi3-vision")
    # The repository's own config (its attention choice too, e.g. Phi-3-vision's flash_attention_2)
    # and generation config, not the ones save_pretrained derives from the loaded model.
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (source / "generation_config.json").is_file():
        shutil.copy(source / "generation_config.json", out / "generation_config.json")
    return out


def _give_torch_functional_list() -> None:
    """MiniCPM-V's resampler.py takes `List` from `from torch.nn.functional import *`, which torch >= 2.7
    no longer exports; the worker gives it back the same way (MiniCPMVAdapter.load). Builds run in their
    own process (see tests/test_remote_code_real.py), so this does not hide the worker's own fix."""
    import typing

    import torch.nn.functional

    if not hasattr(torch.nn.functional, "List"):
        torch.nn.functional.List = typing.List  # noqa: UP006


def end_token_id(family: str, tokenizer) -> int:
    """The token each card's recipe stops at: InternVL2's template separator, the tokenizer's end otherwise."""
    if family == "internvl2":
        return tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.eos_token_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("code_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--eos-bias", action="store_true", help="make greedy decoding stop at once")
    args = parser.parse_args()
    print(build(args.family, args.code_dir, args.out_dir, eos_bias=args.eos_bias))


if __name__ == "__main__":
    main()
