"""The fault table: runs the fault suite (``tests/faults``) and writes what it recorded.

``python -m bench.faults`` runs ``pytest`` on :data:`SUITE` (``tests/faults`` plus the
tests that record fault rows: engine death on vLLM, Redis and store-master restarts,
``kvmesh up`` supervision) with ``KVMESH_FAULTS_JSON`` set to
``--out`` (default ``bench/results/faults.json``), then prints the table as Markdown, the
form the README carries (``--readme`` rewrites the README's table between its
``<!-- faults -->`` markers). The exit code is pytest's: a fault that did not hold fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.faults.table import markdown

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- faults -->", "<!-- /faults -->"
SUITE = ("tests/faults", "tests/integration/test_engine_death.py",
         "tests/integration/test_redis_restart.py", "tests/e2e/test_launcher.py")


def replace_table(readme: str, table: str) -> str:
    """``readme`` with the text between the fault markers replaced by ``table``."""
    head, sep, rest = readme.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"README has no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/faults.json")
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's fault table")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = ap.parse_args(argv)
    env = {**os.environ, "KVMESH_FAULTS_JSON": str(args.out.resolve())}
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *SUITE, *args.pytest_args], cwd=ROOT, env=env)
    rows = json.loads(args.out.read_text())["rows"]
    table = markdown(rows)
    print(table)
    if args.readme:
        readme = ROOT / "README.md"
        readme.write_text(replace_table(readme.read_text(), table))
    return rc
