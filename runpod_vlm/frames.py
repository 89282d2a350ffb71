"""Which frames of a probed video (video.py) a card samples, and decoding only those, with PyAV.

The Qwen cards sample with qwen-vl-utils (`sampled_frames`); SmolVLM2 and LLaVA-OneVision with their video
processors' own `sample_frames` (families/base.py). Every family's count is capped by VLM_MAX_VIDEO_FRAMES."""

from __future__ import annotations

import contextlib
import dataclasses
import io

from runpod_vlm.vocabulary import RequestError, Video

DECODE_SLACK = 1.1  # a stream may hold this many times the frames its header counts before it is refused


@dataclasses.dataclass(frozen=True)
class VideoLimits:
    """What decoding a video's frames may meet: the longest video, the most frames sampled."""

    max_seconds: float
    max_frames: int


def decode_frames(video: Video, indices: list[int]) -> list:
    """The frames at `indices` (sorted, of the header's count) as RGB images, decoded once and kept on `video`.
    Refused: a stream longer than its header says, a frame of another size than the header's, an early end."""
    if video.frames is not None and video.indices == indices:
        return video.frames
    limits, wanted, frames = video.limits, set(indices), {}
    limit = int(limits.max_seconds * video.fps * DECODE_SLACK) + 16
    with opened(video.data, video.where) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for index, frame in enumerate(container.decode(stream)):
                if index >= limit:
                    raise RequestError("video_too_long", f"the video is over {limits.max_seconds:g}s", video.param)
                if index in wanted:
                    if (frame.width, frame.height) != (video.width, video.height):  # the header's size was checked
                        raise RequestError("invalid_video", "the video's frames change size", video.where)
                    frames[index] = frame.to_image()
                if index >= indices[-1]:
                    break
        except RequestError:
            raise
        except Exception:
            raise RequestError("invalid_video", "the video is truncated or corrupt", video.where) from None
    if len(frames) < len(indices):
        raise RequestError("invalid_video", "the video ends before the frames its header counts", video.where)
    video.frames, video.indices = [frames[i] for i in indices], list(indices)
    return video.frames


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
