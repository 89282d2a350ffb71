"""Issue 13: hostile requests get small, clear `invalid_request` answers naming the field, never a
traceback, and never reach the model. Calls `handler.handler` as RunPod does (through `answer`)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging

import pytest

import handler
from runpod_vlm.request import check_strings
from runpod_vlm.vocabulary import MAX_ECHO_CHARS, MAX_PARAM_CHARS, RequestError
from tools.sample_images import data_uri, striped

SMALL = 4096  # bytes: the most any error answer may weigh
HUGE = 15_000_000  # characters: the 15 MB field name


def answer(job: dict) -> dict:
    """handler.handler(job)'s final output, whether the handler returns, awaits or streams."""
    result = handler.handler(job)
    if inspect.isasyncgen(result):

        async def last():
            outputs = [output async for output in result]
            return outputs[-1] if outputs else None

        return asyncio.run(last())
    if inspect.isawaitable(result):
        return asyncio.run(result)
    if inspect.isgenerator(result):
        outputs = list(result)
        return outputs[-1] if outputs else None
    return result


def posted_size(output: dict) -> int:
    """Bytes of the answer as the SDK posts it; strict UTF-8, as aiohttp encodes it."""
    return len(json.dumps(output, ensure_ascii=False).encode("utf-8"))


def assert_refused(output: dict, param: str, code: str = "invalid_request") -> dict:
    assert output.get("code") == code, output if posted_size(output) < SMALL else output.get("code")
    assert output["param"] == param
    assert json.loads(output["error"])["error_message"].startswith(f"{param}: ")
    assert posted_size(output) < SMALL
    return output


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to load or run the model fails the test: these requests must stop before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("a hostile request reached the model")

    monkeypatch.setattr(handler, "get_engine", refuse)
    monkeypatch.setattr(handler, "_engine", None)
    for name in ("VLM_MODEL", "VLM_ALLOW_ANY"):
        monkeypatch.delenv(name, raising=False)


def vqa(**fields) -> dict:
    return {"id": "job-1", "input": {"task": "vqa", "image_url": data_uri(striped()), "question": "What?", **fields}}


# ---- bounded echoes -----------------------------------------------------------------------------


def test_a_15_mb_unknown_field_name_gets_a_small_answer_naming_it(no_model):
    name = "x" * HUGE
    output = answer(vqa(**{name: 1}))
    cut = "x" * MAX_ECHO_CHARS + "…"
    assert_refused(output, cut)
    assert "unknown field" in output["error"]


def test_an_unknown_field_in_a_batch_item_names_its_cut_path(no_model):
    output = answer({"id": "b", "input": {"requests": [{"task": "caption", "y" * HUGE: True}]}})
    (item,) = output["results"]
    assert_refused(item, "requests[0]." + "y" * MAX_ECHO_CHARS + "…")
    assert posted_size(output) < SMALL


def test_a_huge_field_beside_requests_is_cut(no_model):
    output = answer({"id": "b", "input": {"requests": [], "z" * HUGE: 1}})
    assert output["code"] == "invalid_request" and output["param"].startswith("z" * 64)
    assert posted_size(output) < SMALL


@pytest.mark.parametrize("field", ["task", "model", "quantize"])
def test_huge_values_are_quoted_cut(field, no_model):
    output = answer(vqa(**{field: "v" * HUGE}))
    assert output["param"] == field and output["code"] in ("invalid_request", "model_mismatch")
    assert posted_size(output) < SMALL
    assert "v" * 65 not in output["error"]


def test_a_huge_question_is_refused_by_length_without_echo(no_model):
    output = answer(vqa(question="q" * HUGE))
    assert output["code"] == "text_too_long" and posted_size(output) < SMALL


def test_a_long_field_path_is_cut_as_a_whole():
    error = RequestError("invalid_request", "m" * 100_000, ".".join(["k" * 60] * 100))
    out = error.to_dict()
    assert len(out["param"]) <= MAX_PARAM_CHARS + 1 and out["param"].endswith("…")
    assert posted_size(out) < SMALL


# ---- invalid Unicode and NUL --------------------------------------------------------------------

LONE = "\ud800"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"question": f"what{LONE}?"}, "question"),
        ({"question": "what\x00?"}, "question"),
        ({"task": "grounding", "target": f"the {LONE}cat"}, "target"),
        ({"model": f"m{LONE}"}, "model"),
        ({"image_url": f"https://images.example.com/{LONE}.png"}, "image_url"),
        ({"images": [data_uri(striped()), f"\x00{LONE}"]}, "images[1]"),
        ({f"bad{LONE}key": 1}, "bad\\ud800key"),
        ({"nul\x00key": 1}, "nul\x00key"),
    ],
)
def test_invalid_unicode_or_nul_is_refused_naming_the_field(fields, param, no_model, caplog):
    job = vqa(**fields)
    with caplog.at_level(logging.DEBUG, logger="runpod-vlm"):
        output = answer(job)
    assert_refused(output, param)
    assert "Unicode" in output["error"] or "NUL" in output["error"]
    json.dumps(output, ensure_ascii=False).encode("utf-8")  # postable: no lone surrogate in the answer
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)


def test_invalid_unicode_in_a_message_block_is_refused(no_model):
    output = answer(
        {
            "id": "c",
            "input": {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "fine"}, {"type": "text", "text": f"x{LONE}"}],
                    },
                ]
            },
        }
    )
    assert_refused(output, "messages[0].content[1].text")


def test_a_surrogate_in_a_batch_item_sinks_only_that_item(no_model):
    output = answer(
        {
            "id": "b",
            "input": {
                "requests": [
                    {"task": "vqa", "image_url": data_uri(striped())},  # no question: refused on its own
                    {"task": "vqa", "image_url": data_uri(striped()), "question": LONE},
                ]
            },
        }
    )
    first, second = output["results"]
    assert_refused(first, "requests[0].question")
    assert_refused(second, "requests[1].question")
    assert "Unicode" in second["error"]


def test_valid_unicode_passes_the_checks():
    check_strings({"question": "Ça va? 猫 🐱 \u200b 😀", "k\u00e9y": ["ß"]}, None)


# ---- structure: nesting and non-objects ---------------------------------------------------------


def nested(depth: int):
    value: object = "leaf"
    for _ in range(depth):
        value = {"a": [value]}
    return value


def test_deep_nesting_is_refused_without_recursion(no_model):
    output = answer(vqa(messages=nested(20_000)))  # deeper than Python's recursion limit
    assert output["code"] == "invalid_request" and output["param"].startswith("messages.a[0].a[0]")
    assert "nested deeper" in output["error"] and posted_size(output) < SMALL


def test_nesting_as_deep_as_a_real_request_is_accepted():
    check_strings({"requests": [{"messages": [{"content": [{"image_url": {"url": "x"}}]}]}]}, None)


def test_an_image_object_inside_an_image_object_is_refused(no_model):
    output = answer(vqa(image_url={"url": {"url": data_uri(striped())}}))
    assert_refused(output, "image_url.url", "invalid_image")


@pytest.mark.parametrize(
    "job, param",
    [
        ({"id": "n", "input": "caption this"}, "input"),
        ({"id": "n", "input": ["task", "caption"]}, "input"),
        ({"id": "n", "input": None}, "input"),
        ({"id": "n", "input": 7}, "input"),
        ({"id": "n"}, "input"),
        ({"id": "n", "input": {"requests": "all of them"}}, "requests"),
        ({"id": "n", "input": {"requests": [[1, 2]]}}, None),
        ({"id": "n", "input": {"messages": "hello"}}, "messages"),
        ({"id": "n", "input": {"messages": [["user", "hi"]]}}, "messages[0]"),
        ({"id": "n", "input": {"messages": [{"role": "user", "content": [7]}]}}, "messages[0].content[0]"),
        ({"id": "n", "input": {"task": "caption", "images": {"0": "x"}}}, "images"),
        ({"id": "n", "input": {"task": ["caption"]}}, "task"),
        ({"id": "n", "input": {"task": "vqa", "image_url": 12, "question": "q"}}, "image_url"),
    ],
)
def test_inputs_that_are_not_objects_get_clean_errors(job, param, no_model):
    output = answer(job)
    if param is None:  # a batch: the item itself is at fault
        output = output["results"][0]
        param = "requests[0]"
    assert output["param"] == param and output["code"] in ("invalid_request", "invalid_image")
    assert posted_size(output) < SMALL
