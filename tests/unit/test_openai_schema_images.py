"""Chat image parts (EPD): data: URLs parsed, every refusal a 400 naming the field; text
parts unchanged. The pixel checks (need a decode) run in the pipeline: mm_prompt."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from services.encoder.images import ImageLimits, InputError
from services.frontend.openai_schema import ApiError, parse_chat


def _png(size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _body(*parts: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def _image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is this?"}


def test_image_parts_become_parts_and_bytes() -> None:
    png = _png()
    req = parse_chat(_body(_image(_url(png)), TEXT,
                           {"type": "image_url", "image_url": _url(png, "image/jpeg")}))
    assert req.messages == (("user", (("image", ""), ("text", "What is this?"),
                                      ("image", ""))),)
    assert [p.data for p in req.images] == [png, png]
    assert req.images[0].field == "messages[0].content[0].image_url.url"
    assert req.images[1].field == "messages[0].content[2].image_url"


def test_text_only_stays_a_string() -> None:
    req = parse_chat(_body(TEXT, {"type": "text", "text": " More."}))
    assert req.messages == (("user", "What is this? More."),) and req.images == ()


@pytest.mark.parametrize(("part", "param", "words"), [
    (_image("data:image/png;base64,%%%"), "messages[0].content[1].image_url.url",
     "not base64"),
    (_image("https://example.com/cat.png"), "messages[0].content[1].image_url.url",
     "remote image URLs are not supported"),
    (_image("HTTP://example.com/cat.png"), "messages[0].content[1].image_url.url",
     "remote image URLs are not supported"),
    (_image("file:///etc/passwd"), "messages[0].content[1].image_url.url",
     "not a data: URL"),
    (_image("data:image/gif;base64,R0lG"), "messages[0].content[1].image_url.url",
     "media type 'image/gif' is not accepted"),
    (_image(""), "messages[0].content[1].image_url.url", "non-empty string"),
    ({"type": "image_url"}, "messages[0].content[1].image_url", "non-empty string"),
    ({"type": "input_audio"}, "messages[0].content[1]", "must be a text part"),
])
def test_bad_image_parts_are_400_naming_the_field(part: dict[str, Any], param: str,
                                                  words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat(_body(TEXT, part))
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message, info.value.message


def test_too_many_images_and_too_many_bytes() -> None:
    url = _url(_png())
    with pytest.raises(ApiError) as info:
        parse_chat(_body(_image(url), _image(url), _image(url)), ImageLimits(max_images=2))
    assert info.value.param == "messages[0].content[2]"
    assert "at most 2 images" in info.value.message
    with pytest.raises(ApiError) as info:
        parse_chat(_body(_image(_url(_png(64)))), ImageLimits(max_bytes=100))
    assert "over 100 bytes" in info.value.message


def test_not_an_image_and_too_many_pixels_fail_in_the_decode() -> None:
    from services.frontend.images import mm_prompt

    class NoExpander:  # never reached: the checks come first
        def expand(self, *a: Any) -> Any:
            raise AssertionError("expanded a bad image")

    limits = ImageLimits(max_pixels=32 * 32)
    for data, words in ((b"GIF89a nope", "not an image"), (_png(33), "33x33 = 1089 pixels")):
        with pytest.raises(InputError) as info:
            mm_prompt([1, 2], [("messages[0].content[0].image_url.url", data)], "", limits,
                      NoExpander())  # type: ignore[arg-type]
        assert info.value.field == "messages[0].content[0].image_url.url"
        assert words in str(info.value)
