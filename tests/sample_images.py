"""Small test images and the data URIs requests carry them in."""

from __future__ import annotations

import base64
import io


def plain(color: str, size=(56, 56)):
    from PIL import Image

    return Image.new("RGB", size, color)


def png_bytes(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    return buffer.getvalue()


def data_uri(picture) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode()


def striped(size=(56, 56)):
    """An image with structure, so that different images give different vision features."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(picture)
    for x in range(0, size[0], 8):
        draw.rectangle([x, 0, x + 3, size[1]], fill=(x * 4 % 256, 40, 200))
    return picture
