"""Every kvmesh process freezes its startup heap for the garbage collector
(:mod:`services.common.gc_heap`, through ``serve_main``): a frontend and a router, each a
process of its own, report ``kvmesh_gc_frozen_objects`` above 0 on their ``/metrics``;
with ``KVMESH_GC_FREEZE=0``, 0."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.procs import Child, free_port, spawn, wait_until
from services.launcher.up import CHILD_ENV


def _frozen(url: str) -> float | None:
    """``kvmesh_gc_frozen_objects`` at ``url``; None while nothing answers there."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "kvmesh_gc_frozen_objects":
            return float(family.samples[0].value)
    raise AssertionError(f"{url} exports no kvmesh_gc_frozen_objects:\n{text[:2000]}")


def _scraped(child: Child, url: str) -> float:
    seen: list[float] = []

    def answered() -> bool:
        value = _frozen(url)
        if value is not None:
            seen.append(value)
        return bool(seen)

    wait_until(answered, child, 180, f"{url} to answer")
    return seen[0]


@pytest.mark.parametrize("freeze", ["1", "0"])
@pytest.mark.parametrize("service", ["frontend", "router"])
def test_a_service_process_freezes_its_startup_heap(etcd: Child, log_dir: Path,
                                                    service: str, freeze: str) -> None:
    http = free_port()
    flags = (["--http-port", str(http)] if service == "frontend"
             else ["--metrics-port", str(http), "--indexer", "none"])
    argv = [sys.executable, "-m", f"services.{service}", "--etcd-endpoint", etcd.address,
            "--namespace", f"gc-{service}-{freeze}", "--port", str(free_port()), *flags]
    child = spawn(f"gc-{service}-{freeze}", argv, log_dir,
                  {**os.environ, **CHILD_ENV, "KVMESH_GC_FREEZE": freeze})
    try:
        frozen = _scraped(child, f"http://127.0.0.1:{http}/metrics")
    finally:
        child.stop()
    if freeze == "1":
        assert frozen > 0
    else:
        assert frozen == 0
