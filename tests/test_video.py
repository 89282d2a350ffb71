"""Video input on real tiny models (CPU): a clip made here with PyAV gives the tokens of each card's
recipe, alone and beside an image job: the Qwen cards' qwen-vl-utils process_vision_info, and SmolVLM2's
and LLaVA-OneVision's apply_chat_template over the video file (read by transformers' own PyAV reader);
hostile videos are refused naming the field; families without video refuse it clearly."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import torch

import handler
from conftest import ImageServer
from runpod_vlm.answers import generate_all
from tools.sample_images import data_uri, striped

av = pytest.importorskip("av")
qwen_vl_utils = pytest.importorskip("qwen_vl_utils")
NEW_TOKENS = 6


def clip(seconds: float = 2.0, fps: int = 8, size=(64, 48), faststart: bool = False) -> bytes:
    """An MPEG-4 clip whose frames differ (a bar moving across stripes); `faststart`: its header first (as
    streamed files have it), so that a cut-off file still opens."""
    import tempfile

    if faststart:  # FFmpeg moves the header by rereading the file: a named one
        with tempfile.NamedTemporaryFile(suffix=".mp4") as named:
            clip_into(named.name, seconds, fps, size, {"movflags": "faststart"})
            return named.read()
    out = io.BytesIO()
    clip_into(out, seconds, fps, size, {})
    return out.getvalue()


def clip_into(out, seconds: float, fps: int, size, options: dict, keyframe_every: int = 12) -> None:
    import numpy as np

    with av.open(out, mode="w", format="mp4", options=options) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.codec_context.gop_size = keyframe_every
        stream.codec_context.options = {"sc_threshold": "1000000000"}  # no keyframe at a scene cut: only every gop
        for n in range(int(seconds * fps)):
            pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
            pixels[:, :, 1] = (np.arange(size[0]) * 4 % 256)[None, :]
            pixels[:, (n * 5) % size[0] : (n * 5) % size[0] + 6, 0] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def video_uri(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def video_job(data: bytes, question: str = "What happens?") -> dict:
    content = [{"type": "video_url", "video_url": {"url": video_uri(data)}}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}], "max_new_tokens": NEW_TOKENS}


def decoded_whole(path: str) -> tuple:
    """What qwen-vl-utils' torchvision reader returned before torchvision dropped read_video: every frame
    (T, C, H, W uint8), then the card's own sampling of them."""
    import numpy as np

    with av.open(path) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        video = torch.stack(
            [torch.from_numpy(np.asarray(f.to_image()).transpose(2, 0, 1).copy()) for f in container.decode(stream)]
        )
    return video, fps


def card_recipe(folder, data: bytes, question: str, monkeypatch, tmp_path) -> tuple[dict, list[int]]:
    """The Qwen2-VL / Qwen2.5-VL card: process_vision_info over the messages (the file read whole, then
    sampled and resized by qwen-vl-utils), the processor with the card's video_kwargs, greedy generate."""
    import transformers
    from qwen_vl_utils import vision_process

    def read_whole(ele):
        video, fps = decoded_whole(ele["video"])
        total = video.shape[0]
        nframes = vision_process.smart_nframes(ele, total_frames=total, video_fps=fps)
        idx = torch.linspace(0, total - 1, nframes).round().long()
        metadata = {"fps": fps, "frames_indices": idx, "total_num_frames": total, "video_backend": "torchvision"}
        return video[idx], metadata, nframes / total * fps

    monkeypatch.setitem(vision_process.VIDEO_READER_BACKENDS, "torchvision", read_whole)
    monkeypatch.setattr(vision_process, "get_video_reader_backend", lambda: "torchvision")
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    messages = [
        {"role": "user", "content": [{"type": "video", "video": str(path)}, {"type": "text", "text": question}]}
    ]
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kind = model.config.model_type
    images, videos, video_kwargs = vision_process.process_vision_info(
        messages,
        return_video_kwargs=True,
        return_video_metadata=True,
        image_patch_size=16 if kind == "qwen3_vl" else 14,
    )
    videos, metadata = zip(*videos)
    # The Qwen2.5-VL card's video_kwargs (fps per video) is what transformers 5 reads from each video's
    # metadata (a list of fps is refused there); the Qwen2-VL card passes none; Qwen3-VL's passes the
    # metadata and do_resize=False.
    extra = {"video_metadata": list(metadata), **video_kwargs} if kind != "qwen2_vl" else {}
    if kind == "qwen3_vl":
        extra["do_resize"] = False
    inputs = processor(text=[text], images=images, videos=list(videos), padding=True, return_tensors="pt", **extra)
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return inputs, output[0, inputs["input_ids"].shape[1] :].tolist()


def answer(job: dict) -> dict:
    return asyncio.run(handler.local_test_answer({"id": "v", "input": job}))


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_a_video_gets_the_tokens_of_the_cards_recipe_alone_and_beside_an_image_job(
    family, tiny_model, serve, monkeypatch, tmp_path
):
    engine = serve(tiny_model(family))
    data = clip()
    card, reference = card_recipe(tiny_model(family), data, "What happens?", monkeypatch, tmp_path)
    expected = engine.tokenizer.decode(reference, skip_special_tokens=True).strip()
    job = dict(video_job(data), min_new_tokens=NEW_TOKENS)
    item = handler.read_job_item(job, engine.settings, engine.model_id)[1]
    ours, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", torch.float32)
    for name in ("input_ids", "video_grid_thw", "pixel_values_videos", "second_per_grid_ts"):
        if name in card:  # the prompt (Qwen3-VL's frame timestamps in it), the frames' pixels, their grids
            assert torch.equal(torch.as_tensor(ours[name]), torch.as_tensor(card[name])), name
    prompt = card["input_ids"].shape[1]
    alone = answer(job)
    assert alone["response"] == expected and alone["usage"]["prompt_tokens"] == prompt, alone
    image_job = {"task": "caption", "image_url": data_uri(striped((48, 40))), "max_new_tokens": 4}
    items = [handler.read_job_item(j, engine.settings, engine.model_id)[1] for j in (image_job, job)]
    beside = generate_all(engine, items)
    assert beside[1].text == expected and beside[1].prompt_tokens == prompt


def processor_card_recipe(folder, data: bytes, question: str, tmp_path, **processor_kwargs) -> tuple[dict, list[int]]:
    """The SmolVLM2 and LLaVA-OneVision cards: apply_chat_template over a video file (the processor samples
    its frames; its reader made PyAV, as torchcodec is not installed here), greedy generate."""
    import transformers
    from transformers.video_utils import load_video

    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    processor = transformers.AutoProcessor.from_pretrained(folder)

    def fetch_videos(urls, sample_indices_fn=None):  # its own fetch_videos, with backend="pyav"
        if isinstance(urls, list):
            return list(zip(*[fetch_videos(url, sample_indices_fn) for url in urls]))
        return load_video(urls, backend="pyav", sample_indices_fn=sample_indices_fn)

    processor.video_processor.fetch_videos = fetch_videos
    content = [{"type": "video", "path": str(path)}, {"type": "text", "text": question}]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True,
        return_tensors="pt", **processor_kwargs,
    )  # fmt: skip
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return inputs, output[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(("family", "card_kwargs"), [("smolvlm", {}), ("llava-onevision", {"num_frames": 8})])
def test_a_video_gets_the_tokens_of_apply_chat_template_over_the_file(family, card_kwargs, tiny_model, serve, tmp_path):
    engine = serve(tiny_model(family))
    data = clip(seconds=3)  # SmolVLM2 takes a frame a second (3), LLaVA-OneVision's card 8
    card, reference = processor_card_recipe(tiny_model(family), data, "What happens?", tmp_path, **card_kwargs)
    job = dict(video_job(data), min_new_tokens=NEW_TOKENS)
    item = handler.read_job_item(job, engine.settings, engine.model_id)[1]
    ours, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", torch.float32)
    assert set(ours) == set(card)
    for name in card:  # the prompt (SmolVLM2's frame timestamps in it) and the frames' pixels
        assert torch.equal(ours[name], card[name]), name
    expected = engine.tokenizer.decode(reference, skip_special_tokens=True).strip()
    assert answer(job)["response"] == expected
    image_job = {"task": "caption", "image_url": data_uri(striped((48, 40))), "max_new_tokens": 4}
    items = [handler.read_job_item(j, engine.settings, engine.model_id)[1] for j in (image_job, job)]
    beside = generate_all(engine, items)
    assert beside[1].text == expected and beside[1].prompt_tokens == card["input_ids"].shape[1]


def test_the_frame_cap_bounds_the_frames_a_processor_samples(tiny_model, serve):
    engine = serve(tiny_model("llava-onevision"), VLM_MAX_VIDEO_FRAMES="4")
    item = handler.read_job_item(video_job(clip(seconds=3)), engine.settings, engine.model_id)[1]
    inputs, _ = engine.adapter.batch_inputs(engine.processor, [item], "cpu", torch.float32)
    assert inputs["pixel_values_videos"].shape[1] == 4  # the card's 8, capped
    assert item.videos[0].indices == [0, 6, 12, 18]  # spread over the clip's 24 frames


def test_videos_the_worker_cannot_take_are_refused_naming_the_field(tiny_model, serve, monkeypatch):
    serve(tiny_model("qwen2-vl"))
    where = "messages[0].content[0].video_url"
    garbage = answer(video_job(b"\x00\x01not a video at all" * 50))
    assert (garbage["code"], garbage["param"]) == ("invalid_video", where + ".url"), garbage
    internal = {
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "http://10.0.0.1/v.mp4"}]}]
    }
    blocked = answer(internal)
    assert blocked["code"] == "blocked_url" and blocked["param"] == where, blocked
    monkeypatch.setenv("VLM_MAX_VIDEO_SECONDS", "1")
    serve(tiny_model("qwen2-vl"), VLM_MAX_VIDEO_SECONDS="1")
    long = answer(video_job(clip(seconds=3)))
    assert (long["code"], long["param"]) == ("video_too_long", where), long
    serve(tiny_model("qwen2-vl"), VLM_MAX_IMAGE_PIXELS="1000")
    wide = answer(video_job(clip(size=(64, 48))))
    assert (wide["code"], wide["param"]) == ("video_too_large", where + ".url"), wide
    serve(tiny_model("qwen2-vl"), VLM_MAX_VIDEOS="1")
    two = video_job(clip())
    two["messages"][0]["content"].insert(0, two["messages"][0]["content"][0])
    many = answer(two)
    assert (many["code"], many["param"]) == ("too_many_videos", "messages[0].content[1].video_url"), many


def test_a_videos_fetch_and_its_errors_speak_of_a_video(tiny_model, serve):
    data = clip()
    server = ImageServer(data, "/clip.mp4", "video/mp4")
    try:
        serve(tiny_model("qwen2-vl"), VLM_ALLOW_INTERNAL_URLS="true")
        content = [{"type": "video_url", "video_url": {"url": server.url}}, {"type": "text", "text": "What happens?"}]
        fetched = answer({"messages": [{"role": "user", "content": content}], "max_new_tokens": 2})
        assert "response" in fetched and server.accepts == ["video/*"], (fetched, server.accepts)
    finally:
        server.close()
    where = "messages[0].content[0].video_url"
    serve(tiny_model("qwen2-vl"), VLM_MAX_BASE64_BYTES="1000")
    big = answer(video_job(data))
    assert (big["code"], big["param"]) == ("video_too_large", where + ".url") and "base64 video" in big["error"], big
    ftp = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "ftp://example.com/v.mp4"}]}]}
    scheme = answer(ftp)
    assert (scheme["code"], scheme["param"]) == ("invalid_video_url", where), scheme


def test_a_video_cut_short_after_its_header_fails_alone_naming_the_field(tiny_model, serve):
    engine = serve(tiny_model("llava-onevision"))
    whole = clip(seconds=3, faststart=True)
    cut = handler.read_job_item(video_job(whole[: len(whole) // 2]), engine.settings, engine.model_id, "requests[0]")
    image_job = {"task": "caption", "image_url": data_uri(striped()), "max_new_tokens": 4}
    image = handler.read_job_item(image_job, engine.settings, engine.model_id)[1]
    refused, answered = generate_all(engine, [cut[1], image])  # the header passed when read: frames fail later
    assert (refused.code, refused.param) == ("invalid_video", "requests[0].messages[0].content[0].video_url.url")
    assert answered.text is not None


def test_a_family_without_video_refuses_it_and_answers_its_neighbours(tiny_model, serve):
    engine = serve(tiny_model("llava"))
    video = handler.read_job_item(video_job(clip()), engine.settings, engine.model_id, "requests[0]")[1]
    image_job = {"task": "caption", "image_url": data_uri(striped())}
    image = handler.read_job_item(image_job, engine.settings, engine.model_id)
    refused, answered = generate_all(engine, [video, image[1]])
    assert refused.code == "unsupported_video" and refused.param == "requests[0].messages[0].content[0].video_url"
    assert answered.text is not None


def test_the_openai_route_takes_a_video_url_part(tiny_model, serve):
    engine = serve(tiny_model("qwen2-vl"))
    job = video_job(clip())
    body = {"model": engine.model_id, "messages": job["messages"], "max_tokens": NEW_TOKENS, "temperature": 0}
    out = answer({"openai_route": "/v1/chat/completions", "openai_input": body})
    native = answer(job)
    assert out["choices"][0]["message"]["content"] == native["response"], out
    assert out["usage"]["prompt_tokens"] == native["usage"]["prompt_tokens"]


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "smolvlm", "llava-onevision"])
def test_videos_of_other_lengths_beside_image_jobs_through_a_small_pool_get_their_solo_tokens(
    family, tiny_model, serve, monkeypatch
):
    # SmolVLM2's processor, given a 2 s and a 3 s video together, gave the first two prompt tokens more than
    # alone: its videos are prepared one at a time now. The pool makes rows preempt and resume.
    from test_paged_engine import mixed_jobs, solo_generate, spy

    engine = serve(tiny_model(family), VLM_KV_CACHE_TOKENS="1024", VLM_SYNC_INTERVAL="3", VLM_MAX_BATCH_TOKENS="2048")
    lengths = (40, 150, 90)
    jobs = [
        dict(video_job(clip(seconds=2 + n % 2)), max_new_tokens=lengths[n % 3], min_new_tokens=lengths[n % 3])
        for n in range(4)
    ]
    jobs += mixed_jobs(4)
    items = [handler.read_job_item(job, engine.settings, engine.model_id, None)[1] for job in jobs]
    solo = solo_generate(engine, items)
    events: list = []
    spy(monkeypatch, engine.scheduler, "preempt", events, "preempt")
    assert generate_all(engine, items) == solo
    assert "preempt" in events


# ---- dense videos: decoding bounded by frames decoded, not by the header's rate --------------------------------


def dense_clip(keyframe_every: int, frames: int = 6000, fps: int = 1000) -> bytes:
    """Many tiny frames at a high rate (the header's rate is the sender's to write): 6 s of 16x16 at 1,000 fps."""
    out = io.BytesIO()
    clip_into(out, frames / fps, fps, (16, 16), {}, keyframe_every=keyframe_every)
    return out.getvalue()


def probed(data: bytes, engine):
    from runpod_vlm.video import probe_video

    return probe_video(data, engine.settings, "messages[0].content[0]")


def test_a_dense_clip_whose_sampled_frames_need_too_many_decoded_is_refused_naming_it(tiny_model, serve):
    serve(tiny_model("qwen2-vl"), VLM_MAX_VIDEO_DECODED_FRAMES="1000")
    refused = answer(video_job(dense_clip(keyframe_every=600)))  # the sampled frames 545 apart: no seek pays
    assert refused["code"] == "video_too_large" and refused["param"] == "messages[0].content[0].video_url", refused
    assert "VLM_MAX_VIDEO_DECODED_FRAMES" in refused["error"]


def test_a_dense_clip_with_keyframes_decodes_near_its_sampled_frames_only(tiny_model, serve, tmp_path):
    import numpy as np

    from runpod_vlm.frames import decode_frames, sampled_frames

    engine = serve(tiny_model("qwen2-vl"), VLM_MAX_VIDEO_DECODED_FRAMES="1000")
    data = dense_clip(keyframe_every=25)
    video = probed(data, engine)
    indices = sampled_frames(video.total, video.fps, video.limits.max_frames)
    assert indices[-1] == 5999  # read through, every frame up to it would be decoded
    frames = decode_frames(video, indices)
    decoded = 1000 - video.limits.budget.left
    assert decoded <= len(indices) * 25, decoded  # a keyframe's distance before each sampled frame at most
    path = tmp_path / "dense.mp4"
    path.write_bytes(data)
    whole, _ = decoded_whole(str(path))
    for frame, index in zip(frames, indices):
        assert torch.equal(torch.from_numpy(np.asarray(frame)).permute(2, 0, 1), whole[index])  # as read whole
    assert answer(video_job(data))["finish_reason"] in ("stop", "length")


def test_an_image_job_is_answered_while_a_video_beside_it_still_decodes(tiny_model, serve, monkeypatch):
    """Videos decode on a thread of their own and a queued item still being prepared holds up no other job: two
    videos whose decoding is held back do not delay a caption sent after them."""
    import threading

    from runpod_vlm.families import native

    serve(tiny_model("qwen2-vl"))
    release, decoding, decoded = threading.Event(), threading.Semaphore(0), threading.Event()
    real = native.decode_frames

    def held_back(video, indices):
        decoding.release()
        release.wait(30)
        decoded.set()
        return real(video, indices)

    monkeypatch.setattr(native, "decode_frames", held_back)
    caption = {"task": "caption", "image_url": data_uri(striped((48, 40))), "max_new_tokens": 4}

    async def run():
        jobs = [handler.local_test_answer({"id": f"v{n}", "input": video_job(clip())}) for n in range(2)]
        videos = [asyncio.create_task(job) for job in jobs]
        await asyncio.to_thread(decoding.acquire, timeout=60)  # the first video is decoding
        answered = await handler.local_test_answer({"id": "c", "input": caption})
        still_held = not decoded.is_set()
        release.set()
        return answered, still_held, await asyncio.gather(*videos)

    answered, still_held, videos = asyncio.run(run())
    assert "response" in answered and still_held, answered
    assert all("response" in video for video in videos), videos
