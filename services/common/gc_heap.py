"""Python's garbage collector and a long-running process's startup heap.

A full (oldest-generation) collection traverses every container object the process
holds. A frontend holds ~650 000 of them once vLLM's tool parser, transformers and a
tokenizer are imported, and one full collection of that heap took 330-440 ms here
(``python -m bench.gc_pause``): a stall of the event loop, so of every request in
flight. CPython 3.11 runs one after ten generation-1 collections once the objects that
survived younger collections since the last full one reach a quarter of the old
generation, so a server whose long-lived state grows (an embedded KV index, caches)
meets them now and then, at random. vLLM's API server and engine core freeze their heap
after startup, SGLang's server after its warm-up; so does every kvmesh process.

Contract:

- :func:`arm` (called by :func:`services.common.server.serve_main`, the entry point of
  every kvmesh process, never by library code): reads ``KVMESH_GC_FREEZE``
  (:data:`FREEZE_ENV`: ``1`` or unset: freeze; ``0``: do not; anything else is a
  ValueError naming the variable) and times every collection from then on, frozen or
  not, for ``kvmesh_gc_pause_seconds``. Until a process is armed (a test process, a
  library user) :func:`freeze_heap` does nothing. :func:`disarm` undoes it (tests).
- :func:`freeze_heap` ``(what, collect=True)``: in an armed process that freezes, a full
  collection (unless ``collect`` is False), then ``gc.freeze()``: every object alive
  now moves to the permanent generation, which no collection traverses. Returns the
  number of objects frozen in all (``gc.get_freeze_count()``; 0 when it did nothing)
  and logs it with ``what`` (what was just built) at info level. Each call freezes what
  was built since the previous one, and its collection traverses only that.
  ``serve_main`` calls it before the app starts (the imports) and once it has started;
  the frontend once vLLM's tool parser is imported (:mod:`services.frontend.tool_chat`),
  without the collection: that one runs while requests are served, and collecting the
  import's ~600 000 objects would stall them once for about as long as a full
  collection.
- The price: an object alive at a freeze that later becomes garbage in a reference
  cycle is never freed (objects freed by their reference count, most of them, are
  freed as usual). That is bounded by what is alive at each freeze: the startup
  heap, and at the tool parser's freeze also the garbage not yet collected and the
  requests then in flight.
- :func:`register_gc_metrics` adds to a service's registry prometheus_client's
  ``python_gc_*`` (collections, collected and uncollectable objects, by generation)
  and :class:`GcCollector`'s ``kvmesh_gc_frozen_objects`` (gauge: objects in the
  permanent generation) and ``kvmesh_gc_pause_seconds{generation}`` (histogram: each
  collection's wall time since :func:`arm`). They describe the process: each endpoint
  of a process serving several (a fleet's workers, a frontend with its embedded
  router's) repeats them.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# "0" leaves the startup heap to the collector (no gc.freeze); "1" (the default) freezes.
FREEZE_ENV = "KVMESH_GC_FREEZE"
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, float("inf"))


class _Pauses:
    """Collection wall times by generation (a ``gc.callbacks`` hook). CPython runs one
    collection at a time, its start and stop callbacks on one thread, so there is one
    writer; each generation's ``(bucket counts, sum)`` is replaced in one assignment, so
    a scrape from another thread reads a consistent pair."""

    def __init__(self) -> None:
        empty = (tuple(0 for _ in PAUSE_BUCKETS), 0.0)
        self.by_generation: list[tuple[tuple[int, ...], float]] = [empty] * 3
        self._began: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
            return
        began, self._began = self._began, None
        gen = info.get("generation")
        if began is None or not isinstance(gen, int) or not 0 <= gen < 3:
            return
        took = now - began
        counts, total = self.by_generation[gen]
        slot = next(i for i, bound in enumerate(PAUSE_BUCKETS) if took <= bound)
        self.by_generation[gen] = (counts[:slot] + (counts[slot] + 1,) + counts[slot + 1:],
                                   total + took)


_armed = False
_freezing = False
_pauses = _Pauses()


def arm() -> bool:
    """Lets :func:`freeze_heap` act in this process, as ``KVMESH_GC_FREEZE`` says;
    returns whether it freezes (see the module docstring). Idempotent."""
    global _armed, _freezing
    value = os.environ.get(FREEZE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{FREEZE_ENV} must be 0 or 1, got {value!r}")
    _armed, _freezing = True, value == "1"
    if _pauses not in gc.callbacks:
        gc.callbacks.append(_pauses)
    return _freezing


def disarm() -> None:
    """Undoes :func:`arm` (for tests): :func:`freeze_heap` does nothing again and
    collections are no longer timed (the counts so far stay)."""
    global _armed, _freezing
    _armed = _freezing = False
    if _pauses in gc.callbacks:
        gc.callbacks.remove(_pauses)


def freeze_heap(what: str, collect: bool = True) -> int:
    """Collects (unless ``collect`` is False), then freezes every object alive, in an
    armed process that freezes; returns the frozen count, else 0 (module docstring)."""
    if not (_armed and _freezing):
        return 0
    if collect:
        gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze the heap after %s: %d objects no collection traverses "
             "(%s=0 turns this off)", what, frozen, FREEZE_ENV)
    return frozen


class GcCollector(Collector):
    """``kvmesh_gc_frozen_objects`` and ``kvmesh_gc_pause_seconds`` (module docstring),
    read at each scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        yield GaugeMetricFamily("kvmesh_gc_frozen_objects",
                                "Objects in the permanent generation (gc.freeze): no "
                                "collection traverses them", value=gc.get_freeze_count())
        pauses = HistogramMetricFamily("kvmesh_gc_pause_seconds",
                                       "Wall time of each garbage collection, by generation",
                                       labels=["generation"])
        for gen, (counts, total) in enumerate(_pauses.by_generation):
            running, buckets = 0, []
            for bound, n in zip(PAUSE_BUCKETS, counts, strict=True):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
            pauses.add_metric([str(gen)], buckets, total)
        yield pauses


def register_gc_metrics(registry: CollectorRegistry) -> None:
    """Registers the garbage collector's metrics in ``registry`` (module docstring)."""
    GCCollector(registry=registry)
    registry.register(GcCollector())
