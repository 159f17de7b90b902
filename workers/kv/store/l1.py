"""L1: a CPU block pool in front of the kvmesh store (write-behind saves, prefetch).

Like LMCache's local CPU backend with its store / prefetch controllers: the connector's
worker side copies a saved block from vLLM's paged cache into an L1 slot (a memcpy, so
vLLM may free or reuse the block as soon as the step ends) and a background thread
writes it to the store; loads are served from L1 when the block is there; blocks the
scheduler found in the store for a request that is still queued are prefetched into L1.

Contract of :class:`L1Pool` (thread-safe; one background thread):

- ``L1Pool(client, slot_bytes, slots, replicas=1)``: allocates ``slots × slot_bytes`` of
  DRAM (pages faulted in) and registers it with the client's NIXL agent. A slot holds
  one object (one KV block across layers). Slot states: *free*, *filling* (prefetch in
  flight: not readable), *dirty* (saved here, store write pending: readable, never
  evicted), *clean* (readable, evictable, LRU).
- ``save(job_id, items)`` → True when every ``(key, regions)`` was copied into L1 (keys
  already there count); the store writes happen later, in order, on the background
  thread; ``on_saved(job_id, results)`` is called there with the per-key put results
  ("ok"/"exists"/"failed"; a key already clean in L1 counts as "exists"). False (nothing
  queued) when L1 has no room for them: the caller saves synchronously instead.
- ``load(items)`` → per key True when it was copied from a readable L1 slot into the
  caller's regions (scatter); the caller reads the rest from the store.
- ``prefetch(keys)``: queues store → L1 reads for keys not in L1 (best effort: a miss or a
  failure frees the slot). Never evicts dirty slots.
- ``drain(timeout_s)`` → True when the queue is empty and nothing is in flight.
- ``close()``: drains (bounded), stops the thread. Counters in ``stats``.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.kv.store_client import Region, StoreClient

log = logging.getLogger(__name__)

FREE, FILLING, DIRTY, CLEAN = "free", "filling", "dirty", "clean"


@dataclass
class L1Stats:
    saves: int = 0
    save_fallbacks: int = 0
    flushed: int = 0
    flush_failures: int = 0
    load_hits: int = 0
    load_misses: int = 0
    prefetched: int = 0
    prefetch_misses: int = 0
    evictions: int = 0


class L1Pool:
    """See the module docstring."""

    def __init__(self, client: StoreClient, slot_bytes: int, slots: int, replicas: int = 1,
                 on_saved: Callable[[Any, list[str]], None] | None = None) -> None:
        if slot_bytes <= 0 or slots <= 0:
            raise ValueError("slot_bytes and slots must be > 0")
        self.client = client
        self.slot_bytes = slot_bytes
        self.replicas = replicas
        self.on_saved = on_saved
        self.stats = L1Stats()
        self.buf = np.empty(slot_bytes * slots, dtype=np.uint8)
        self.buf.fill(0)
        self.base = int(self.buf.ctypes.data)
        client.register(self.base, self.buf.nbytes)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._slot: OrderedDict[str, int] = OrderedDict()  # key → slot, LRU order
        self._state: dict[int, str] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._queue: queue.Queue[tuple[str, Any, Any] | None] = queue.Queue()
        self._busy = 0
        self._thread = threading.Thread(target=self._run, name="kvmesh-l1", daemon=True)
        self._thread.start()

    def _addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def _take_slot(self) -> int | None:
        """A free slot, evicting the least recently used clean one; lock held."""
        if self._free:
            return self._free.pop()
        for key, slot in self._slot.items():
            if self._state[slot] == CLEAN:
                del self._slot[key]
                self.stats.evictions += 1
                return slot
        return None

    def _release(self, key: str, slot: int) -> None:
        if self._slot.get(key) == slot:
            del self._slot[key]
        self._state.pop(slot, None)
        self._free.append(slot)

    # -- saves (write-behind) ---------------------------------------------------------

    def save(self, job_id: Any, items: Sequence[tuple[str, Sequence[Region]]]) -> bool:
        with self._lock:
            todo = [(k, r) for k, r in items if k not in self._slot]
            taken: list[tuple[str, int]] = []
            for key, _ in todo:
                slot = self._take_slot()
                if slot is None:
                    for k, s in taken:  # not enough room: undo, caller saves directly
                        self._release(k, s)
                    self.stats.save_fallbacks += 1
                    return False
                taken.append((key, slot))
                self._slot[key] = slot
                self._state[slot] = DIRTY
            for (_key, regions), (_, slot) in zip(todo, taken, strict=True):
                off = self._addr(slot)
                for addr, n in regions:  # gather the block's layers into the slot
                    ctypes.memmove(off, addr, n)
                    off += n
            self._busy += 1
            self.stats.saves += len(taken)
        keys = [k for k, _ in items]
        self._queue.put(("save", job_id, keys))
        return True

    def _flush(self, job_id: Any, keys: list[str]) -> None:
        with self._lock:
            slots = {k: self._slot[k] for k in keys
                     if k in self._slot and self._state.get(self._slot[k]) == DIRTY}
        dirty = [k for k in keys if k in slots]
        results = dict.fromkeys(keys, "exists")  # already clean in L1 (stored before)
        if dirty:
            out = self.client.put_many(
                [(k, [(self._addr(slots[k]), self.slot_bytes)]) for k in dirty],
                replicas=self.replicas)
            results.update(zip(dirty, out, strict=True))
        with self._lock:
            for k in dirty:
                if self._slot.get(k) == slots[k]:
                    self._state[slots[k]] = CLEAN  # readable still; evictable now
            self.stats.flushed += sum(results[k] in ("ok", "exists") for k in dirty)
            self.stats.flush_failures += sum(results[k] == "failed" for k in dirty)
        if self.on_saved is not None:
            self.on_saved(job_id, [results[k] for k in keys])

    # -- loads and prefetch -----------------------------------------------------------

    def load(self, items: Sequence[tuple[str, Sequence[Region]]]) -> list[bool]:
        out = []
        with self._lock:
            for key, regions in items:
                slot = self._slot.get(key)
                if slot is None or self._state.get(slot) not in (DIRTY, CLEAN):
                    out.append(False)
                    self.stats.load_misses += 1
                    continue
                if sum(n for _, n in regions) != self.slot_bytes:
                    out.append(False)
                    continue
                off = self._addr(slot)
                for addr, n in regions:  # scatter into the caller's blocks
                    ctypes.memmove(addr, off, n)
                    off += n
                self._slot.move_to_end(key)
                out.append(True)
                self.stats.load_hits += 1
        return out

    def prefetch(self, keys: Sequence[str]) -> None:
        with self._lock:
            todo = []
            for key in keys:
                if key in self._slot:
                    continue
                slot = self._take_slot()
                if slot is None:
                    break
                self._slot[key] = slot
                self._state[slot] = FILLING
                todo.append(key)
            if not todo:
                return
            self._busy += 1
        self._queue.put(("prefetch", None, todo))

    def _fetch(self, keys: list[str]) -> None:
        with self._lock:
            slots = {k: self._slot[k] for k in keys if k in self._slot}
        got = self.client.get_many([(k, [(self._addr(s), self.slot_bytes)])
                                    for k, s in slots.items()])
        with self._lock:
            for (k, s), r in zip(slots.items(), got, strict=True):
                if r == "ok":
                    self._state[s] = CLEAN
                    self.stats.prefetched += 1
                else:
                    self._release(k, s)
                    self.stats.prefetch_misses += 1

    # -- background thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, job_id, keys = item
            try:
                if kind == "save":
                    self._flush(job_id, keys)
                else:
                    self._fetch(keys)
            except Exception:  # keep the thread alive; the block is only a future miss
                log.exception("kvmesh L1 %s failed", kind)
            finally:
                with self._lock:
                    self._busy -= 1
                    self._idle.notify_all()

    def drain(self, timeout_s: float = 30.0) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._busy == 0, timeout_s)

    def contains(self, key: str) -> str | None:
        """The key's slot state, or None (tests, introspection)."""
        with self._lock:
            slot = self._slot.get(key)
            return None if slot is None else self._state.get(slot)

    def close(self, timeout_s: float = 10.0) -> None:
        self.drain(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)
