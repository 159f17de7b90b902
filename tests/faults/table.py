"""The fault table: one row per fault the suite injected, written as JSON at the end.

Contract: :class:`FaultTable` ``record(fault, expected, observed, count=1, **numbers)``
adds a row (``numbers`` are measurements such as reaction seconds: reported, never
asserted) and returns whether ``observed == expected`` so the test can assert on it after
the row is kept, failures included. ``write(path)`` writes ``{"rows": [...]}`` sorted by
fault. :func:`markdown` renders rows as the README's table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Row:
    fault: str
    expected: str
    observed: str
    count: int = 1
    held: bool = True
    numbers: dict[str, float] = field(default_factory=dict)


@dataclass
class FaultTable:
    rows: list[Row] = field(default_factory=list)

    def record(self, fault: str, expected: str, observed: str, count: int = 1,
               **numbers: float) -> bool:
        held = observed == expected
        self.rows.append(Row(fault, expected, observed, count, held,
                             {k: round(v, 3) for k, v in numbers.items()}))
        return held

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = sorted((asdict(r) for r in self.rows), key=lambda r: r["fault"])
        path.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (fault, expected, observed, count, numbers)."""
    out = ["| fault | expected | observed | count | measured |", "|---|---|---|---|---|"]
    for r in rows:
        nums = ", ".join(f"{k} {v:g}" for k, v in r.get("numbers", {}).items())
        mark = "" if r["held"] else " **(did not hold)**"
        out.append(f"| {r['fault']} | {r['expected']} | {r['observed']}{mark} | "
                   f"{r['count']} | {nums} |")
    return "\n".join(out)
