"""services.common.gc_heap: what a freeze keeps from the collector, the switch that turns
it off, and the collector's metrics."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.gc_heap import FREEZE_ENV, GcCollector, freeze_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """Each test starts and ends with no frozen object (the process's own heap given
    back to the collector)."""
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.collect()


def test_a_frozen_cycle_is_left_to_live() -> None:
    node = _Node()
    alive = weakref.ref(node)
    frozen = freeze_heap("a test")
    assert frozen == gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert alive() is not None  # the documented price: a frozen cycle is never freed
    gc.unfreeze()
    gc.collect()
    assert alive() is None


def test_garbage_is_collected_before_the_freeze() -> None:
    node = _Node()
    alive = weakref.ref(node)
    del node  # garbage already, so the freeze's collection frees it
    freeze_heap("a test")
    assert alive() is None


def test_a_freeze_after_a_freeze_adds_what_was_built_since() -> None:
    first = freeze_heap("a test")
    kept = [_Node() for _ in range(100)]
    assert freeze_heap("a test") >= first + len(kept)


def test_kvmesh_gc_freeze_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FREEZE_ENV, "0")
    node = _Node()
    alive = weakref.ref(node)
    assert freeze_heap("a test") == 0
    assert gc.get_freeze_count() == 0
    del node
    gc.collect()
    assert alive() is None


def test_the_collector_reports_the_frozen_count_and_the_collections() -> None:
    registry = CollectorRegistry()
    registry.register(GcCollector())
    freeze_heap("a test")
    gc.collect(0)
    text = generate_latest(registry).decode()
    assert f"kvmesh_gc_frozen_objects {float(gc.get_freeze_count())}" in text
    runs = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("kvmesh_gc_collections_total{")}
    assert set(runs) == {f'kvmesh_gc_collections_total{{generation="{g}"}}'
                         for g in range(3)}
    assert runs['kvmesh_gc_collections_total{generation="0"}'] >= 1
    assert 'kvmesh_gc_collected_objects_total{generation="2"}' in text
