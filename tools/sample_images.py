"""Small test images and the forms requests carry them in (raw base64, data URIs): the one image
helper of every suite (test_handler.py and tests/)."""

from __future__ import annotations

import base64
import io


def plain(color=(200, 30, 40), size=(56, 56), mode="RGB"):
    """A one-colour image; an RGB colour is adapted to the mode (first channel for L/P, opaque RGBA)."""
    from PIL import Image

    if isinstance(color, tuple) and mode in ("L", "P"):
        color = color[0]
    elif isinstance(color, tuple) and mode == "RGBA" and len(color) == 3:
        color = color + (255,)
    return Image.new(mode, size, color)


def striped(size=(56, 56)):
    """An image with structure, so that different images give different vision features."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(picture)
    for x in range(0, size[0], 8):
        draw.rectangle([x, 0, x + 3, size[1]], fill=(x * 4 % 256, 40, 200))
    return picture


def encode(picture, fmt="PNG", **save_options) -> bytes:
    """The image file's bytes, as Pillow writes them."""
    buffer = io.BytesIO()
    picture.save(buffer, fmt, **save_options)
    return buffer.getvalue()


def png(size=(16, 12), color=(200, 30, 40), mode="RGB") -> bytes:
    """A one-colour PNG file."""
    return encode(plain(color, size, mode))


def b64(image) -> str:
    """Raw base64 of an image file's bytes, or of a Pillow image written as PNG."""
    data = image if isinstance(image, bytes) else encode(image)
    return base64.b64encode(data).decode()


def data_uri(image, media="image/png") -> str:
    """A base64 data URI of an image file's bytes, or of a Pillow image written as PNG."""
    return f"data:{media};base64,{b64(image)}"
