"""Which frames of a probed video (video.py) a card samples, and decoding only those, with PyAV.

The Qwen cards sample with qwen-vl-utils (`sampled_frames`); SmolVLM2 and LLaVA-OneVision with their video
processors' own `sample_frames` (families/base.py). Every family's count is capped by VLM_MAX_VIDEO_FRAMES.

Decoding is bounded by the frames the decoder actually yields, not by the header's rate (which the sender
writes): a request's videos together decode at most VLM_MAX_VIDEO_DECODED_FRAMES. Where a sampled frame lies
far ahead, the decoder seeks to the keyframe before it instead of decoding every frame between."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import threading
from typing import Optional

from runpod_vlm.vocabulary import RequestError, Video

DECODE_SLACK = 1.1  # a stream may hold this many times the frames its header counts before it is refused
SEEK_GAP = 48  # frames ahead past which the decoder seeks rather than decodes its way (about a short GOP's worth)


class DecodeBudget:
    """The frames one request's videos may decode together (shared by its videos, which decode in turn)."""

    def __init__(self, frames: int):
        self.limit, self.left = frames, frames
        self._lock = threading.Lock()

    def spend(self, video: Video) -> None:
        with self._lock:
            self.left -= 1
            if self.left < 0:
                message = (
                    f"decoding its sampled frames takes over {self.limit} frames for this request "
                    "(VLM_MAX_VIDEO_DECODED_FRAMES): send it at a lower frame rate or shorter"
                )
                raise RequestError("video_too_large", message, video.param)


@dataclasses.dataclass(frozen=True)
class VideoLimits:
    """What decoding a video's frames may meet: the longest video, the most frames sampled, and the budget of
    frames decoded that it shares with the other videos of its request."""

    max_seconds: float
    max_frames: int
    budget: DecodeBudget = dataclasses.field(compare=False)


def decode_frames(video: Video, indices: list[int]) -> list:
    """The frames at `indices` (sorted, of the header's count) as RGB images, decoded once and kept on `video`.
    Refused: a stream longer than its header says, a frame of another size than the header's, an early end, and
    more frames decoded than the request's budget allows (`video_too_large`)."""
    if video.frames is not None and video.indices == indices:
        return video.frames
    frames: dict[int, object] = {}
    with opened(video.data, video.where) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            _decode_into(frames, container, stream, video, sorted(set(indices)))
        except RequestError:
            raise
        except Exception:
            raise RequestError("invalid_video", "the video is truncated or corrupt", video.where) from None
    if any(i not in frames for i in indices):
        raise RequestError("invalid_video", "the video ends before the frames its header counts", video.where)
    video.frames, video.indices = [frames[i] for i in indices], list(indices)
    return video.frames


def _decode_into(frames: dict, container, stream, video: Video, wanted: list[int]) -> None:
    """Decode `wanted` frame indices into `frames`: in order, seeking ahead over long gaps where the stream's
    timestamps place a keyframe (a frame's index is its count from the start, or from a seek, its timestamp)."""
    limit = int(video.limits.max_seconds * video.fps * DECODE_SLACK) + 16
    start = stream.start_time or 0
    decoded = iter(container.decode(stream))
    index = 0  # of the next frame `decoded` yields, once known (None: read it off the frame's timestamp)
    gap = SEEK_GAP  # grows to the keyframes' distance as seeks land: a seek pays only past it
    for target in wanted:
        seek = target - (index or 0) > gap and stream.time_base
        if seek:
            with contextlib.suppress(Exception):  # a container that cannot seek is decoded through
                container.seek(start + int(target / video.fps / stream.time_base), stream=stream, backward=True)
                decoded, index = iter(container.decode(stream)), None
        for frame in decoded:
            video.limits.budget.spend(video)
            if index is None:
                index = _index_of(frame, start, stream.time_base, video.fps)
                if index is None or index > target:  # no usable timestamp: from the start, frame by frame
                    container.seek(start, stream=stream, backward=True)
                    decoded, index, gap = iter(container.decode(stream)), 0, float("inf")
                    continue
                gap = max(gap, target - index)
            if index >= limit:
                raise RequestError("video_too_long", f"the video is over {video.limits.max_seconds:g}s", video.param)
            if index == target:
                if (frame.width, frame.height) != (video.width, video.height):  # the header's size was checked
                    raise RequestError("invalid_video", "the video's frames change size", video.where)
                frames[index] = frame.to_image()
            index += 1
            if index > target:
                break
        else:
            return  # the stream ended


def _index_of(frame, start: int, time_base, fps: float) -> Optional[int]:
    """A frame's index as its timestamp places it, at the header's rate; None without a timestamp."""
    if frame.pts is None or not time_base:
        return None
    return round(float((frame.pts - start) * time_base) * fps)


def sampled_frames(total: int, fps: float, max_frames: int) -> list[int]:
    """The frame indices the Qwen cards take from a video of `total` frames at `fps` (qwen-vl-utils'
    smart_nframes, then an even spread over the whole video, as its readers do)."""
    import torch
    from qwen_vl_utils.vision_process import FPS_MAX_FRAMES, smart_nframes

    count = smart_nframes({"max_frames": min(FPS_MAX_FRAMES, max_frames, total)}, total_frames=total, video_fps=fps)
    return torch.linspace(0, total - 1, count).round().long().tolist()


@contextlib.contextmanager
def opened(data: bytes, where: str):
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception:  # av's errors name FFmpeg internals: a fixed message instead
        raise RequestError("invalid_video", "the data is not a video this worker can read", where) from None
    with container:
        yield container
