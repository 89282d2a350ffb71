"""Each family's tiny model: its config, model class, processor and generation token ids (`tiny_models.build`)."""

from __future__ import annotations

from tools.tiny_families.gemma import gemma3_parts, paligemma_parts
from tools.tiny_families.glm_phi import glm4v_parts, phi4_multimodal_parts
from tools.tiny_families.idefics import internvl_parts, smolvlm_parts
from tools.tiny_families.llama import llama4_parts, mistral3_parts
from tools.tiny_families.llava import llava_onevision_parts, llava_parts
from tools.tiny_families.qwen import qwen2_parts, qwen3_parts

PARTS = {
    "qwen2-vl": qwen2_parts,
    "qwen2.5-vl": qwen2_parts,
    "llava": llava_parts,
    "llava-next": llava_parts,
    "qwen3-vl": qwen3_parts,
    "gemma3": gemma3_parts,
    "llava-onevision": llava_onevision_parts,
    "paligemma": paligemma_parts,
    "smolvlm": smolvlm_parts,
    "internvl-hf": internvl_parts,
    "mistral3": mistral3_parts,
    "llama4": llama4_parts,
    "glm4v": glm4v_parts,
    "phi4-multimodal": phi4_multimodal_parts,
}
