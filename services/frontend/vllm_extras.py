"""vLLM's decoding extensions of the sampling request, checked once for HTTP and gRPC.

Pure: no I/O. :func:`parse_extras(get)` reads, through ``get(name)`` (the HTTP body's
``dict.get``, or the gRPC ``SamplingParams`` read by :func:`from_proto`), the fields
vLLM's server takes beside OpenAI's, and returns the
:class:`~services.frontend.openai_schema.SamplingSpec` fields they set:

- ``bad_words``: a list of at most :data:`MAX_BAD_WORDS` non-blank strings, each at most
  :data:`MAX_BAD_WORD_BYTES` UTF-8 bytes (the workers' caps);
- ``allowed_token_ids``: a non-empty list of token ids (>= 0; at most
  :data:`MAX_ALLOWED_TOKEN_IDS`); checked against the model's vocabulary by
  :func:`vocab_problem`, as ``logit_bias`` is;
- ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``spaces_between_special_tokens``: booleans (null: vLLM's default, false / true / true).

Each problem is an :class:`~services.frontend.openai_schema.ApiError` 400 naming the
field. The worker hands them to vLLM's ``SamplingParams`` unchanged; an engine that does
not serve one (the mock) refuses it, naming ``sampling.<field>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protos import common_pb2
from services.frontend.openai_schema import ApiError, SamplingSpec
from workers.engines.base import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_BYTES, MAX_BAD_WORDS

FIELDS = ("bad_words", "allowed_token_ids", "include_stop_str_in_output",
          "skip_special_tokens", "spaces_between_special_tokens")
_DEFAULTS = {"include_stop_str_in_output": False, "skip_special_tokens": True,
             "spaces_between_special_tokens": True}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _words(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list | tuple) or not all(isinstance(w, str) for w in v):
        raise _bad("'bad_words' must be a list of strings", "bad_words")
    if len(v) > MAX_BAD_WORDS:
        raise _bad(f"'bad_words' takes at most {MAX_BAD_WORDS} words", "bad_words")
    for i, w in enumerate(v):
        if not w.strip() or len(w.encode("utf-8", "surrogatepass")) > MAX_BAD_WORD_BYTES:
            raise _bad(f"bad_words[{i}] must be a non-blank word of at most "
                       f"{MAX_BAD_WORD_BYTES} bytes", f"bad_words[{i}]")
    return tuple(v)


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if (not isinstance(v, list | tuple) or not v
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)):
        raise _bad("'allowed_token_ids' must be a non-empty list of token ids (>= 0)",
                   "allowed_token_ids")
    if len(v) > MAX_ALLOWED_TOKEN_IDS:
        raise _bad(f"'allowed_token_ids' takes at most {MAX_ALLOWED_TOKEN_IDS} ids",
                   "allowed_token_ids")
    return tuple(v)


def parse_extras(get: Callable[[str], Any]) -> dict[str, Any]:
    """The SamplingSpec fields of vLLM's decoding extensions (module docstring)."""
    out: dict[str, Any] = {"bad_words": _words(get("bad_words")),
                           "allowed_token_ids": _ids(get("allowed_token_ids"))}
    for name, default in _DEFAULTS.items():
        v = get(name)
        if v is not None and not isinstance(v, bool):
            raise _bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
        out[name] = default if v is None else v
    return out


def from_proto(s: common_pb2.SamplingParams) -> dict[str, Any]:
    """:func:`parse_extras` of a gRPC request's ``sampling``."""
    def get(name: str) -> Any:
        if name in ("bad_words", "allowed_token_ids"):
            return list(getattr(s, name)) or None
        if name == "include_stop_str_in_output":
            return s.include_stop_str_in_output
        return getattr(s, name) if s.HasField(name) else None

    return parse_extras(get)


def to_proto(s: SamplingSpec, p: common_pb2.SamplingParams) -> None:
    """Sets ``s``'s extensions on the workers' ``p`` (defaults left unset)."""
    p.bad_words.extend(s.bad_words)
    p.allowed_token_ids.extend(s.allowed_token_ids)
    p.include_stop_str_in_output = s.include_stop_str_in_output
    if not s.skip_special_tokens:
        p.skip_special_tokens = False
    if not s.spaces_between_special_tokens:
        p.spaces_between_special_tokens = False


def vocab_problem(s: SamplingSpec, vocab_size: int) -> ApiError | None:
    """A 400 for a ``logit_bias`` or ``allowed_token_ids`` id outside the vocabulary."""
    bad = next((t for t, _ in s.logit_bias if t >= vocab_size), None)
    if bad is not None:
        return _bad(f"logit_bias token id {bad} is out of the model's vocabulary (size "
                    f"{vocab_size})", "logit_bias")
    bad = next((t for t in s.allowed_token_ids if t >= vocab_size), None)
    if bad is not None:
        return _bad(f"allowed_token_ids: token id {bad} is out of the model's vocabulary "
                    f"(size {vocab_size})", "allowed_token_ids")
    return None
