"""Boxes in each family's own words and coordinates -> boxes in the original image's pixels."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
from typing import TYPE_CHECKING, Optional

from runpod_vlm.vocabulary import Generation, GenerationRequest

if TYPE_CHECKING:
    from runpod_vlm.families.base import FamilyAdapter


# Each family answers boxes in its own words and its own coordinates (`FamilyAdapter.grounding`):
#   qwen-1000        Qwen2-VL: <|object_ref_start|>dog<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>;
#                    Qwen3-VL: [{"bbox_2d": [x1, y1, x2, y2], "label": "dog"}]; both relative, 0-1000
#   qwen-abs-pixels  Qwen2.5-VL: the same JSON, in pixels of the resized model input
#   paligemma-1024   PaliGemma: <loc{y1}><loc{x1}><loc{y2}><loc{x2}> dog ; ...  (bins of 1024)
#   glm-1000         GLM-4.1V: <|begin_of_box|>[[x1,y1,x2,y2], ...]<|end_of_box|>, any brackets; relative, 0-1000

_NUMBER = r"-?\d+(?:\.\d+)?"
_QUARTET = rf"({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})"
_QWEN_BOX = re.compile(
    r"(?:<\|object_ref_start\|>(.*?)<\|object_ref_end\|>\s*)?"
    r"<\|box_start\|>(.*?)(?:<\|box_end\|>|$)",
    re.S,
)
_GLM_BOXES = re.compile(r"<\|begin_of_box\|>(.*?)(?:<\|end_of_box\|>|$)", re.S)
_THINKING = re.compile(r"<think>.*?(?:</think>|$)", re.S)  # a reasoning model's thoughts: not its answer
_LOC_BOX = re.compile(r"<loc(\d{4})><loc(\d{4})><loc(\d{4})><loc(\d{4})>\s*([^;<]*)")
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")  # flat objects: found one by one, even in a cut-off answer
_JSON_BOX = re.compile(rf'"(?:bbox_2d|bbox|box_2d)"\s*:\s*\[\s*{_QUARTET}\s*\]')
_JSON_LABEL = re.compile(r'"label"\s*:\s*"((?:[^"\\]|\\.)*)"')
_POINT_PAIR = re.compile(rf"\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)\s*,?\s*\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)")
_LIST_BOX = re.compile(rf"\[\s*{_QUARTET}\s*\]")


def _ordered(values) -> list[float]:
    x1, y1, x2, y2 = (float(v) for v in values)
    return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]


def _json_label(obj: str) -> Optional[str]:
    written = next(iter(_JSON_LABEL.findall(obj)), "")
    with contextlib.suppress(ValueError):  # an escape JSON does not know: keep the label as written
        return json.loads(f'"{written}"') or None
    return written


def parse_boxes(text: Optional[str]) -> list[tuple[list[float], Optional[str]]]:
    """Every (box, label or None) in an answer, boxes as [x1, y1, x2, y2] in the model's coordinates.
    The first format found wins, in the order below; last, a single plain quartet of numbers."""
    text, boxes, label = _THINKING.sub("", text or ""), [], None
    for match in _QWEN_BOX.finditer(text):  # a label holds for the boxes after it
        label = match.group(1).strip() if match.group(1) is not None else label
        numbers = re.findall(_NUMBER, match.group(2))
        if len(numbers) == 4:
            boxes.append((_ordered(numbers), label or None))
    boxed = [re.findall(_NUMBER, inside) for inside in _GLM_BOXES.findall(text)]  # four numbers a box, any brackets
    boxes = boxes or [(_ordered(numbers[i : i + 4]), None) for numbers in boxed for i in range(0, len(numbers) - 3, 4)]
    boxes = boxes or [
        (_ordered([x1, y1, x2, y2]), name.strip() or None) for y1, x1, y2, x2, name in _LOC_BOX.findall(text)
    ]
    boxes = boxes or [
        (_ordered(box.groups()), _json_label(obj))
        for obj in _JSON_OBJECT.findall(text)
        if (box := _JSON_BOX.search(obj))
    ]
    for pattern in (_POINT_PAIR, _LIST_BOX):
        boxes = boxes or [(_ordered(numbers), None) for numbers in pattern.findall(text)]
    return boxes or [(_ordered(numbers), None) for numbers in re.findall(_QUARTET, text)[:1]]


def parse_bbox(text: Optional[str]) -> Optional[list[float]]:
    """The first box in a model's answer, as [x1, y1, x2, y2] in the model's own coordinates."""
    return next((box for box, _ in parse_boxes(text)), None)


def box_to_pixels(
    box: list[float], system: Optional[str], size: tuple[int, int], input_size: Optional[tuple[int, int]] = None
) -> list[int]:
    """Scale a box from the model's coordinate system to the original image's pixels, clamped."""
    frame = {
        "qwen-1000": (1000, 1000),
        "glm-1000": (1000, 1000),
        "paligemma-1024": (1024, 1024),
        "qwen-abs-pixels": input_size,
    }.get(system)
    frame_width, frame_height = frame or ((1, 1) if max(box) <= 1.0 else size)  # no frame: normalised or pixels
    scales, limits = (size[0] / frame_width, size[1] / frame_height) * 2, tuple(size) * 2
    return [int(round(min(max(v * scale, 0), limit))) for v, scale, limit in zip(box, scales, limits)]


def grounding_fields(item: GenerationRequest, generation: Generation, adapter: FamilyAdapter) -> dict:
    """Every box in the first image's pixels with its label, the first as `bbox`; drawn on request."""
    if adapter.grounding is None:
        return {
            "bbox": None,
            "supports_grounding": False,
            "bbox_warning": f"the {adapter.name} family has no grounding output; see response",
        }
    image, input_size = item.images[0], generation.image_input_size
    boxes = [
        {"bbox": box_to_pixels(box, adapter.grounding, image.size, input_size), "label": label}
        for box, label in parse_boxes(generation.raw_text or generation.text)
    ]
    fields = {
        "bbox": boxes[0]["bbox"] if boxes else None,
        "supports_grounding": True,
        "box_format": adapter.grounding,
        "image_size": list(image.size),
        "boxes": boxes,
        # supervision's names: the original size, and the resized input Qwen2.5-VL's pixels are in (else null)
        "resolution_wh": list(image.size),
        "input_wh": list(input_size) if input_size else None,
    }
    if not boxes:
        fields["bbox_warning"] = "no bounding box found in the model's answer"
    if item.annotate:
        fields["annotated_image"] = annotated_image(image, boxes)
    return fields


def annotated_image(image, boxes: list[dict]) -> str:
    """The image with each box outlined and labelled, as a PNG data URI."""
    from PIL import ImageDraw

    canvas = image.convert("RGB")  # a copy: the request's image stays as it was
    draw = ImageDraw.Draw(canvas)
    line = max(2, round(min(canvas.size) / 200))
    colours = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45")
    for box, colour in zip(boxes, colours * len(boxes)):  # the colours in turn
        draw.rectangle(box["bbox"], outline=colour, width=line)
        if box["label"]:
            corner = (box["bbox"][0] + line, box["bbox"][1] + line)
            left, top, right, bottom = draw.textbbox(corner, box["label"])
            draw.rectangle((left - line, top - line, right + line, bottom + line), fill=colour)
            draw.text(corner, box["label"], fill="white")
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
