"""Images named by a request -> decoded RGB images: count, deadline, pixel budget, safe decoding."""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import functools
import hashlib
import io
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from runpod_vlm.fetch import SVG_MESSAGE, URL_SCHEME, fetch_image_url, size_text
from runpod_vlm.lru import BytesLRU
from runpod_vlm.settings import MediaPolicy, Settings
from runpod_vlm.vocabulary import GenerationRequest, ImageSpec, RequestError, join_param

MAX_PARALLEL_FETCHES = 8  # threads fetching the images of one request
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def read_images(item: GenerationRequest, settings: Settings) -> None:
    """Fetch (side by side, under one deadline) and decode an item's images in place, in order: the count
    is checked before any fetch, the pixel budget before each decode; the first failure in order is raised."""
    pending = [(turn, k) for turn in item.turns for k, part in enumerate(turn.parts) if isinstance(part, ImageSpec)]
    if len(pending) > settings.max_images:
        turn, k = pending[settings.max_images]
        raise RequestError("too_many_images", f"at most {settings.max_images} images per request", turn.parts[k].param)
    policy, used = settings.media, 0
    memo = decoded_images(settings.decoded_image_cache_mb * 2**20) if settings.decoded_image_cache_mb else None
    sources = [image_source(turn.parts[k].spec, turn.parts[k].param) for turn, k in pending]
    with contextlib.closing(fetched(sources, policy)) as arriving:
        for (turn, k), data, (_, where) in zip(pending, arriving, sources):
            remaining = settings.max_total_pixels - used  # decoded as soon as it and those before it arrived
            narrowed = remaining < policy.max_image_pixels
            budget = dataclasses.replace(policy, max_image_pixels=max(remaining, 1)) if narrowed else policy
            try:
                image, pixels = decode_or_recall(data, budget, where, memo)
            except RequestError as error:
                if narrowed and error.code == "image_too_large":
                    message = f"the request's images hold over {settings.max_total_pixels} pixels together"
                    raise RequestError("image_too_large", message, turn.parts[k].param) from None
                raise
            used += image.width * image.height
            item.image_max_pixels.append(turn.parts[k].max_pixels)
            item.image_keys.append(image_key(pixels, turn.parts[k].max_pixels))
            turn.parts[k] = image


def fetched(sources: list[tuple[str, str]], policy: MediaPolicy, kind: str = "image") -> Iterator[bytes]:
    """The bytes of each (spec text, field) in order, fetched side by side under one deadline (`kind`, image or
    video, names them in errors); the fetches still running are cancelled when the iteration is closed. Without
    a URL among them (data URIs, base64) they are read here: starting the threads took longer than reading."""
    import concurrent.futures

    if not any(_scheme(text) in ("http", "https") for text, _ in sources):
        yield from (image_bytes(text, policy, where, kind=kind) for text, where in sources)
        return
    deadline = time.monotonic() + policy.fetch_deadline
    pool = ThreadPoolExecutor(MAX_PARALLEL_FETCHES, thread_name_prefix="vlm-fetch")  # threads start as needed
    try:
        futures = [pool.submit(image_bytes, text, policy, where, deadline, kind) for text, where in sources]
        for future, (_, where) in zip(futures, sources):
            try:  # each fetch stops itself at the deadline; the margin only guards against a stuck thread
                yield future.result(timeout=max(deadline - time.monotonic(), 0) + 2)
            except concurrent.futures.TimeoutError:
                message = f"the request's {kind}s took over {policy.fetch_deadline:g}s to download"
                raise RequestError("fetch_timeout", message, where) from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _scheme(spec: str) -> Optional[str]:
    """An image spec's URL scheme, lower-cased; None for base64 and paths."""
    scheme = URL_SCHEME.match(spec)
    return scheme.group(1).lower() if scheme else None


@functools.lru_cache(maxsize=1)
def decoded_images(max_bytes: int) -> BytesLRU:
    """The worker's decoded images, by their bytes' digest: (image, pixels_digest)."""
    return BytesLRU(max_bytes, _pixel_bytes, "decoded images")


def _pixel_bytes(entry: tuple) -> int:
    image = entry[0]
    return image.width * image.height * len(image.getbands())


def decode_or_recall(data: bytes, policy: MediaPolicy, param: str, memo: Optional[BytesLRU]) -> tuple[Any, bytes]:
    """`decode_image`'s image and its pixels' digest; bytes decoded before come from `memo` (an image sent again:
    each turn of a chat resends its images), their size checked again against this request's budget. The image is
    shared: nothing changes an image in place."""
    if memo is None:
        image = decode_image(data, policy, param)
        return image, pixels_digest(image)
    digest = hashlib.blake2b(data, digest_size=16).digest()
    recalled = memo.get(digest)
    if recalled is not None:
        check_dimensions(*recalled[0].size, policy, param)
        return recalled
    image = decode_image(data, policy, param)
    entry = image, pixels_digest(image)
    memo.put(digest, entry)
    return entry


def pixels_digest(image) -> bytes:
    """A digest of a decoded image's pixels, mode and size."""
    digest = hashlib.blake2b(image.tobytes(), digest_size=16)
    digest.update(f"{image.mode} {image.size}".encode())
    return digest.digest()


def image_key(pixels: bytes, max_pixels: Optional[int]) -> bytes:
    """An image's identity for the vision-embedding cache: its pixels' digest and the request's bound on its
    size (which changes what the encoder sees)."""
    return pixels + str(max_pixels).encode()


def image_source(spec: Any, param: str) -> tuple[str, str]:
    """An image spec's text and the field that holds it ({"url": text} -> param.url)."""
    if isinstance(spec, dict):
        if "url" not in spec:
            raise RequestError("invalid_image", "an image object needs a 'url' field", param)
        spec, param = spec["url"], join_param(param, "url")
    if not isinstance(spec, str) or not spec.strip():
        raise RequestError("invalid_image", "an image must be a URL, a data URI or base64 text", param)
    return spec.strip(), param


def image_bytes(
    spec: str, policy: MediaPolicy, param: str, deadline: Optional[float] = None, kind: str = "image"
) -> bytes:
    """The bytes an image spec names (or a video's: `kind` names it in errors); `deadline` (time.monotonic())
    bounds a URL fetch further."""
    scheme = _scheme(spec)
    if scheme == "data":
        return _data_uri_bytes(spec, policy, param, kind)
    if scheme in ("http", "https"):
        return fetch_image_url(spec, policy, param, deadline, kind=kind)
    if scheme == "file":
        return _local_file_bytes(spec, True, policy, param, kind)
    if scheme:
        message = "unsupported URL scheme; send an https URL, a data URI or base64"
        raise RequestError(f"invalid_{kind}_url", message, param)
    # Base64 never holds '.' or '~'; it may start with '/' (JPEG: "/9j/"), but no JPEG encodes to
    # under 128 characters, so a short "/..." is a path. Other paths need file:// or a '.'.
    if "." in spec or spec.startswith("~") or (spec.startswith("/") and len(spec) < 128):
        return _local_file_bytes(spec, False, policy, param, kind)
    return _base64_bytes(spec, policy, param, kind)


def _data_uri_bytes(spec: str, policy: MediaPolicy, param: str, kind: str) -> bytes:
    header, comma, _ = spec[5:1029].partition(",")
    if not comma:
        raise RequestError(f"invalid_{kind}_url", "a data URI needs a ',' after its header", param)
    fields = [f.strip().lower() for f in header.split(";")]
    if kind == "image" and fields[0] == "image/svg+xml":
        raise RequestError("unsupported_image_format", SVG_MESSAGE, param)
    if "base64" not in fields[1:]:
        example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
        raise RequestError(f"invalid_{kind}_url", f"only base64 data URIs are supported ({example})", param)
    return _base64_bytes(spec[5 + len(header) + 1 :], policy, param, kind)


def _base64_bytes(text: str, policy: MediaPolicy, param: str, kind: str = "image") -> bytes:
    """Strict base64; line breaks and the URL-safe alphabet (padded or not) pass, mixed alphabets do not."""
    if len(text) > policy.max_base64_bytes:
        message = f"the base64 {kind} is over {size_text(policy.max_base64_bytes)} encoded"
        raise RequestError(f"{kind}_too_large", message, param)
    compact = "".join(text.split())
    if "-" in compact or "_" in compact:
        if "+" in compact or "/" in compact:
            raise RequestError("invalid_base64", f"the {kind} mixes standard and URL-safe base64 alphabets", param)
        compact = compact.translate(str.maketrans("-_", "+/"))
    if "=" not in compact:
        if len(compact) % 4 == 1:
            raise RequestError("invalid_base64", f"the {kind} is not valid base64 (wrong length)", param)
        compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("invalid_base64", f"the {kind} is not valid base64", param) from None
    if not data:
        raise RequestError("invalid_base64", f"the base64 {kind} is empty", param)
    return data


def _local_file_bytes(spec: str, is_url: bool, policy: MediaPolicy, param: str, kind: str) -> bytes:
    import stat
    import urllib.parse

    if not policy.media_dir:
        message = "local files are disabled on this worker; send an https URL or base64"
        raise RequestError("blocked_url", message, param)
    path = spec
    if is_url:
        parts = urllib.parse.urlsplit(spec)
        if parts.netloc.lower() not in ("", "localhost") or parts.query or parts.fragment:
            raise RequestError(f"invalid_{kind}_url", "a file URL must look like file:///path/in/media/dir", param)
        path = urllib.parse.unquote(parts.path)
    if "\x00" in path or "\\" in path or ".." in path.split("/"):
        raise RequestError("blocked_url", "the path may not contain '..', backslashes or NUL", param)
    base = os.path.realpath(policy.media_dir)
    real = os.path.realpath(path if path.startswith("/") else os.path.join(base, path))
    if os.path.commonpath([base, real]) != base or real == base:
        raise RequestError("blocked_url", "the path is outside the media directory", param)
    try:  # O_NOFOLLOW|O_NONBLOCK: a symlink swapped in after realpath, or a FIFO, cannot hang or escape
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        missing = isinstance(error, FileNotFoundError)
        message = "no such file in the media directory" if missing else f"the local {kind} could not be read"
        raise RequestError("fetch_failed", message, param) from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RequestError("fetch_failed", "the local path is not a regular file", param)
        data = file.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise RequestError(f"{kind}_too_large", f"the {kind} is over {size_text(policy.max_image_bytes)}", param)
    return data


_OTHER_FORMATS = (
    (b"8BPS", "PSD"),
    (b"%PDF", "PDF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"qoif", "QOI"),
    (b"SIMPLE  =", "FITS"),
)


def _sniff_other(data: bytes) -> Optional[str]:
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<svg", b"<?xml", b"<!doctype svg", b"<!--")) and b"<svg" in data[:4096].lower():
        return "SVG"
    if data[4:8] == b"ftyp" and data[8:12] in (b"heic", b"heix", b"mif1", b"msf1", b"avif", b"avis"):
        return "HEIC/AVIF"
    return next((name for magic, name in _OTHER_FORMATS if data.startswith(magic)), None)


def decode_image(data: bytes, policy: MediaPolicy, param: str):
    """Bytes -> RGB image: allowed formats only, pixel cap from the header, frame 0, EXIF
    orientation, every mode to RGB (alpha over white). Messages are fixed: PIL's text leaks."""
    from PIL import Image, ImageOps

    allowed = ", ".join(IMAGE_FORMATS[:-1]) + " or " + IMAGE_FORMATS[-1]
    if other := _sniff_other(data):
        message = SVG_MESSAGE if other == "SVG" else f"{other} images are not supported; send {allowed}"
        raise RequestError("unsupported_image_format", message, param)
    if not data:
        raise RequestError("invalid_image_format", "the image is empty", param)
    too_large = RequestError("image_too_large", f"the image is over {policy.max_image_pixels} pixels", param)
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise too_large from None
    except Exception:  # UnidentifiedImageError and the plugins' own errors alike
        raise RequestError("invalid_image_format", f"the data is not a {allowed} image", param) from None
    with image:
        check_dimensions(*image.size, policy, param)
        try:
            image.load()  # frame 0 of an animation
            oriented = image
            with contextlib.suppress(Exception):  # a broken EXIF block costs the orientation, not the request
                oriented = ImageOps.exif_transpose(image)
            return _to_rgb(oriented)
        except Image.DecompressionBombError:
            raise too_large from None
        except MemoryError:
            raise RequestError("image_too_large", "the image is too large to decode", param) from None
        except Exception:
            raise RequestError("invalid_image_format", "the image is truncated or corrupt", param) from None


def check_dimensions(width: int, height: int, policy: MediaPolicy, param: str, kind: str = "image") -> None:
    """An image's (or a video frame's) size within the pixel cap and the smallest side."""
    subject = "the image is" if kind == "image" else f"the {kind}'s frames are"
    if width * height > policy.max_image_pixels:
        message = f"{subject} {width}x{height}, over {policy.max_image_pixels} pixels"
        raise RequestError(f"{kind}_too_large", message, param)
    if min(width, height) < policy.min_image_side:
        message = f"{subject} {width}x{height}; each side must be at least {policy.min_image_side} pixels"
        raise RequestError(f"{kind}_too_small", message, param)


def _to_rgb(image):
    """Any Pillow mode -> RGB. 16/32-bit and float greys are scaled, not clipped to white."""
    from PIL import Image

    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        low, high = image.getextrema()
        if mode.startswith("I;16") or (mode == "I" and 255 < high <= 65535 and low >= 0):
            scale, offset = 1 / 256, 0.0
        elif mode == "F" and low >= 0 and high <= 1.0:
            scale, offset = 255.0, 0.0
        elif low >= 0 and high <= 255:
            scale, offset = 1.0, 0.0
        else:
            scale = 255.0 / (high - low) if high > low else 1.0
            offset = -low * scale
        image = image.convert("F" if mode == "F" else "I").point(lambda v: v * scale + offset).convert("L")
        mode = "L"
    if mode == "LAB":  # Pillow's plain LAB->RGB convert copies channels; colour management is right
        from PIL import ImageCms

        transform = ImageCms.buildTransform(ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"), "LAB", "RGB")
        return ImageCms.applyTransform(image, transform)
    if mode in ("RGBA", "LA", "PA", "RGBa") or "transparency" in image.info:
        return Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")
