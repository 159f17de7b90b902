"""The parser's plain paths (a body without the rarely given fields gets their absent
values at once) against its general ones: the same ParsedRequest, or the same 400 naming
the same field, over randomized bodies of every accepted field with good and bad values."""

from __future__ import annotations

import random
from typing import Any

import pytest

from services.frontend import openai_schema as schema
from services.frontend.openai_fields import NO_EFFECT, SUPPORTED
from services.frontend.openai_schema import ApiError

# Values tried for any field: right for some, wrong for most.
_ANY: list[Any] = [None, True, False, 0, 1, 2, -1, 7, 0.5, 1.5, 3.0, "", "x", "left",
                   [], [1, 2], ["a"], ["a", ""], {}, {"type": "text"},
                   {"type": "json_object"}, {"json": {"type": "object"}}, {"5": 1.0},
                   {"include_usage": True}, 2 ** 40]
# Fields a body usually holds, with values that pass: the plain paths' case.
_COMMON: dict[str, list[Any]] = {
    "max_tokens": [1, 16, 100, None], "temperature": [0, 0.7, 1.0, None],
    "top_p": [1.0, 0.9, None], "seed": [0, 42, None], "ignore_eos": [True, False, None],
    "stream": [False, True, None], "n": [1, 2, None], "user": ["u"],
}


def _body(rng: random.Random, fields: list[str], prompt_key: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": rng.choice(["m", "m", "", 3]) if rng.random() < 0.1
                            else "m"}
    if prompt_key == "prompt":
        body["prompt"] = rng.choice([[1, 2, 3], "hello", ["a", "b"], [[1], [2, 3]], [-1],
                                     []]) if rng.random() < 0.2 else [1, 2, 3]
    for name, values in _COMMON.items():
        if rng.random() < 0.5:
            body[name] = rng.choice(values)
    if rng.random() < 0.5:  # some rarely given fields too, good values or bad
        for name in rng.sample(fields, rng.randint(1, 3)):
            body[name] = rng.choice(_ANY)
    return body


def _general(body: dict[str, Any]) -> Any:
    """parse_completion with every field read: its general path, whose sampling part is
    the general one too (``_sampling`` swapped for ``_sampling_all`` during the call)."""
    fast = schema._sampling
    schema._sampling = schema._sampling_all  # type: ignore[assignment]
    try:
        schema._check_fields(body, "completion")
        return schema._parse_completion_all(body)
    finally:
        schema._sampling = fast  # type: ignore[assignment]


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return "ok", fn(*args)
    except ApiError as exc:
        return "400", exc.status, exc.message, exc.param


def test_a_completion_body_parses_alike_on_both_paths() -> None:
    rng = random.Random(17)
    fields = sorted(SUPPORTED["completion"] - {"model", "prompt"} | NO_EFFECT)
    plain = 0
    for _ in range(4000):
        body = _body(rng, fields, "prompt")
        fast = _outcome(schema.parse_completion, dict(body))
        assert fast == _outcome(_general, dict(body)), body
        plain += schema._RARE_COMPLETION.isdisjoint(body) and fast[0] == "ok"
    assert plain > 1000  # the plain path did parse


@pytest.mark.parametrize("names,default", [(("max_tokens",), 16),
                                           (("max_completion_tokens", "max_tokens"), None)])
def test_sampling_fields_read_alike_on_both_paths(names: tuple[str, ...],
                                                  default: int | None) -> None:
    rng = random.Random(3)
    fields = sorted((SUPPORTED["completion"] | SUPPORTED["chat"]) - {"model", "prompt"})
    plain = 0
    for _ in range(4000):
        body = _body(rng, fields, "messages")
        if rng.random() < 0.2:
            body["max_completion_tokens"] = rng.choice([5, 0, None, "x"])
        fast = _outcome(schema._sampling, body, names, default)
        assert fast == _outcome(schema._sampling_all, body, names, default), body
        plain += schema._RARE_SAMPLING.isdisjoint(body) and fast[0] == "ok"
    assert plain > 1000


def test_every_field_the_general_path_reads_is_named() -> None:
    """A field the general path reads but the rare sets miss would be ignored by the plain
    path: every accepted field, alone with each value tried, parses alike on both."""
    common = {"model", "prompt", "messages"}
    for name in sorted((SUPPORTED["completion"] | SUPPORTED["chat"]) - common):
        for value in _ANY:
            body = {"model": "m", "prompt": [1], name: value}
            if name in SUPPORTED["completion"]:
                assert _outcome(schema.parse_completion, dict(body)) == \
                    _outcome(_general, dict(body)), (name, value)
            assert _outcome(schema._sampling, body, ("max_tokens",), 16) == \
                _outcome(schema._sampling_all, body, ("max_tokens",), 16), (name, value)
