"""services.common.gc_heap: nothing happens before ``arm``; what a freeze keeps from the
collector; the switch that turns it off and refuses other values; the metrics; and
serve_main's two freezes, around the app's start."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common import gc_heap
from services.common import server as server_mod
from services.common.config import BaseConfig
from services.common.gc_heap import FREEZE_ENV, arm, freeze_heap, register_gc_metrics


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def _tracked(obj: object) -> bool:
    """Whether collections still traverse ``obj`` (gc.get_objects leaves frozen ones out)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts unarmed with no frozen object and ends so (this process's heap
    given back to the collector)."""
    monkeypatch.delenv(FREEZE_ENV, raising=False)
    gc_heap.disarm()
    gc.unfreeze()
    yield
    gc_heap.disarm()
    gc.unfreeze()
    gc.collect()


def test_nothing_is_frozen_before_arm() -> None:
    node = _Node()
    assert freeze_heap("a test") == 0
    assert gc.get_freeze_count() == 0 and _tracked(node)


def test_a_frozen_cycle_is_left_to_live() -> None:
    assert arm()
    node = _Node()
    alive = weakref.ref(node)
    frozen = freeze_heap("a test")
    # the permanent generation only shrinks after the freeze (frozen objects another
    # thread frees leave it): the count read again is at most the one returned
    assert frozen >= gc.get_freeze_count() > 0
    assert not _tracked(node)
    del node
    gc.collect()
    assert alive() is not None  # the documented price: a frozen cycle is never freed
    gc.unfreeze()
    gc.collect()
    assert alive() is None


def test_garbage_is_collected_before_the_freeze_unless_told_not_to() -> None:
    arm()
    node = _Node()
    alive = weakref.ref(node)
    del node  # garbage already: the freeze's collection frees it
    freeze_heap("a test")
    assert alive() is None
    node = _Node()
    alive = weakref.ref(node)
    del node
    freeze_heap("a test", collect=False)  # frozen as it is, garbage included
    gc.collect()
    assert alive() is not None


def test_a_freeze_after_a_freeze_adds_what_was_built_since() -> None:
    arm()
    first = freeze_heap("a test")
    kept = [_Node() for _ in range(100)]
    assert freeze_heap("a test") >= first + len(kept)


def test_kvmesh_gc_freeze_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FREEZE_ENV, "0")
    assert arm() is False
    node = _Node()
    alive = weakref.ref(node)
    assert freeze_heap("a test") == 0
    assert gc.get_freeze_count() == 0
    del node
    gc.collect()
    assert alive() is None


def test_other_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FREEZE_ENV, "off")
    with pytest.raises(ValueError, match=f"{FREEZE_ENV} must be 0 or 1, got 'off'"):
        arm()
    assert freeze_heap("a test") == 0


def test_serve_main_refuses_a_bad_switch_before_starting(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(FREEZE_ENV, "yes")
    started: list[bool] = []

    async def start(cfg: BaseConfig) -> object:
        started.append(True)
        raise AssertionError("started")

    assert server_mod.serve_main(BaseConfig, [], "gc-test", start) == 2  # type: ignore[arg-type]
    assert started == []
    assert FREEZE_ENV in capsys.readouterr().err


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in generate_latest(registry).decode().splitlines()
            if line and not line.startswith("#")}


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_metrics(monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    monkeypatch.setenv(FREEZE_ENV, switch)
    registry = CollectorRegistry()
    register_gc_metrics(registry)
    arm()
    before = _samples(registry)
    freeze_heap("a test")
    gc.collect(0)
    # frozen objects another thread frees leave the permanent generation, so the count
    # only shrinks after the freeze: the scraped gauge lies between the reads around it
    high = gc.get_freeze_count()
    after = _samples(registry)
    assert high >= after["kvmesh_gc_frozen_objects"] >= gc.get_freeze_count()
    assert (after["kvmesh_gc_frozen_objects"] > 0) == (switch == "1")
    runs, spent = ('kvmesh_gc_pause_seconds_count{generation="0"}',
                   'kvmesh_gc_pause_seconds_sum{generation="0"}')
    assert after[runs] >= before[runs] + 1  # timed, frozen or not
    assert after[spent] > before[spent]
    buckets = [after[f'kvmesh_gc_pause_seconds_bucket{{generation="0",le="{le}"}}']
               for le in (*map(str, gc_heap.PAUSE_BUCKETS[:-1]), "+Inf")]
    assert buckets == sorted(buckets) and buckets[-1] == after[runs]
    assert 'python_gc_collections_total{generation="2"}' in after


@dataclass
class _App:
    fatal: asyncio.Future[str]

    async def stop(self) -> None:
        return None


async def test_serve_main_freezes_the_imports_and_what_start_built() -> None:
    arm()
    before_start = _Node()
    built: list[_Node] = []

    async def start(cfg: BaseConfig) -> _App:
        assert not _tracked(before_start)  # frozen before start
        built.append(_Node())
        fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        fatal.set_result("the test is over")
        return _App(fatal)

    loop = asyncio.get_running_loop()
    try:
        code = await server_mod._serve_until_signal(start, BaseConfig(), "gc-test")
    finally:
        for sig in server_mod.signal.SIGTERM, server_mod.signal.SIGINT:
            loop.remove_signal_handler(sig)
    assert code == server_mod.FATAL_EXIT
    assert not _tracked(built[0])  # frozen once start returned
