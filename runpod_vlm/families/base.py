"""The model cards' generic recipe for prompting a family, and what it needs of a loaded model."""

from __future__ import annotations

import functools
import re
from typing import Optional

from runpod_vlm.frames import decode_frames
from runpod_vlm.settings import Settings, SettingsError
from runpod_vlm.vocabulary import GenerationRequest, Turn, Video


def to_without_copying_repeats(value, *args, **kwargs):
    """`value.to(*args, **kwargs)`; a tensor that is one row repeated (stride 0: the zero pixels standing in for
    cached images) converts or moves that row once and stays repeated."""
    if value.ndim > 0 and value.stride(0) == 0 and value.shape[0] > 1:
        return value[:1].to(*args, **kwargs).expand(value.shape)
    return value.to(*args, **kwargs)


class FamilyAdapter:
    """The model cards' generic recipe for prompting a family; a FAMILIES row or a subclass adjusts it."""

    native = True  # loads with AutoProcessor and `model_class`, no remote code
    name, model_class = "generic", "AutoModelForImageTextToText"  # names in transformers
    grounding: Optional[str] = None  # coordinate system of its boxes (see "parsing boxes"), or None
    grounding_template = "Locate {} in the image and give its bounding box as [x1, y1, x2, y2]."
    skip_modules: Optional[tuple[str, ...]] = None  # kept out of quantization; None: found by model type
    # Whether the processor batches images by concatenating each item's in order (checked per family in
    # tests/test_paged_engine.py): then items prepared alone stack into a batch. Idefics3 lays them out per item.
    stacks_images = False
    # Video as the card samples it, by the video processor's own `sample_frames` with these arguments
    # (none: the processor's configured ones); None: the family takes no video here.
    video_sampling: Optional[dict] = None
    # Whether a prompt's KV blocks may serve another prompt that starts with the same tokens: only where a
    # token's keys depend on the tokens before it alone (causal attention, images included; not PaliGemma's
    # prefix-LM nor Gemma 3's attention both ways within an image, which a chunk boundary would cut).
    prefix_caching = False
    # Whether the vision tower packs its images into one sequence marked by `cu_seqlens` (Qwen-style): then it
    # attends through engine.vision_attention's one variable-length call per layer.
    packed_vision = False
    # Whether its prompts prefill one at a time (decoding together): its own batched forward gives a prompt other
    # values than alone (Phi-4-multimodal's image embedding beside another request's images).
    prefills_alone = False
    # What a generated token is in the processor's per-token tensors other than the ids and the mask (0, text,
    # where not named): a preempted request's prompt is prefilled again followed by the tokens it had.
    generated_token_types: dict = {}

    def __init__(self, model_type: Optional[str] = None, **family):
        self.model_type = model_type
        vars(self).update(family)  # a FAMILIES row's changes to the class's defaults

    @property
    def quantization_skip_modules(self) -> tuple[str, ...]:
        """Modules bitsandbytes leaves in full precision: the vision tower and projector, and lm_head."""
        if self.skip_modules is None and self.model_type is not None:
            return unquantized_module_names(self.model_type, self.model_class)
        return self.skip_modules or ()

    def processor_kwargs(self, settings: Settings) -> dict:
        return {}

    def images_one_at_a_time(self, model):
        """A context in which the model's vision pass encodes one image at a time (the same embeddings in
        less memory), or None where the family has no such split: a prompt whose images at once ran out of
        memory is tried once more inside it."""
        return None

    def cached_images(self, model, cache, keys: list):
        """A context in which the model's vision pass takes the embeddings of images already in `cache` (an
        ImageEmbeddingCache) and keeps the others', for a forward whose images have `keys`; None where
        the family has none."""
        return None

    def recalled_images_processor(self, processor, grids: list):
        """A processor for an item whose images' encodings all come from the embedding cache, that skips their
        pixels and gives them `grids` (each as the cache entry holds it); None where the family has none."""
        return None

    def after_load(self, model, processor, source: str) -> None:
        """What the card does to the loaded model and processor before they answer (Phi-4-multimodal)."""

    def request_turns(self, item: GenerationRequest) -> list[Turn]:
        """The item's turns; a grounding request's last turn ends with the family's grounding prompt."""
        if item.task != "grounding":
            return item.turns
        *before, last = item.turns
        return [*before, Turn(last.role, [*last.parts, self.grounding_template.format(item.grounding_target)])]

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        """Turns as processors' chat templates take them: images become {"type": "image"}, videos {"type": "video"}."""

        def block(part) -> dict:
            if isinstance(part, str):
                return {"type": "text", "text": part}
            return {"type": "video" if isinstance(part, Video) else "image"}

        return [self.chat_message(turn, [block(p) for p in turn.parts]) for turn in turns]

    @staticmethod
    def chat_message(turn: Turn, content: list) -> dict:
        """A turn as chat templates take it: a tool's answer and an assistant's calls as the templates that take
        tools read them (text content, `tool_call_id`; `tool_calls` with each call's arguments an object)."""
        if turn.role == "tool":
            return {"role": "tool", "tool_call_id": turn.tool_call_id, "content": "".join(turn.parts)}
        if turn.tool_calls:
            calls = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in turn.tool_calls
            ]
            return {
                "role": turn.role,
                "content": "".join(p for p in turn.parts if isinstance(p, str)),
                "tool_calls": calls,
            }
        return {"role": turn.role, "content": content}

    def tool_template(self, processor) -> Optional[str]:
        """The chat template that renders function tools: the processor's when it takes `tools`, else its
        tokenizer's (vLLM chooses so too: a VLM's processor template often has no tools, its tokenizer's has);
        None when neither does (the family refuses tools)."""
        for owner in (processor, getattr(processor, "tokenizer", None)):
            template = getattr(owner, "chat_template", None)
            if isinstance(template, str) and re.search(r"\btools\b", template):
                return template
        return None

    def prompt(self, processor, item: GenerationRequest) -> str:
        """The item's prompt text, by the family's chat template (the one that takes its tools, when it has any)."""
        messages = self.chat_messages(self.request_turns(item))
        if item.tool_use is None:
            return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return processor.apply_chat_template(
            messages,
            tools=item.tool_use.tools,
            chat_template=self.tool_template(processor),
            tokenize=False,
            add_generation_prompt=True,
        )

    def takes_video(self, model_type: Optional[str]) -> bool:
        """Whether this family's card feeds videos to its processor, as `video_inputs` does here."""
        return self.video_sampling is not None

    def video_inputs(self, processor, items: list[GenerationRequest]) -> dict:
        """The processor's video arguments for the items' videos (a list per item), prepared as the card's
        `apply_chat_template` prepares a video file: the video processor picks the frames from the video's
        metadata, only those are decoded, and they go in with that metadata (SmolVLM2 writes each frame's
        timestamp in the prompt)."""
        import numpy as np

        videos, metadata = [], []
        for item in items:
            videos.append([])
            for video in item.videos:
                about = self._sampled(processor, video)
                frames = decode_frames(video, about.frames_indices)
                videos[-1].append(np.stack([np.asarray(frame) for frame in frames]))
                metadata.append(about)
        return {"videos": videos, "video_metadata": metadata, "do_sample_frames": False}

    def decode_videos(self, processor, item: GenerationRequest) -> None:
        """Decode the frames the card samples from each of the item's videos (kept on each Video for
        `video_inputs`): the slow part of a video's preparation, done before the processor call."""
        for video in item.videos if self.video_sampling is not None else ():
            decode_frames(video, self._sampled(processor, video).frames_indices)

    def _sampled(self, processor, video):
        """The video's metadata as the video processor reads it, with the frames it samples (`frames_indices`)."""
        from transformers.video_utils import VideoMetadata

        sampler, cap = processor.video_processor, video.limits.max_frames
        kwargs = dict(self.video_sampling)
        kwargs["num_frames"] = min(kwargs.get("num_frames") or getattr(sampler, "num_frames", None) or cap, cap)
        about = VideoMetadata(
            total_num_frames=video.total, fps=video.fps, duration=video.seconds,
            width=video.width, height=video.height, video_backend="pyav",
        )  # fmt: skip
        about.frames_indices = [int(i) for i in sampler.sample_frames(about, **kwargs)]
        return about

    def batch_inputs(self, processor, items: list[GenerationRequest], device, dtype, image_device=None):
        """Left-padded prompts and pixels on `device`, and per item its first image's input size (or None).
        `image_device`: where the images are rescaled, normalized and cut into patches after `host_resized`, where
        `images_finish_on_gpu` (the rest stays on the host); its pixels stay there."""
        prompts = [self.prompt(processor, item) for item in items]
        kwargs: dict = {"text": prompts, "padding": True, "return_tensors": "pt"}
        if any(item.images for item in items):
            kwargs["images"] = [self.bounded_images(processor, item) for item in items]
            if image_device is not None and self.images_finish_on_gpu(processor):
                resized = [[self.host_resized(processor, image) for image in images] for images in kwargs["images"]]
                kwargs["images"], kwargs["device"] = resized, image_device
        if any(item.videos for item in items):
            kwargs.update(self.video_inputs(processor, items))
        bos = getattr(processor.tokenizer, "bos_token", None)  # a template that writes BOS gets no second one
        if isinstance(bos, str) and prompts[0].startswith(bos):
            kwargs["add_special_tokens"] = False
        inputs = processor(**kwargs)
        if "device" not in kwargs:  # else the pixels stay on the image device, the rest on the host
            inputs = inputs.to(device)
        for name in ("pixel_values", "pixel_values_videos"):
            if name in inputs:
                inputs[name] = to_without_copying_repeats(inputs[name], dtype)
        return inputs, self.input_sizes(processor, inputs, items)

    def collate(self, processor, parts: list):
        """One left-padded batch of items each prepared alone (`batch_inputs` of one item): per-token tensors
        padded on the left (input_ids with the pad token, the rest with 0), the others concatenated in
        order, as the processor batches them; None when they do not stack (images padded across a batch, as
        Pixtral's of different sizes): then the group is prepared together."""
        import torch

        if not self.stacks_images:
            return None
        width = max(part["input_ids"].shape[1] for part in parts)
        pad = processor.tokenizer.pad_token_id or 0
        batch = {}
        for name in dict.fromkeys(name for part in parts for name in part.keys()):
            present = [part for part in parts if name in part]
            values = [part[name] for part in present]
            if not all(hasattr(value, "shape") for value in values):
                return None
            if all(tuple(v.shape) == tuple(part["input_ids"].shape) for v, part in zip(values, present)):
                if len(present) < len(parts):
                    return None
                fill = pad if name == "input_ids" else 0
                values = [
                    torch.cat([torch.tensor([[fill] * (width - v.shape[1])], dtype=v.dtype, device=v.device), v], dim=1)
                    if v.shape[1] < width
                    else v
                    for v in values
                ]
            elif len({tuple(v.shape[1:]) for v in values}) > 1:
                return None
            batch[name] = torch.cat(values, dim=0)
        return type(parts[0])(batch)

    def bounded_images(self, processor, item: GenerationRequest) -> list:
        """The item's images, each with a request's pixel bound (max_pixels, detail low) scaled down to it."""
        bounds = item.image_max_pixels or [None] * len(item.images)
        return [
            image if bound is None else self.bounded(processor, image, bound)
            for image, bound in zip(item.images, bounds)
        ]

    def bounded(self, processor, image, max_pixels: int):
        """Scaled down, aspect kept, to at most `max_pixels` (a processor of fixed resolution then resizes it)."""
        from PIL import Image

        scale = (max_pixels / (image.width * image.height)) ** 0.5
        if scale >= 1:
            return image
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        return image.resize(size, Image.Resampling.BICUBIC)

    def input_sizes(self, processor, inputs, items: list[GenerationRequest]) -> list:
        return [None] * len(items)

    def images_finish_on_gpu(self, processor) -> bool:
        """Whether `batch_inputs` given an `image_device` processes the images there: where the family can resize them
        on the host as `processor` would (`host_resized`; a GPU's resize rounds differently) and `processor` then runs
        on a GPU."""
        return False


def text_of(turn: Turn) -> str:
    return " ".join(p for p in turn.parts if isinstance(p, str))


def token_ids(value) -> list[int]:
    """A config's token id field (an int, a list of ints or None) as a list."""
    return [value] if isinstance(value, int) else [v for v in value or () if isinstance(v, int)]


def end_tokens(model, tokenizer) -> set:
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set(token_ids(config_eos)) | set(token_ids(getattr(tokenizer, "eos_token_id", None)))


@functools.cache
def unquantized_module_names(model_type: str, model_class: str = "AutoModelForImageTextToText") -> tuple[str, ...]:
    """The outermost vision or projector modules, then the output head, of the type's default model on meta."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            model = getattr(transformers, model_class).from_config(transformers.AutoConfig.for_model(model_type))
    except Exception as error:
        raise SettingsError(
            f"cannot find the vision modules of model type {model_type!r} to keep them out of "
            f"quantization ({error}); set VLM_QUANTIZE=none"
        ) from error
    words, names = ("vision", "visual", "projector", "connector", "resampler"), []
    for name, _ in model.named_modules():
        if any(w in name.rsplit(".", 1)[-1] for w in words) and not any(name.startswith(f"{n}.") for n in names):
            names.append(name)
    if not names:
        raise SettingsError(f"no vision module found in model type {model_type!r}; set VLM_QUANTIZE=none")
    head = model.get_output_embeddings()
    return (*names, *(name for name, module in model.named_modules() if module is head))
