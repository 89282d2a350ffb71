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

from tools.tiny_families import PARTS
from tools.tiny_families.glm_phi import save_vision_lora

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
SHAPES = ("tiny", "qwen2-vl-2b", "qwen2-vl-7b", "gemma3-4b", "phi4-multimodal-6b")


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
    if shape != "tiny" and family != shape.rsplit("-", 1)[0]:
        raise ValueError(f"shape {shape!r} is for the {shape.rsplit('-', 1)[0]} family")
    if vision_lora and family != "phi4-multimodal":
        raise ValueError("vision_lora is for the phi4-multimodal family")
    config, model_class, processor, token_ids = PARTS[family](family, shape)
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
    own_template = getattr(processor.tokenizer, "chat_template", None) if hasattr(processor, "tokenizer") else None
    processor.save_pretrained(out)
    if own_template is not None and own_template != processor.chat_template:
        save_as_hub_repos_do(out, processor.chat_template, own_template)
    if vision_lora:
        save_vision_lora(model, out / "vision-lora")
    return out


def save_as_hub_repos_do(out: Path, processor_template: str, tokenizer_template: str) -> None:
    """A processor and a tokenizer with chat templates of their own, laid out as the hub's Qwen2.5-VL repositories
    are (5.x would save one chat_template.jinja, which both read): the processor's in chat_template.json, the
    tokenizer's in tokenizer_config.json."""
    import json

    (out / "chat_template.jinja").unlink()
    (out / "chat_template.json").write_text(json.dumps({"chat_template": processor_template}))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": tokenizer_template}))


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
