"""A per-request KV cache with a token budget, for the AFD attention worker.

Each admitted request gets, for every layer, contiguous ``[capacity, kv_heads, head_dim]``
K and V tensors, allocated at :meth:`KvCache.allocate` and released at
:meth:`KvCache.free` (finish or abort). The cache owns a budget of ``max_tokens`` token
slots summed over requests; :meth:`KvCache.can_allocate` lets the scheduler admit a
request only when its whole capacity (prompt plus ``max_tokens`` to generate) fits, so a
running request never runs out of KV mid-generation (no preemption needed).

Contracts:

- ``allocate(request_id, capacity)``: reserves ``capacity`` token slots; ValueError for a
  duplicate id or a non-positive capacity, :class:`KvCacheFull` when the budget can't
  hold it.
- ``write(layer, request_id, start, k, v)``: stores rows ``[start, start + n)``; writing
  past the capacity raises ValueError; ``start`` must not leave a gap after what was
  written for that layer (prefill then decode, in order).
- ``read(layer, request_id, end)``: views of rows ``[0, end)`` (no copy); ``end`` beyond
  what was written raises ValueError.
- ``free(request_id)``: releases the slots; idempotent (freeing an unknown id is a no-op
  and returns False).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.engines.afd.model import KvAccess, ModelConfig


class KvCacheFull(Exception):
    """The token budget can't hold the requested capacity."""


@dataclass
class _Entry:
    capacity: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    written: list[int] = field(default_factory=list)


class KvCache(KvAccess):
    """Per-request K/V tensors under a global token budget (module docstring)."""

    def __init__(self, cfg: ModelConfig, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        self.cfg = cfg
        self.max_tokens = max_tokens
        self._entries: dict[str, _Entry] = {}
        self._used = 0

    @property
    def used_tokens(self) -> int:
        return self._used

    @property
    def free_tokens(self) -> int:
        return self.max_tokens - self._used

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def can_allocate(self, capacity: int) -> bool:
        return 0 < capacity <= self.free_tokens

    def allocate(self, request_id: str, capacity: int) -> None:
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} already has KV")
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        if capacity > self.free_tokens:
            raise KvCacheFull(f"request {request_id!r} needs {capacity} KV slots, "
                              f"{self.free_tokens} of {self.max_tokens} free")
        c = self.cfg
        shape = (capacity, c.num_kv_heads, c.head_dim)
        self._entries[request_id] = _Entry(
            capacity, [torch.zeros(shape) for _ in range(c.num_layers)],
            [torch.zeros(shape) for _ in range(c.num_layers)], [0] * c.num_layers)
        self._used += capacity

    def free(self, request_id: str) -> bool:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        self._used -= entry.capacity
        return True

    def _entry(self, request_id: str) -> _Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} has no KV") from None

    def write(self, layer: int, request_id: str, start: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        e = self._entry(request_id)
        n = k.shape[0]
        if start > e.written[layer]:
            raise ValueError(f"KV write at {start} leaves a gap after {e.written[layer]}")
        if start + n > e.capacity:
            raise ValueError(f"KV write [{start}, {start + n}) beyond capacity {e.capacity} "
                             f"of request {request_id!r}")
        e.k[layer][start:start + n] = k
        e.v[layer][start:start + n] = v
        e.written[layer] = max(e.written[layer], start + n)

    def read(self, layer: int, request_id: str, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = self._entry(request_id)
        if end > e.written[layer]:
            raise ValueError(f"KV read to {end} beyond the {e.written[layer]} rows written")
        return e.k[layer][:end], e.v[layer][:end]
