"""Native families (no remote code) whose cards differ from the generic recipe."""

from __future__ import annotations

import contextlib
import copy
import logging
import os

from runpod_vlm.families.base import FamilyAdapter, text_of
from runpod_vlm.frames import decode_frames, sampled_frames
from runpod_vlm.settings import Settings
from runpod_vlm.vocabulary import GenerationRequest, RequestError, Turn, join_param

log = logging.getLogger("runpod-vlm")


class QwenVLAdapter(FamilyAdapter):
    """Qwen2-VL, and (FAMILIES) Qwen2.5-VL and Qwen3-VL with their own grounding."""

    stacks_images = True
    prefix_caching = True
    packed_vision = True

    name, grounding, grounding_template = "qwen2-vl", "qwen-1000", "Find <|object_ref_start|>{}<|object_ref_end|>"
    skip_modules = ("model.visual", "lm_head")

    def processor_kwargs(self, settings: Settings) -> dict:
        return {k: v for k, v in {"min_pixels": settings.min_pixels, "max_pixels": settings.max_pixels}.items() if v}

    def bounded(self, processor, image, max_pixels: int):
        """Resized as the processor itself resizes under `max_pixels` (its smart_resize, within its own bounds),
        so the image gets exactly the visual tokens the processor would give it with that bound."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        images = processor.image_processor
        factor = images.patch_size * images.merge_size
        low = getattr(images, "min_pixels", None) or images.size["shortest_edge"]
        high = min(max_pixels, getattr(images, "max_pixels", None) or images.size["longest_edge"])
        height, width = smart_resize(image.height, image.width, factor, min_pixels=low, max_pixels=max(high, low))
        return image if (width, height) == image.size else image.resize((width, height), Image.Resampling.BICUBIC)

    def images_finish_on_gpu(self, processor) -> bool:
        backend = type(getattr(processor, "image_processor", None)).__mro__  # transformers' torchvision-backed ones
        return any(c.__name__ == "TorchvisionBackend" for c in backend)

    def host_resized(self, processor, image):
        """On the host, as the processor does it first (its image, as a tensor, resized by its own smart resize): given
        that, its resize on the GPU does nothing, and the pixels are the host's."""
        from transformers.image_utils import SizeDict

        images = processor.image_processor
        tensor = images.process_image(image, do_convert_rgb=images.do_convert_rgb)
        size = images.size if isinstance(images.size, SizeDict) else SizeDict(**images.size)
        return images.resize(tensor, size=size, resample=images.resample, factor=images.patch_size * images.merge_size)

    def _image_encoding_model(self, model):
        """Qwen2-VL's and Qwen2.5-VL's inner model, whose `get_image_features` returns one embedding per image
        (Qwen3-VL's returns its deepstack features too); None for the others."""
        language = getattr(model, "model", None)
        ours = self.model_type in ("qwen2_vl", "qwen2_5_vl") and hasattr(language, "get_image_features")
        return language if ours else None

    def images_one_at_a_time(self, model):
        """Each image is encoded on its own (attention within an image): image by image, joined in order."""
        language = self._image_encoding_model(model)
        return None if language is None else _image_by_image(language)

    def cached_images(self, model, cache, keys: list):
        """The vision pass answers from `cache` where it can."""
        language = self._image_encoding_model(model)
        return None if language is None else _cached(language, cache, keys)

    def recalled_images_processor(self, processor, grids: list):
        """A copy of `processor` whose image processor only hands back `grids` (as it gave them to those images
        before) and zero pixels of their shape, for images whose encodings the forward takes from the cache."""
        if self.model_type not in ("qwen2_vl", "qwen2_5_vl"):  # as _image_encoding_model
            return None
        recalled = copy.copy(processor)
        recalled.image_processor = _RecalledImages(processor.image_processor, grids)
        return recalled

    def takes_video(self, model_type) -> bool:
        return model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

    def decode_videos(self, processor, item: GenerationRequest) -> None:
        for video in item.videos:
            decode_frames(video, sampled_frames(video.total, video.fps, video.limits.max_frames))

    def video_inputs(self, processor, items: list[GenerationRequest]) -> dict:
        """As the cards' qwen-vl-utils prepares videos: each one's sampled frames resized as it resizes a
        decoded video and, for Qwen2.5-VL and Qwen3-VL, where they were sampled (their temporal positions,
        and Qwen3-VL's timestamps, follow it: the cards' video_kwargs and video_metadata)."""
        videos = [video for item in items for video in item.videos]
        for item in items:
            self.decode_videos(processor, item)
        patch = processor.video_processor.patch_size
        kwargs: dict = {"videos": [_card_resized(video, patch) for video in videos], "do_sample_frames": False}
        if self.model_type in ("qwen2_5_vl", "qwen3_vl"):
            kwargs["video_metadata"] = [
                {"fps": video.fps, "frames_indices": video.indices, "total_num_frames": video.total} for video in videos
            ]
        if self.model_type == "qwen3_vl":  # its card's do_resize=False: the frames are already resized
            kwargs["videos_kwargs"] = {"do_resize": False}
        return kwargs

    def input_sizes(self, processor, inputs, items: list[GenerationRequest]) -> list:
        """Per item, (width, height) of its first image as resized: Qwen2.5-VL's boxes are in its pixels."""
        if "image_grid_thw" not in inputs:
            return [None] * len(items)
        patch = processor.image_processor.patch_size
        grids = iter(inputs["image_grid_thw"].tolist())  # (frames, rows, columns) per image, in order
        firsts = [[next(grids) for _ in item.images][:1] for item in items]
        return [(first[0][2] * patch, first[0][1] * patch) if first else None for first in firsts]


class _RecalledImages:
    """Stands in for a Qwen image processor (every other attribute is the real one's): the grids the real one gave
    the images, and rows of zeros where their pixels' patches would be (never encoded)."""

    def __init__(self, real, grids: list):
        self.real, self.grids = real, grids

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def fetch_images(self, images):
        return images

    def __call__(self, images, **kwargs):
        import torch
        from transformers.feature_extraction_utils import BatchFeature

        grid = torch.tensor(self.grids, dtype=torch.long)
        width = 3 * self.real.temporal_patch_size * self.real.patch_size**2  # a patch's RGB values
        pixels = torch.zeros(1, width).expand(int(grid.prod(-1).sum()), width)  # one row, never copied whole
        return BatchFeature({"pixel_values": pixels, "image_grid_thw": grid})


def _card_resized(video, patch_size: int):
    """Frames [T, C, H, W] resized as qwen-vl-utils' fetch_video resizes a video it decoded (its path for a
    list of frames resizes each as an image first, which a file's frames do not go through)."""
    import numpy as np
    import torch
    from qwen_vl_utils import vision_process as qwen
    from torchvision.transforms import InterpolationMode, functional

    frames = torch.stack([torch.from_numpy(np.asarray(frame).transpose(2, 0, 1).copy()) for frame in video.frames])
    factor = patch_size * qwen.SPATIAL_MERGE_SIZE
    low = qwen.VIDEO_MIN_TOKEN_NUM * factor * factor
    total = qwen.MODEL_SEQ_LEN * factor * factor * 0.9
    high = min(qwen.VIDEO_MAX_TOKEN_NUM * factor * factor, total / len(frames) * qwen.FRAME_FACTOR)
    high = max(high, int(low * 1.05))
    height, width = qwen.smart_resize(frames.shape[2], frames.shape[3], factor=factor, min_pixels=low, max_pixels=high)
    return functional.resize(frames, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True).float()


@contextlib.contextmanager
def _patched(module, name: str, replacement):
    """`module.name` is `replacement(the current one)` while inside; what it was after."""
    before = vars(module).get(name)
    setattr(module, name, replacement(getattr(module, name)))
    try:
        yield
    finally:
        if before is None:
            delattr(module, name)  # the class's own again
        else:
            setattr(module, name, before)


def _image_by_image(model):
    """`model.get_image_features(pixel_values, image_grid_thw)` called once per image while inside."""

    def one_at_a_time(whole):
        def features(pixel_values, image_grid_thw=None, **kwargs):
            patches = image_grid_thw.prod(-1).tolist()  # each image's rows of pixel_values
            outputs = [
                whole(pixels, grid[None], **kwargs) for pixels, grid in zip(pixel_values.split(patches), image_grid_thw)
            ]
            joined = outputs[0]
            joined.pooler_output = tuple(embeds for output in outputs for embeds in output.pooler_output)
            return joined

        return features

    return _patched(model, "get_image_features", one_at_a_time)


def _cached(model, cache, keys: list):
    """`model.get_image_features` for a forward whose images have `keys` (in order): each image found in
    `cache` skips the vision encoder, the others are encoded together and kept."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    def from_cache(whole):
        def features(pixel_values, image_grid_thw=None, **kwargs):
            patches = image_grid_thw.prod(-1).tolist()
            if len(patches) != len(keys):  # not this forward's images
                return whole(pixel_values, image_grid_thw, **kwargs)
            found = {key: cache.get(key) for key in dict.fromkeys(keys)}  # (embeddings, grid) entries
            missing = [key for key, entry in found.items() if entry is None]
            if missing:
                import torch

                first = [keys.index(key) for key in missing]  # one encoding per distinct image
                pieces = pixel_values.split(patches)
                grids = image_grid_thw[first]
                encoded = whole(torch.cat([pieces[n] for n in first]), grids, **kwargs)
                for key, embeds, grid in zip(missing, encoded.pooler_output, grids.tolist()):
                    found[key] = (embeds.clone(), tuple(grid))  # not a view that would keep the whole batch's output
                    cache.put(key, found[key])
            return BaseModelOutputWithPooling(pooler_output=tuple(found[key][0] for key in keys))

        return features

    return _patched(model, "get_image_features", from_cache)


class PaliGemmaAdapter(FamilyAdapter):
    """PaliGemma (2, mix): no chat template; one image and a task prefix per prompt, detection in <loc> tokens."""

    name, grounding, grounding_template = "paligemma", "paligemma-1024", "detect {}"
    skip_modules = ("model.vision_tower", "model.multi_modal_projector", "lm_head")
    generated_token_types = {"token_type_ids": 1}  # the suffix, attending causally; 0 is the prefix, both ways

    def task_prefix(self, item: GenerationRequest) -> str:
        """The card's prompt for the item; a chat is one user turn whose text is the prefix."""
        if len(item.images) > 1:
            raise RequestError(
                "invalid_request",
                "the paligemma family takes one image per request",
                join_param(item.param, "messages" if item.task == "chat" else "images"),
            )
        text = text_of(item.turns[-1]).strip()
        prefix = {
            "caption": "caption en",
            "caption_long": "describe en",
            "vqa": f"answer en {text}",
            "grounding": self.grounding_template.format(item.grounding_target),
        }.get(item.task)
        if prefix is None and (len(item.turns) != 1 or item.turns[0].role != "user"):
            raise RequestError(
                "invalid_request",
                "the paligemma family takes one user message (a task prefix such "
                "as 'caption en', 'answer en <question>' or 'detect <object>'), no system or "
                "assistant turns",
                join_param(item.param, "messages"),
            )
        return prefix or text

    def batch_inputs(self, processor, items, device, dtype, image_device=None):
        from PIL import Image

        # The model always reads an image: a text-only row (a chat, the engine's padding row) gets a black one.
        images = [item.images or [Image.new("RGB", (1, 1))] for item in items]
        texts = [self.task_prefix(item) for item in items]
        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt").to(device)
        inputs.pop("labels", None)  # the processor's training labels: not a generation input
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        return inputs, [None] * len(items)


class Phi4MultimodalAdapter(FamilyAdapter):
    """microsoft/Phi-4-multimodal-instruct (transformers format; images, not audio), prompted as transformers' tests."""

    name, model_class = "phi4-multimodal", "AutoModelForCausalLM"
    skip_modules = ("model.embed_tokens_extend.image_embed", "lm_head")
    # Batched beside a two-image request, a one-image request's image tokens took other embeddings than alone (512
    # of its 562 differed, by up to 11.8, on the tiny model), which changed its answer (tests/test_families.py).
    prefills_alone = True

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        return [
            {"role": turn.role, "content": "".join(p if isinstance(p, str) else "<|image|>" for p in turn.parts)}
            for turn in turns
        ]

    def after_load(self, model, processor, source: str) -> None:
        """As the card: the processor's chat template (5.17 puts it on the tokenizer only), the vision LoRA set."""
        processor.chat_template = processor.chat_template or processor.tokenizer.chat_template
        folder = os.path.join(source, "vision-lora")  # by path: 5.17's load_adapter skips `subfolder` in a folder
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            log.warning("%s has no vision-lora adapter: Phi-4-multimodal answers with its base weights", source)
            return
        model.load_adapter(folder, adapter_name="vision")
        model.set_adapter("vision")
