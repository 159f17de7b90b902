"""The README's "OpenAI compatibility" table cannot drift from the parity cases: every
row whose "vLLM server" cell is not "—" cites its case as parity `[<key>]` in its
"checked by" cell, each key of tests/compat/cases.py's registry is cited by exactly one
row, and the section says which test runs them (vLLM's own server beside kvmesh). Also
the cases' comparison: only the README's multi-byte difference is let through."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.compat.cases import CASES, Token, assert_same

README = Path(__file__).resolve().parents[2] / "README.md"
PARITY = re.compile(r"parity `\[([^\]`]+)\]`")
TEST = "test_vllm_server_parity.py::test_case_passes_on_both"


def section(text: str, title: str = "## OpenAI compatibility") -> str:
    """The README section under ``title``, up to the next ``## `` heading."""
    start = text.index(title + "\n")
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def table_rows(sec: str) -> list[list[str]]:
    """The table's body rows as their four cells (feature, vLLM server, kvmesh, checked
    by); the header and the separator line are left out."""
    lines = [ln for ln in sec.splitlines() if ln.startswith("|")]
    assert len(lines) > 2 and lines[0].startswith("| feature | vLLM server |"), lines[:1]
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split(" | ")]
        assert len(cells) == 4, ln
        rows.append(cells)
    return rows


def cited(rows: list[list[str]]) -> dict[str, str]:
    """key -> the feature cell of the row citing it; raises AssertionError on a row that
    serves vLLM without a parity key, a "—" row with one, or a key cited twice."""
    keys: dict[str, str] = {}
    for feature, vllm, _kvmesh, checked in rows:
        found = PARITY.findall(checked)
        if vllm == "—":
            assert not found, f"{feature!r}: vLLM has no such feature, yet cites {found}"
            continue
        assert found, f"{feature!r}: the vLLM server cell {vllm!r} cites no parity case"
        for key in found:
            assert key not in keys, f"parity [{key}] cited by {keys[key]!r} and {feature!r}"
            keys[key] = feature
    return keys


def test_every_vllm_cell_is_backed_by_a_parity_case() -> None:
    sec = section(README.read_text())
    keys = cited(table_rows(sec))
    assert set(keys) == set(CASES), (
        f"cited, no case: {sorted(set(keys) - set(CASES))}; "
        f"case, not cited: {sorted(set(CASES) - set(keys))}")
    assert TEST in sec and "vLLM's own" in sec, "the section must say which test runs them"


HEADER = "| feature | vLLM server | kvmesh | checked by |\n|---|---|---|---|\n"


@pytest.mark.parametrize("body,words", [
    ("| `n` | yes | yes | `t.py` |\n", "cites no parity case"),
    ("| gRPC | — | yes | parity `[n_choices]` |\n", "vLLM has no such feature"),
    ("| a | yes | yes | parity `[k]` |\n| b | yes | yes | parity `[k]` |\n", "cited by"),
    ("| a | yes | yes | parity `[k]` | extra |\n", "extra"),
])
def test_a_drifted_table_is_caught(body: str, words: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(words)):
        cited(table_rows(HEADER + body))


def test_a_dash_row_needs_no_case() -> None:
    assert cited(table_rows(HEADER + "| gRPC | — | yes | `t.py` |\n"
                            "| n | yes | yes | `t.py`; parity `[n]` |\n")) == {"n": "n"}


def test_assert_same_accepts_only_the_known_multibyte_difference() -> None:
    """kvmesh's U+FFFD fragment against vLLM's corrected token passes; any other token,
    text or log-probability difference fails, naming where."""
    assert_same([Token("\ufffd"), -1.0], [Token(""), -1.0002])
    for got, ref, where in [([Token("a"), -1.0], [Token(""), -1.0], "r[0]"),
                            ([Token("a"), -1.0], [Token("a"), -1.01], "r[1]"),
                            ({"text": "\ufffd"}, {"text": ""}, "r.text"),
                            ({"u": (3, 4)}, {"u": (3, 5)}, "r.u[1]")]:
        with pytest.raises(AssertionError, match=re.escape(where)):
            assert_same(got, ref, "r")
