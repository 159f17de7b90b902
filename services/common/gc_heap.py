"""Python's garbage collector and a long-running process's startup heap.

A full (oldest-generation) collection traverses every container object the process
holds. A frontend holds ~650 000 of them once vLLM's tool parser, transformers and a
tokenizer are imported, and one full collection of that heap took 310-440 ms here
(``python -m bench.gc_pause``): a stall of the event loop, so of every request in
flight. CPython runs one whenever the objects
that survived younger collections since the last full one reach a quarter of the old
generation, so a server whose long-lived state grows (an embedded KV index, caches)
meets them now and then, at random. vLLM's API server and engine core, and SGLang,
freeze their startup heap for this reason; so does every kvmesh process.

Contract:

- :func:`freeze_heap` ``(what)``: unless ``KVMESH_GC_FREEZE=0`` (:data:`FREEZE_ENV`), a
  full collection, then ``gc.freeze()``: every object alive now moves to the permanent
  generation, which no collection traverses. Returns the number of objects frozen in
  all (``gc.get_freeze_count()``; 0 when turned off) and logs it at debug level with
  ``what`` (what was just built). Safe to call again: each call freezes what was built
  since, and its collection traverses only that. :func:`services.common.server.serve_main`
  calls it before the app starts (the imports) and once it has started; the frontend
  also once vLLM's tool parser is imported (:mod:`services.frontend.tool_chat`).
- The price: an object alive at a freeze that later becomes garbage in a reference
  cycle is never freed (objects freed by their reference count, most of them, are
  freed as usual). That is bounded by what existed when the process started.
- :class:`GcCollector`: Prometheus metrics of the collector, for a service's registry:
  ``kvmesh_gc_frozen_objects`` (gauge: objects in the permanent generation),
  ``kvmesh_gc_collections_total`` and ``kvmesh_gc_collected_objects_total`` (counters
  by ``generation``: CPython's ``gc.get_stats()``).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Set to "0" to leave the startup heap to the collector (no gc.freeze).
FREEZE_ENV = "KVMESH_GC_FREEZE"


def freezing() -> bool:
    """False when ``KVMESH_GC_FREEZE=0``."""
    return os.environ.get(FREEZE_ENV, "1") != "0"


def freeze_heap(what: str) -> int:
    """Collects, then freezes every object alive (see the module docstring); returns the
    frozen count, 0 when ``KVMESH_GC_FREEZE=0``."""
    if not freezing():
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze the heap after %s: %d objects in the permanent generation", what,
              frozen)
    return frozen


class GcCollector(Collector):
    """The garbage collector's metrics (see the module docstring), read at each scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("kvmesh_gc_frozen_objects",
                                "Objects in the permanent generation (gc.freeze): no "
                                "collection traverses them", value=gc.get_freeze_count())
        runs = CounterMetricFamily("kvmesh_gc_collections",
                                   "Garbage collections run, by generation",
                                   labels=["generation"])
        collected = CounterMetricFamily("kvmesh_gc_collected_objects",
                                        "Objects the garbage collector freed, by generation",
                                        labels=["generation"])
        for generation, stats in enumerate(gc.get_stats()):
            runs.add_metric([str(generation)], stats["collections"])
            collected.add_metric([str(generation)], stats["collected"])
        yield runs
        yield collected
