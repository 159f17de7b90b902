"""The encoder's embedding cache: content hashes, LRU by bytes, counters. Pure.

No grpc, asyncio, vLLM or clock of its own: the clock is passed in.

Contract:

- :func:`content_hash(data)`: the cache's identity of an image: **sha256 (hex) of the
  image file's bytes** as the client sent them (after base64 decoding a data: URL).
  Chosen over a hash of the decoded pixels because a hit then costs no decode at all
  and any client (frontend, router) can compute it; the price is that one picture sent
  as PNG and as JPEG is two entries.
- :func:`cache_key(content_hash, salt)`: the key, and vLLM's ``mm_hash`` (it reaches
  vLLM as ``multi_modal_uuids``): the content hash itself without a salt, else
  ``sha256(salt NUL content_hash)`` hex, so a tenant (its ``cache_salt``) only ever hits
  its own embeddings and cannot probe another's.
- :class:`EmbeddingCache` (generic in the value, which is opaque here): entries of
  ``nbytes`` each within ``budget_bytes``, least recently used evicted first.

  - ``lookup(key, valid=None)`` -> value or None: a hit when the key is present, younger
    than ``ttl_s`` (None: no age limit) and ``valid(value)`` (the caller's check that the
    embedding still exists); counts a hit (and makes it most recent) or a miss. An
    entry found too old or invalid is dropped (counted ``expired`` or ``stale``) and
    the lookup is a miss.
  - ``put(key, value, nbytes)`` -> the keys evicted to make room (LRU first). An entry
    larger than the whole budget is not kept (``too_big``; returned as evicted). Putting
    a present key replaces it.
  - ``discard(key)`` -> whether it was there (no counter moves); ``peek(key)``: the value
    without counting or reordering; ``len``/``in``.
  - ``stats()`` -> :class:`CacheStats` (hits, misses, evictions, stale, expired,
    too_big, entries, bytes, budget_bytes).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")
Clock = Callable[[], float]


def content_hash(data: bytes) -> str:
    """sha256 hex of the image file's bytes (see the module docstring)."""
    return hashlib.sha256(data).hexdigest()


def cache_key(digest: str, salt: str = "") -> str:
    """The cache key and vLLM ``mm_hash`` of ``digest`` for the tenant salt ``salt``."""
    if not salt:
        return digest
    return hashlib.sha256(salt.encode("utf-8") + b"\0" + digest.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    stale: int
    expired: int
    too_big: int
    entries: int
    bytes: int
    budget_bytes: int


@dataclass
class _Entry(Generic[V]):
    value: V
    nbytes: int
    stored_at: float


class EmbeddingCache(Generic[V]):
    """LRU by bytes with counters (see the module docstring)."""

    def __init__(self, budget_bytes: int, clock: Clock, ttl_s: float | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._ttl = ttl_s
        self._entries: OrderedDict[str, _Entry[V]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.stale = self.expired = self.too_big = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def peek(self, key: str) -> V | None:
        entry = self._entries.get(key)
        return entry.value if entry is not None else None

    def lookup(self, key: str, valid: Callable[[V], bool] | None = None) -> V | None:
        entry = self._entries.get(key)
        if entry is not None and self._ttl is not None and (
                self._clock() - entry.stored_at >= self._ttl):
            self._drop(key)
            self.expired += 1
            entry = None
        if entry is not None and valid is not None and not valid(entry.value):
            self._drop(key)
            self.stale += 1
            entry = None
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry.value

    def put(self, key: str, value: V, nbytes: int) -> list[str]:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.discard(key)
        if nbytes > self.budget_bytes:
            self.too_big += 1
            return [key]
        evicted = []
        while self._bytes + nbytes > self.budget_bytes:
            victim = next(iter(self._entries))
            self._drop(victim)
            self.evictions += 1
            evicted.append(victim)
        self._entries[key] = _Entry(value, nbytes, self._clock())
        self._bytes += nbytes
        return evicted

    def discard(self, key: str) -> bool:
        if key not in self._entries:
            return False
        self._drop(key)
        return True

    def _drop(self, key: str) -> None:
        self._bytes -= self._entries.pop(key).nbytes

    def stats(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, self.evictions, self.stale, self.expired,
                          self.too_big, len(self._entries), self._bytes, self.budget_bytes)
