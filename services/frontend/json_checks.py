"""JSON-level checks of a request body, before any field is read.

Contract:

- :func:`check_json` refuses (400, naming the JSON path) what would otherwise fail further
  down: nesting deeper than ``MAX_JSON_DEPTH``, and strings that are not valid Unicode
  (lone surrogates, which cannot be encoded as UTF-8 for protobuf). Given the JSON text
  the body was decoded from, it skips walking the body when that text cannot hold such a
  value: ASCII without NUL bytes (so read as UTF-8, and no surrogate but by a ``\\u``
  escape), no escape starting ``\\ud`` or ``\\uD``, and fewer than ``MAX_JSON_DEPTH``
  brackets (``[`` and ``{``, in strings too); the answer is the walk's (nothing to refuse).
"""

from __future__ import annotations

from typing import Any

from services.frontend.openai_schema import ApiError

MAX_JSON_DEPTH = 64
TOO_DEEP = "is nested too deeply"
_SCALARS = frozenset({int, float, bool, type(None)})


def _path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "body"


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_problem(value: Any, depth: int) -> tuple[tuple[str | int, ...], str] | None:
    """The path to the first too-deep value or invalid string, and what is wrong there.

    Numbers, booleans and None are skipped without building anything, so a long list of
    token ids costs one type check per item; paths are built only on the way back up
    from a problem.
    """
    if isinstance(value, str):
        return None if _valid_text(value) else ((), "is not valid Unicode (a lone surrogate)")
    if not isinstance(value, dict | list):
        return None
    if depth >= MAX_JSON_DEPTH:
        return (), TOO_DEEP
    if isinstance(value, list) and _SCALARS.issuperset(map(type, value)):
        return None  # e.g. token ids: one C-level pass, no per-item Python work
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(key, str) and not _valid_text(key):
            return (), "has a key that is not valid Unicode (a lone surrogate)"
        if isinstance(item, str | dict | list):
            found = _first_problem(item, depth + 1)
            if found is not None:
                return (key, *found[0]), found[1]
    return None


def _may_hold_a_problem(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` may decode to a lone surrogate or to nesting deeper
    than ``MAX_JSON_DEPTH`` (conservative: True may be a false alarm). ``json.loads``
    reads bytes in the encoding it detects (UTF-16 and -32 too) with surrogates let
    through, so only NUL-free ASCII is judged by its escapes."""
    return (not raw.isascii() or b"\0" in raw or b"\\ud" in raw or b"\\uD" in raw
            or raw.count(b"[") + raw.count(b"{") >= MAX_JSON_DEPTH)


def check_json(body: Any, raw: bytes | None = None) -> None:
    """Raises ApiError 400 for too deep nesting or invalid Unicode; see the module doc
    (``raw``: the JSON bytes ``body`` was decoded from, when there are some)."""
    if raw is not None and not _may_hold_a_problem(raw):
        return
    found = _first_problem(body, 0)
    if found is None:
        return
    path, problem = found
    if problem == TOO_DEEP:  # name the top-level field; the full path is 64 steps long
        raise ApiError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels under "
                       f"{_path(path[:1])}", param=_path(path[:1]) if path else None)
    raise ApiError(400, f"{_path(path)} {problem}", param=_path(path) if path else None)
