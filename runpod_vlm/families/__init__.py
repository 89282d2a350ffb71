"""Which adapter serves a config's model_type, and how each family differs from the generic recipe."""

from __future__ import annotations

from runpod_vlm.families.base import FamilyAdapter
from runpod_vlm.families.native import PaliGemmaAdapter, Phi4MultimodalAdapter, QwenVLAdapter
from runpod_vlm.families.remote import InternVL2Adapter, MiniCPMVAdapter, Phi3VisionAdapter

QWEN_JSON_GROUNDING = "Locate {} in the image, and output its bbox coordinates in JSON format."
LLAVA_SKIPS = ("model.vision_tower", "model.multi_modal_projector", "lm_head")
SMOLVLM = {"name": "smolvlm", "skip_modules": ("model.vision_model", "model.connector", "lm_head")}  # Idefics3 too
SMOLVLM2 = {**SMOLVLM, "video_sampling": {}}  # its processor's config sets the card's fps and most frames
FAMILIES: dict[str, dict] = {  # model_type -> its adapter class and what it changes of the class's defaults
    "qwen2_vl": {"adapter": QwenVLAdapter},
    "qwen2_5_vl": {
        "adapter": QwenVLAdapter,
        "name": "qwen2.5-vl",
        "grounding": "qwen-abs-pixels",
        "grounding_template": QWEN_JSON_GROUNDING,
    },
    "qwen3_vl": {"adapter": QwenVLAdapter, "name": "qwen3-vl", "grounding_template": QWEN_JSON_GROUNDING},
    "paligemma": {"adapter": PaliGemmaAdapter},
    "phi4_multimodal": {"adapter": Phi4MultimodalAdapter},
    "minicpmv": {"adapter": MiniCPMVAdapter},
    "phi3_v": {"adapter": Phi3VisionAdapter},
    "internvl_chat": {"adapter": InternVL2Adapter},
    "llava": {"name": "llava", "skip_modules": LLAVA_SKIPS, "stacks_images": True, "prefix_caching": True},
    "llava_next": {"name": "llava-next", "skip_modules": LLAVA_SKIPS, "stacks_images": True, "prefix_caching": True},
    "idefics3": SMOLVLM,
    "smolvlm": SMOLVLM2,
    # Served as their cards do by the generic recipe (tests/test_families.py); skips read from their module trees.
    "gemma3": {"name": "gemma3", "stacks_images": True},
    "mistral3": {"name": "mistral3", "stacks_images": True},
    "llama4": {"name": "llama4", "stacks_images": True},
    # No prefix caching: it encodes an image at base resolution alone when its request holds several, so
    # an image's tokens in a cached block would depend on the images after it.
    "llava_onevision": {"name": "llava-onevision", "stacks_images": True, "video_sampling": {"num_frames": 8}},
    "internvl": {"name": "internvl-hf", "stacks_images": True},
    "glm4v": {
        "name": "glm-4.1v",
        "stacks_images": True,
        "packed_vision": True,
        "grounding": "glm-1000",  # the GLM-V repository's README
        "grounding_template": "Help me to locate {} in the image and give me its bounding boxes.",
    },
}


def adapter_for(model_type: str) -> FamilyAdapter:
    """The adapter of a config's model_type; other native model types get the generic adapter."""
    family = dict(FAMILIES.get(model_type, {}))
    return family.pop("adapter", FamilyAdapter)(model_type, **family)


ADAPTERS: dict[str, FamilyAdapter] = {adapter.name: adapter for adapter in map(adapter_for, FAMILIES)}
