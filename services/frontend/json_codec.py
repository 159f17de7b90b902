"""The frontend's JSON codec on the request path: msgspec (C) where it answers, the
standard library where it refuses.

msgspec (a vLLM dependency: its engine core's messages) decodes a request body 4-5 times
faster than ``json.loads`` and encodes an answer ~9 times faster than starlette's
``json.dumps``; on this 2-core machine every µs of the frontend's loop is a µs of every
request's latency.

Contract:

- :func:`decode` returns exactly what ``json.loads(raw)`` returns, and raises what it
  raises (ValueError for malformed JSON or bad UTF-8, RecursionError for nesting deeper
  than Python's stack): msgspec decodes strict JSON, and whatever it refuses (NaN or
  Infinity literals, a lone surrogate escape, a number beyond float or 64-bit range,
  nesting beyond its limit) is decoded again by ``json.loads``, so the frontend's
  checks and their messages (the field that is wrong) are those of the standard library
  path.
- :func:`encode`: compact UTF-8 JSON, non-ASCII as is (``ensure_ascii=False``), keys in
  the dict's order. A NaN or infinite float is written ``null``, as pydantic (vLLM's
  server) writes it; log-probabilities are clamped before (see :mod:`.shapes`). What
  msgspec cannot encode as UTF-8 (a string holding a lone surrogate) is written by
  ``json.dumps`` instead, ASCII-only with ``\\u`` escapes, as the frontend wrote every
  stream chunk before. Floats may be spelled differently from ``json.dumps``
  (``0.00001`` for ``1e-05``): the same values.
- :class:`JsonAnswer`: a starlette ``Response`` of ``encode(content)``,
  ``application/json``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from starlette.responses import Response

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def decode(raw: bytes) -> Any:
    """``json.loads(raw)`` (see the module docstring)."""
    try:
        return _decoder.decode(raw)
    except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
        return json.loads(raw)


def encode(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON (see the module docstring)."""
    try:
        return _encoder.encode(obj)
    except (ValueError, msgspec.EncodeError):  # UnicodeEncodeError: a lone surrogate
        return json.dumps(obj, separators=(",", ":")).encode()


class JsonAnswer(Response):
    """A JSON answer encoded by :func:`encode`."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return encode(content)
