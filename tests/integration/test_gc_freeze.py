"""Every kvmesh process freezes its startup heap for the garbage collector
(:mod:`services.common.gc_heap`, armed by ``serve_main``): a frontend and a router, each a
process of its own, report ``kvmesh_gc_frozen_objects`` above 0 on their ``/metrics``
(with ``KVMESH_GC_FREEZE=0``, 0), and the frontend freezes again once vLLM's tool parser
is imported; a ``KVMESH_GC_FREEZE`` other than 0 or 1 stops the process at once with
exit code 2, naming the variable."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.procs import Child, free_port, spawn, wait_until
from services.launcher.up import CHILD_ENV

# vLLM's tool parser import adds ~600 000 objects to a frontend's heap
PARSER_OBJECTS = 100_000


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


def _scraped(child: Child, url: str, at_least: float = 0.0) -> float:
    """The first ``kvmesh_gc_frozen_objects`` at ``url`` that is ``at_least``; raises
    when the child dies or 300 s pass first."""
    seen: list[float] = []

    def answered() -> bool:
        value = _frozen(url)
        if value is not None and value >= at_least:
            seen.append(value)
        return bool(seen)

    wait_until(answered, child, 300, f"{url} to answer with {at_least:.0f}+ frozen objects")
    return seen[0]


def _service(etcd: Child, log_dir: Path, service: str, switch: str) -> tuple[Child, str]:
    http = free_port()
    flags = (["--http-port", str(http)] if service == "frontend"
             else ["--metrics-port", str(http), "--indexer", "none"])
    argv = [sys.executable, "-m", f"services.{service}", "--etcd-endpoint", etcd.address,
            "--namespace", f"gc-{service}-{switch}", "--port", str(free_port()), *flags]
    child = spawn(f"gc-{service}-{switch}", argv, log_dir,
                  {**os.environ, **CHILD_ENV, "KVMESH_GC_FREEZE": switch})
    return child, f"http://127.0.0.1:{http}/metrics"


def test_the_frontend_freezes_its_heap_and_again_after_the_tool_parser(
        etcd: Child, log_dir: Path) -> None:
    child, url = _service(etcd, log_dir, "frontend", "1")
    said: list[int] = []

    def parser_frozen() -> bool:
        found = re.search(r"froze the heap after vLLM's tool parser: (\d+) objects",
                          child.log_path.read_text(errors="replace"))
        if found:
            said.append(int(found.group(1)))
        return bool(found)

    try:
        first = _scraped(child, url)
        assert first > 0
        wait_until(parser_frozen, child, 300, "the freeze after vLLM's tool parser")
        assert said[0] >= first + PARSER_OBJECTS  # the import is most of the heap
    finally:
        child.stop()


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_router_freezes_its_heap_unless_told_not_to(etcd: Child, log_dir: Path,
                                                         switch: str) -> None:
    child, url = _service(etcd, log_dir, "router", switch)
    try:
        frozen = _scraped(child, url)
    finally:
        child.stop()
    assert (frozen > 0) == (switch == "1")


def test_a_bad_switch_stops_the_process(etcd: Child, log_dir: Path) -> None:
    child, _ = _service(etcd, log_dir, "router", "off")
    try:
        assert child.proc.wait(timeout=120) == 2
    finally:
        child.stop()
    assert "KVMESH_GC_FREEZE must be 0 or 1, got 'off'" in child.log_path.read_text()
