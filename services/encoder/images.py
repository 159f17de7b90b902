"""What the encoder accepts as an image: the checks, and the decode. Pure (PIL only).

Contract (every refusal is an :class:`InputError` whose ``field`` names the request field,
e.g. ``images[1].data_url``, and whose message says what is wrong):

- :class:`ImageLimits`: ``max_images`` per request, ``max_bytes`` per image file,
  ``max_pixels`` (width × height) per image, the accepted ``formats`` (PIL names; PNG and
  JPEG by default), and ``remote_urls``: whether a request may name an image by an
  http(s) URL (the frontend's ``--allow-remote-images``; only the frontend fetches, see
  :mod:`services.frontend.remote_images`). ``validate()`` raises ValueError for a bad
  limit.
- :class:`ImageFlags`: the limits as config fields (``--max-images``,
  ``--max-image-bytes``, ``--max-pixels``), a dataclass mixin for the services that take
  images (the encoder, the frontend); ``limits()`` builds the :class:`ImageLimits`.
- :func:`check_count(n, limits)`: at least one image, at most ``max_images``.
- :func:`data_url_bytes(url, field, limits)`: the bytes of a ``data:image/<png|jpeg>;
  base64,<payload>`` URL (not a data: URL, another media type, no ``;base64``, bad
  base64 or over ``max_bytes``: refused; the size is checked before decoding).
- :func:`open_image(data, field, limits)`: the decoded RGB image; refused when empty,
  over ``max_bytes``, not an image, of a format not accepted, over ``max_pixels`` (read
  from the header, before the pixels are decoded) or truncated/corrupt.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from dataclasses import dataclass
from typing import Any

_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}


class InputError(ValueError):
    """A refused image or request, naming the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8
    max_bytes: int = 16 << 20
    max_pixels: int = 4096 * 4096
    formats: tuple[str, ...] = ("PNG", "JPEG")
    remote_urls: bool = False

    def validate(self) -> None:
        for name in ("max_images", "max_bytes", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.formats:
            raise ValueError("formats must not be empty")


@dataclass
class ImageFlags:
    """The image limits as config fields (see the module docstring)."""

    max_images: int = dataclasses.field(
        default=8, metadata={"help": "images per request at most"}
    )
    max_image_bytes: int = dataclasses.field(
        default=16 << 20, metadata={"help": "bytes per image file at most"}
    )
    max_pixels: int = dataclasses.field(
        default=4096 * 4096, metadata={"help": "pixels (width x height) per image at most"}
    )

    def limits(self) -> ImageLimits:
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_pixels)


def check_count(n: int, limits: ImageLimits) -> None:
    if n < 1:
        raise InputError("images", "at least one image is needed")
    if n > limits.max_images:
        raise InputError("images", f"at most {limits.max_images} images per request, got {n}")


def data_url_bytes(url: str, field: str, limits: ImageLimits) -> bytes:
    head, sep, payload = url.partition(",")
    if not head.startswith("data:") or not sep:
        raise InputError(field, "not a data: URL (data:image/png;base64,...)")
    media, _, encoding = head[len("data:"):].partition(";")
    if media.lower() not in _MEDIA_TYPES:
        raise InputError(field, f"media type {media!r} is not accepted "
                                f"(one of {', '.join(sorted(_MEDIA_TYPES))})")
    if encoding.lower() != "base64":
        raise InputError(field, "the data: URL must be base64 (;base64,)")
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise InputError(field, f"image over {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(field, f"not base64: {exc}") from exc


def open_image(data: bytes, field: str, limits: ImageLimits) -> Any:
    """The decoded image as PIL RGB (see the module docstring)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InputError(field, "empty image")
    if len(data) > limits.max_bytes:
        raise InputError(field, f"image of {len(data)} bytes, over {limits.max_bytes}")
    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise InputError(field, f"not an image: {exc}") from exc
    except Exception as exc:  # PIL's own decoders raise assorted errors on garbage
        raise InputError(field, f"not an image: {type(exc).__name__}: {exc}") from exc
    if img.format not in limits.formats:
        raise InputError(field, f"format {img.format} is not accepted "
                                f"(one of {', '.join(limits.formats)})")
    width, height = img.size
    if width * height > limits.max_pixels:
        raise InputError(field, f"{width}x{height} = {width * height} pixels, over "
                                f"{limits.max_pixels}")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as exc:  # truncated or corrupt pixel data
        raise InputError(field, f"not a valid {img.format}: {type(exc).__name__}: "
                                f"{exc}") from exc
