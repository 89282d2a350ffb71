"""Grounding answers as each family writes them, parsed into every box with its label, in the
original image's pixels; and the annotated image. Pure functions: no model is loaded."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from runpod_vlm.families import ADAPTERS
from runpod_vlm.grounding import box_to_pixels, grounding_fields, parse_bbox, parse_boxes
from runpod_vlm.request import parse_request
from runpod_vlm.settings import Settings
from runpod_vlm.vocabulary import Generation, GenerationParams, GenerationRequest, RequestError, Turn
from tools.sample_images import data_uri

QWEN2_VL_TWO_DOGS = (
    "<|object_ref_start|>the dog<|object_ref_end|><|box_start|>(100,250),(500,750)<|box_end|> and "
    "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(600,100),(900,400)<|box_end|><|im_end|>"
)
QWEN25_VL_JSON = """```json
[
\t{"bbox_2d": [135, 114, 1016, 672], "label": "orange cat"},
\t{"bbox_2d": [12, 40, 120, 300], "label": "lamp \\"left\\""}
]
```"""


@pytest.mark.parametrize(
    "text, boxes",
    [
        (QWEN2_VL_TWO_DOGS, [([100, 250, 500, 750], "the dog"), ([600, 100, 900, 400], "the cat")]),
        # one reference, several instances: the label holds for the boxes after it
        (
            "<|object_ref_start|>cars<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>"
            "<|box_start|>(5,6),(7,8)<|box_end|>",
            [([1, 2, 3, 4], "cars"), ([5, 6, 7, 8], "cars")],
        ),
        ("<|box_start|>(300,400),(100,200)<|box_end|>", [([100, 200, 300, 400], None)]),
        (QWEN25_VL_JSON, [([135, 114, 1016, 672], "orange cat"), ([12, 40, 120, 300], 'lamp "left"')]),
        # Qwen3-VL, no fence, and an answer cut off by max_new_tokens after the first object
        ('[{"bbox_2d": [10, 20, 30, 40], "label": "a"}, {"bbox_2d": [50, 60, 7', [([10, 20, 30, 40], "a")]),
        ('{"label": "b", "bbox": [1, 2, 3, 4]}', [([1, 2, 3, 4], "b")]),
        # PaliGemma: y1 x1 y2 x2 in 1024 bins, objects separated by " ; "
        (
            "<loc0100><loc0200><loc0300><loc0400> dog ; <loc0000><loc0010><loc1023><loc0020> cat",
            [([200, 100, 400, 300], "dog"), ([10, 0, 20, 1023], "cat")],
        ),
        ("<loc0100><loc0200><loc0300><loc0400>", [([200, 100, 400, 300], None)]),
        # GLM-4.1V: boxes between <|begin_of_box|> and <|end_of_box|>, in any brackets; its thinking is ignored
        (
            "<think>first guess [1, 2, 3, 4]</think><answer><|begin_of_box|>[[100,200,300,400],[500,600,700,800]]"
            "<|end_of_box|></answer>",
            [([100, 200, 300, 400], None), ([500, 600, 700, 800], None)],
        ),
        (
            "<|begin_of_box|>(10, 20), (30, 40)<|end_of_box|> and <|begin_of_box|><5,6,7,8><|end_of_box|>",
            [([10, 20, 30, 40], None), ([5, 6, 7, 8], None)],
        ),
        ("<|begin_of_box|>[300, 400, 100, 200]", [([100, 200, 300, 400], None)]),  # cut off by max_new_tokens
        ("<|begin_of_box|>42<|end_of_box|> is near [1, 2, 3, 4]", [([1, 2, 3, 4], None)]),  # a boxed number, no box
        ("<think>the dog is at [1, 2, 3, 4] or", []),  # still thinking when cut off
        ("dog at [10, 20, 30, 40], cat at [50, 60, 70, 80]", [([10, 20, 30, 40], None), ([50, 60, 70, 80], None)]),
        ("(1, 2), (3, 4) and (5,6),(7,8)", [([1, 2, 3, 4], None), ([5, 6, 7, 8], None)]),
        ("box: 1, 2, 3, 4", [([1, 2, 3, 4], None)]),
        ("I see no dog.", []),
        (None, []),
    ],
)
def test_parse_boxes_reads_every_box_and_label(text, boxes):
    assert parse_boxes(text) == [(list(map(float, box)), label) for box, label in boxes]
    assert parse_bbox(text) == (boxes[0][0] if boxes else None)


def test_paligemma_bins_scale_to_the_image():
    assert box_to_pixels([0, 256, 512, 1024], "paligemma-1024", (200, 100)) == [0, 25, 100, 100]


def grounding_item(size=(640, 480), annotate=False):
    image = Image.new("RGB", size, "white")
    params = GenerationParams(max_new_tokens=64, temperature=0.0, top_p=1.0, do_sample=False)
    return GenerationRequest(
        "grounding", [Turn("user", [image])], params, grounding_target="the dog", annotate=annotate
    )


def test_qwen2_vl_fields_list_every_box_in_original_pixels():
    fields = grounding_fields(
        grounding_item(), Generation("", "stop", raw_text=QWEN2_VL_TWO_DOGS), ADAPTERS["qwen2-vl"]
    )
    assert fields["boxes"] == [
        {"bbox": [64, 120, 320, 360], "label": "the dog"},
        {"bbox": [384, 48, 576, 192], "label": "the cat"},
    ]
    assert fields["bbox"] == [64, 120, 320, 360]  # the first box, as before
    assert fields["box_format"] == "qwen-1000" and fields["image_size"] == [640, 480]
    assert "bbox_warning" not in fields and "annotated_image" not in fields


def test_qwen25_vl_boxes_scale_from_the_resized_input():
    # the 640x480 image went in as 1280x960: pixels of the input are halved
    generation = Generation("", "stop", raw_text=QWEN25_VL_JSON, image_input_size=(1280, 960))
    fields = grounding_fields(grounding_item(), generation, ADAPTERS["qwen2.5-vl"])
    assert [b["bbox"] for b in fields["boxes"]] == [[68, 57, 508, 336], [6, 20, 60, 150]]
    assert [b["label"] for b in fields["boxes"]] == ["orange cat", 'lamp "left"']
    assert fields["box_format"] == "qwen-abs-pixels"


def test_no_box_in_the_answer_gives_an_empty_list_and_a_warning():
    fields = grounding_fields(grounding_item(), Generation("no dog", "stop", raw_text="no dog"), ADAPTERS["qwen2-vl"])
    assert fields["boxes"] == [] and fields["bbox"] is None and fields["bbox_warning"]


def test_annotate_draws_every_box_on_a_copy_of_the_image():
    item = grounding_item(size=(200, 100), annotate=True)
    answer = "<|object_ref_start|>dog<|object_ref_end|><|box_start|>(100,100),(500,900)<|box_end|>"
    fields = grounding_fields(item, Generation("", "stop", raw_text=answer), ADAPTERS["qwen2-vl"])
    prefix = "data:image/png;base64,"
    assert fields["annotated_image"].startswith(prefix)
    drawn = Image.open(io.BytesIO(base64.b64decode(fields["annotated_image"][len(prefix) :])))
    assert drawn.format == "PNG" and drawn.size == (200, 100)
    x1, y1, x2, y2 = fields["bbox"]  # [20, 10, 100, 90]
    assert drawn.getpixel((x2 - 1, (y1 + y2) // 2)) != (255, 255, 255)  # the right edge is drawn
    assert drawn.getpixel((x1 + 1, y2 - 1)) != (255, 255, 255)  # the bottom-left corner
    assert drawn.getpixel(((x1 + x2) // 2 + 10, (y1 + y2) // 2 + 10)) == (255, 255, 255)  # inside: untouched
    assert drawn.getpixel((150, 50)) == (255, 255, 255)  # outside
    assert item.images[0].getpixel((x2 - 1, 50)) == (255, 255, 255)  # the request's image is untouched


def test_annotate_is_refused_outside_the_grounding_task():
    image = "data:image/png;base64," + base64.b64encode(_png(8, 8)).decode()
    with pytest.raises(RequestError) as error:
        parse_request({"task": "caption", "image_url": image, "annotate": True}, Settings())
    assert error.value.code == "invalid_request" and error.value.param == "annotate"
    _, item = parse_request({"task": "grounding", "image_url": image, "target": "x", "annotate": True}, Settings())
    assert item.annotate is True


def _png(width, height) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_label_with_a_broken_escape_is_kept_as_written():
    assert parse_boxes('{"bbox_2d": [1, 2, 3, 4], "label": "a\\x"}') == [([1.0, 2.0, 3.0, 4.0], "a\\x")]


def test_glm_boxes_are_relative_to_1000_of_the_original_image():
    answer = "<answer><|begin_of_box|>[[100, 250, 500, 750]]<|end_of_box|></answer>"
    fields = grounding_fields(grounding_item(), Generation("", "stop", raw_text=answer), ADAPTERS["glm-4.1v"])
    assert fields["boxes"] == [{"bbox": [64, 120, 320, 360], "label": None}]
    assert fields["box_format"] == "glm-1000" and fields["image_size"] == [640, 480]
    prompt = ADAPTERS["glm-4.1v"].request_turns(grounding_item())[-1].parts[-1]
    assert prompt == "Help me to locate the dog in the image and give me its bounding boxes."


# ---- into supervision: the worker's real answers, its model's tokens scripted -------------------


@pytest.fixture
def scripted(monkeypatch):
    """`scripted(engine, text)`: the engine's model answers `text` (then its end token) whatever it is shown:
    each forward's logits pick the script's next token, so the engine, tokenizer and grounding run for real."""

    def script(engine, text: str):
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"] + [min(engine.eos_ids)]
        real_forward, calls = engine.model.forward, iter(range(1 << 30))

        def forward(*args, **kwargs):
            output = real_forward(*args, **kwargs)
            token = ids[min(next(calls), len(ids) - 1)]
            output.logits[:, -1, :] = -1e9
            output.logits[:, -1, token] = 0.0
            return output

        monkeypatch.setattr(engine.model, "forward", forward)

    return script


def grounding_answer(image) -> dict:
    import asyncio

    import handler

    job = {"input": {"task": "grounding", "image_url": data_uri(image), "target": "the cat", "max_new_tokens": 200}}
    return asyncio.run(handler.local_test_answer(job))


def test_qwen25_vl_boxes_drop_into_supervision(tiny_model, serve, scripted):
    sv = pytest.importorskip("supervision")
    engine = serve(tiny_model("qwen2.5-vl"))
    scripted(
        engine,
        '```json\n[{"bbox_2d": [20, 10, 60, 40], "label": "cat"}, {"bbox_2d": [0, 0, 30, 30], "label": "mat"}]\n```',
    )
    out = grounding_answer(Image.new("RGB", (200, 150), "white"))
    assert out["box_format"] == "qwen-abs-pixels" and out["resolution_wh"] == [200, 150]
    assert out["input_wh"] and out["input_wh"] != out["resolution_wh"]  # the processor resized the image
    detections = sv.Detections.from_vlm(
        sv.VLM.QWEN_2_5_VL, out["response"], input_wh=tuple(out["input_wh"]), resolution_wh=tuple(out["resolution_wh"])
    )
    assert list(detections.data["class_name"]) == [box["label"] for box in out["boxes"]] == ["cat", "mat"]
    assert abs(detections.xyxy - [box["bbox"] for box in out["boxes"]]).max() <= 1  # the worker rounds to pixels


def test_qwen3_vl_boxes_drop_into_supervision(tiny_model, serve, scripted):
    sv = pytest.importorskip("supervision")
    engine = serve(tiny_model("qwen3-vl"))
    scripted(engine, '[{"bbox_2d": [100, 200, 500, 900], "label": "cat"}]')
    out = grounding_answer(Image.new("RGB", (320, 240), "white"))
    detections = sv.Detections.from_vlm(sv.VLM.QWEN_3_VL, out["response"], resolution_wh=tuple(out["resolution_wh"]))
    assert abs(detections.xyxy - [box["bbox"] for box in out["boxes"]]).max() <= 1
    assert out["boxes"][0]["bbox"] == [32, 48, 160, 216]


def test_qwen2_vl_boxes_make_detections_with_the_readmes_glue(tiny_model, serve, scripted):
    sv = pytest.importorskip("supervision")
    import numpy as np

    engine = serve(tiny_model("qwen2-vl"))
    scripted(engine, "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(100,200),(500,900)<|box_end|>")
    out = grounding_answer(Image.new("RGB", (320, 240), "white"))
    detections = sv.Detections(  # docs/examples.md, "Grounding into supervision"
        xyxy=np.array([box["bbox"] for box in out["boxes"]], dtype=float).reshape(-1, 4),
        data={"class_name": np.array([box["label"] or "" for box in out["boxes"]])},
    )
    assert detections.xyxy.tolist() == [[32.0, 48.0, 160.0, 216.0]] and list(detections["class_name"]) == ["the cat"]
