"""vLLM's ``structured_outputs`` request field: a constraint other than ``response_format``.

Pure: no I/O. :func:`parse_structured_outputs(value)` checks the field of a completions or
chat body (vLLM's ``StructuredOutputsParams``) and returns the
:class:`~services.frontend.openai_schema.Structured` the worker constrains decoding with.
Exactly one kind: ``json`` (a JSON schema, as an object or as JSON text), ``regex``,
``choice`` (a non-empty list of strings), ``grammar`` (EBNF / GBNF text) or
``json_object: true``. Sizes: the schema's compact JSON, the regex and the grammar each at
most :data:`~services.frontend.openai_schema.MAX_STRUCTURED_BYTES` (UTF-8); at most
:data:`MAX_CHOICES` strings of at most that many bytes in all. Every problem is an
:class:`~services.frontend.openai_schema.ApiError` 400 naming ``structured_outputs.<key>``.

The options vLLM applies per engine, not per request (``disable_any_whitespace``,
``disable_additional_properties``, ``whitespace_pattern``), and ``structural_tag``, are
refused unless set to their no-op value (false / null): a request asking for them must not
get output that ignores them. Whether the constraint itself is valid (a regex that does
not compile, a grammar that does not parse) is vLLM's own check on the worker, answered
as a 400 naming ``sampling.structured`` before the engine sees it.

``response_format`` and ``structured_outputs`` together are a 400 naming
``structured_outputs`` (vLLM lets one silently override the other); so is
``structured_outputs`` with a forced tool call (:func:`.tools.conflict`).
"""

from __future__ import annotations

import json
from typing import Any

from services.frontend.openai_schema import MAX_STRUCTURED_BYTES, ApiError, Structured

MAX_CHOICES = 1024  # strings of one choice constraint, as the workers cap them
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's per-engine options and structural tags: only their no-op values.
NO_OP = {"disable_any_whitespace": (False, None), "disable_additional_properties": (False, None),
         "whitespace_pattern": (None,), "structural_tag": (None,)}


def _bad(message: str, key: str | None = None) -> ApiError:
    param = "structured_outputs" if key is None else f"structured_outputs.{key}"
    return ApiError(400, message, param=param)


def _sized(text: str, key: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_STRUCTURED_BYTES:
        raise _bad(f"structured_outputs.{key} is {size} bytes; at most "
                   f"{MAX_STRUCTURED_BYTES}", key)
    return text


def _schema(v: Any) -> Structured:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as exc:
            raise _bad(f"structured_outputs.json is not JSON: {exc}", "json") from None
    if not isinstance(v, dict):
        raise _bad("structured_outputs.json must be a JSON schema object (or its JSON text)",
                   "json")
    return Structured("json_schema", _sized(json.dumps(v, separators=(",", ":")), "json"))


def _choice(v: Any) -> Structured:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
        raise _bad("structured_outputs.choice must be a non-empty list of strings", "choice")
    if len(v) > MAX_CHOICES:
        raise _bad(f"structured_outputs.choice takes at most {MAX_CHOICES} strings",
                   "choice")
    _sized("".join(v), "choice")
    return Structured("choice", choices=tuple(v))


def _text(v: Any, key: str) -> Structured:
    if not isinstance(v, str) or not v:
        raise _bad(f"structured_outputs.{key} must be a non-empty string", key)
    return Structured(key, _sized(v, key))


def parse_structured_outputs(value: Any) -> Structured | None:
    """The constraint ``value`` asks for; None for null (module docstring)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("'structured_outputs' must be an object")
    for key, v in value.items():
        if key in NO_OP:
            if not any(type(v) is type(ok) and v == ok for ok in NO_OP[key]):
                raise _bad(f"structured_outputs.{key} is not supported by kvmesh (vLLM sets it "
                           "per engine, not per request)", key)
        elif key not in KINDS:
            raise _bad(f"Unrecognized key in structured_outputs: '{key}'", key)
    kinds = [k for k in KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise _bad("structured_outputs takes exactly one of " + ", ".join(KINDS)
                   + f"; got {', '.join(kinds) or 'none'}")
    kind = kinds[0]
    v = value[kind]
    if kind == "json":
        return _schema(v)
    if kind == "choice":
        return _choice(v)
    if kind == "json_object":
        if v is not True:
            raise _bad("structured_outputs.json_object must be true", "json_object")
        return Structured("json_object")
    return _text(v, kind)


def combined(response_format: Structured | None, body: dict[str, Any]) -> Structured | None:
    """The request's one constraint: ``response_format``'s or ``structured_outputs``'s; a
    400 naming ``structured_outputs`` when both ask for one."""
    extra = parse_structured_outputs(body.get("structured_outputs"))
    if extra is not None and response_format is not None:
        raise _bad("structured_outputs cannot be combined with a response_format other "
                   "than 'text'")
    return extra if extra is not None else response_format
