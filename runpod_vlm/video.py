"""Videos from strangers: fetched under the media policy like images, probed before any frame is decoded
(duration, frame size), then decoded with PyAV, keeping only the frames the Qwen cards sample.

The sampling is qwen-vl-utils' own (`smart_nframes`: 2 frames a second, 4 to 768, an even count, spread
evenly over the whole video), capped by VLM_MAX_VIDEO_FRAMES; each family resizes the frames as its
card does when the batch is made (families/native.py)."""

from __future__ import annotations

import contextlib
import io
from typing import Optional

from runpod_vlm.media import check_dimensions, fetched, image_source
from runpod_vlm.settings import Settings
from runpod_vlm.vocabulary import GenerationRequest, RequestError, Video, VideoSpec

DECODE_SLACK = 1.1  # a stream may hold this many times the frames its header counts before it is refused


def read_videos(item: GenerationRequest, settings: Settings) -> None:
    """Fetch (side by side, under one deadline) and decode an item's videos in place, in order; the count
    is checked before any fetch."""
    pending = [(turn, k) for turn in item.turns for k, part in enumerate(turn.parts) if isinstance(part, VideoSpec)]
    if len(pending) > settings.max_videos:
        turn, k = pending[settings.max_videos]
        raise RequestError("too_many_videos", f"at most {settings.max_videos} videos per request", turn.parts[k].param)
    sources = [image_source(turn.parts[k].spec, turn.parts[k].param) for turn, k in pending]
    with contextlib.closing(fetched(sources, settings.media, "videos")) as arriving:
        for (turn, k), data, (_, where) in zip(pending, arriving, sources):
            turn.parts[k] = decode_video(data, settings, turn.parts[k].param, where)


def decode_video(data: bytes, settings: Settings, param: str, where: Optional[str] = None) -> Video:
    """Bytes -> the frames the card samples, as RGB images. `where`: the field holding the bytes (….url)."""
    import av

    where = where or param
    policy = settings.media
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception:  # av's errors name FFmpeg internals: a fixed message instead
        raise RequestError("invalid_video", "the data is not a video this worker can read", where) from None
    with container:
        if not container.streams.video:
            raise RequestError("invalid_video", "the file holds no video stream", where)
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        check_dimensions(width, height, policy, where, "video")
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        if fps <= 0:
            raise RequestError("invalid_video", "the video has no frame rate", where)
        if stream.duration is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / av.time_base
        else:
            seconds = (stream.frames or 0) / fps
        if seconds > settings.max_video_seconds:
            message = f"the video lasts {seconds:.0f}s, over {settings.max_video_seconds:g}s"
            raise RequestError("video_too_long", message, param)
        total = stream.frames or round(seconds * fps)
        if total < 2:
            raise RequestError("invalid_video", "the video has fewer than 2 frames", where)
        indices = sampled_frames(total, fps, settings.max_video_frames)
        wanted, frames = set(indices), {}
        limit = int(settings.max_video_seconds * fps * DECODE_SLACK) + 16
        stream.thread_type = "AUTO"
        try:
            for index, frame in enumerate(container.decode(stream)):
                if index >= limit:
                    raise RequestError("video_too_long", f"the video is over {settings.max_video_seconds:g}s", param)
                if index in wanted:
                    check_dimensions(frame.width, frame.height, policy, where, "video")
                    frames[index] = frame.to_image()
                if index >= indices[-1]:
                    break
        except RequestError:
            raise
        except Exception:
            raise RequestError("invalid_video", "the video is truncated or corrupt", where) from None
    if len(frames) < len(indices):
        raise RequestError("invalid_video", "the video ends before the frames its header counts", where)
    return Video([frames[i] for i in indices], fps, total, indices, param)


def sampled_frames(total: int, fps: float, max_frames: int) -> list[int]:
    """The frame indices the Qwen cards take from a video of `total` frames at `fps` (qwen-vl-utils'
    smart_nframes, then an even spread over the whole video, as its readers do)."""
    import torch
    from qwen_vl_utils.vision_process import FPS_MAX_FRAMES, smart_nframes

    count = smart_nframes({"max_frames": min(FPS_MAX_FRAMES, max_frames, total)}, total_frames=total, video_fps=fps)
    return torch.linspace(0, total - 1, count).round().long().tolist()
