"""Videos from strangers: fetched under the media policy like images and probed when the request is read
(stream, frame size, duration, frame count), before any frame is decoded; then, once the family has chosen
which frames its card samples (families/), only those are decoded, with PyAV.

Which frames, and their decoding: frames.py."""

from __future__ import annotations

import contextlib
from typing import Optional

from runpod_vlm.frames import DecodeBudget, VideoLimits, opened
from runpod_vlm.media import check_dimensions, fetched, image_source
from runpod_vlm.settings import Settings
from runpod_vlm.vocabulary import GenerationRequest, RequestError, Video, VideoSpec


def read_videos(item: GenerationRequest, settings: Settings) -> None:
    """Fetch (side by side, under one deadline) and probe an item's videos in place, in order; the count
    is checked before any fetch."""
    pending = [(turn, k) for turn in item.turns for k, part in enumerate(turn.parts) if isinstance(part, VideoSpec)]
    if len(pending) > settings.max_videos:
        turn, k = pending[settings.max_videos]
        raise RequestError("too_many_videos", f"at most {settings.max_videos} videos per request", turn.parts[k].param)
    sources = [image_source(turn.parts[k].spec, turn.parts[k].param) for turn, k in pending]
    budget = DecodeBudget(settings.max_video_decoded_frames)  # the request's videos together
    with contextlib.closing(fetched(sources, settings.media, "video")) as arriving:
        for (turn, k), data, (_, where) in zip(pending, arriving, sources):
            turn.parts[k] = probe_video(data, settings, turn.parts[k].param, where, budget)


def probe_video(
    data: bytes, settings: Settings, param: str, where: Optional[str] = None, budget: Optional[DecodeBudget] = None
) -> Video:
    """Bytes -> a Video whose header was checked, no frame decoded. `where`: the field holding the bytes (….url);
    `budget`: the frames it may decode, shared with the other videos of its request (its own by default)."""
    import av

    where = where or param
    budget = budget or DecodeBudget(settings.max_video_decoded_frames)
    limits = VideoLimits(settings.max_video_seconds, settings.max_video_frames, budget)
    with opened(data, where) as container:
        if not container.streams.video:
            raise RequestError("invalid_video", "the file holds no video stream", where)
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        check_dimensions(width, height, settings.media, where, "video")
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        if fps <= 0:
            raise RequestError("invalid_video", "the video has no frame rate", where)
        if stream.duration is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / av.time_base
        else:
            seconds = (stream.frames or 0) / fps
        if seconds > limits.max_seconds:
            raise RequestError("video_too_long", f"the video lasts {seconds:.0f}s, over {limits.max_seconds:g}s", param)
        total = stream.frames or round(seconds * fps)
        if total < 2:
            raise RequestError("invalid_video", "the video has fewer than 2 frames", where)
    return Video(data, fps, total, width, height, param, where, limits)
