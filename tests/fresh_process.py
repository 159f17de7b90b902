"""Runs a probe script in a fresh Python process: for what is process-global (the
tracer provider, the event loop policy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_probe(script: str, **env: str) -> dict[str, Any]:
    """Runs ``script`` with ``env`` over this process's environment less its ``OTEL_*``
    and ``KVMESH_*`` variables; returns the JSON object its last stdout line prints. A
    probe that exits non-zero or runs past 120 s fails the test."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVMESH_"))}
    out = subprocess.run([sys.executable, "-c", script], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got
