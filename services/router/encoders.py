"""The router's choice of encoder (EPD's E) for a request's images. Pure: no I/O, no clock.

Contract of :class:`EncoderPicker`:

- ``set_encoders(records)``: the live encoders (from etcd, component ``encoder``); an
  encoder that is gone loses its affinity entries and its in-flight count.
- ``pick(request_id, model, mm_hashes, exclude=())`` -> :class:`EncoderPick` or None:
  among the live encoders serving ``model`` and not in ``exclude``, the one **the router
  last sent most of these images to** (embedding-cache affinity: E keys its cache by the
  same ``mm_hash``), then the one with the fewest requests in flight (load), then the
  smallest instance id (deterministic). None when ``mm_hashes`` is empty (text-only:
  no encoder) or no encoder qualifies (the worker then encodes the images itself).
  The pick is recorded: every image now points at the chosen encoder, and the request
  counts as in flight there until ``release(request_id)`` (idempotent; False when
  unknown; the router calls it on the request's PrefillDone, Release or in-flight
  expiry). Picking an id already in flight replaces its earlier pick.
- Affinity is what the router *sent*, not what E holds: E may have evicted an entry
  (its LRU by bytes), which costs E one encode, never a wrong answer. Chosen over asking
  each E's Stats so that a pick costs no RPC; its memory is bounded by ``max_entries``
  images (least recently picked forgotten first). With several routers each remembers
  its own picks.
- ``in_flight()``: requests in flight per encoder; ``affinity_size()``: images remembered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class EncoderRecord:
    instance_id: str
    address: str
    model: str


@dataclass(frozen=True)
class EncoderPick:
    encoder: EncoderRecord
    affinity_items: int  # images last sent to it
    in_flight: int  # its requests in flight before this one


class EncoderPicker:
    """See the module docstring."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._encoders: dict[str, EncoderRecord] = {}
        self._affinity: OrderedDict[str, str] = OrderedDict()  # mm_hash -> instance id
        self._requests: dict[str, str] = {}  # request id -> instance id

    def set_encoders(self, records: Iterable[EncoderRecord]) -> None:
        self._encoders = {r.instance_id: r for r in records}
        for key in [k for k, e in self._affinity.items() if e not in self._encoders]:
            del self._affinity[key]
        for rid in [r for r, e in self._requests.items() if e not in self._encoders]:
            del self._requests[rid]

    def encoders(self) -> list[EncoderRecord]:
        return sorted(self._encoders.values(), key=lambda r: r.instance_id)

    def in_flight(self) -> dict[str, int]:
        out = dict.fromkeys(self._encoders, 0)
        for e in self._requests.values():
            out[e] = out.get(e, 0) + 1
        return out

    def affinity_size(self) -> int:
        return len(self._affinity)

    def pick(self, request_id: str, model: str, mm_hashes: Sequence[str],
             exclude: Collection[str] = ()) -> EncoderPick | None:
        if not mm_hashes:
            return None
        self.release(request_id)
        candidates = [e for e in self._encoders.values()
                      if e.model == model and e.instance_id not in exclude]
        if not candidates:
            return None
        flight = self.in_flight()
        hits = {e.instance_id: 0 for e in candidates}
        for key in mm_hashes:
            owner = self._affinity.get(key)
            if owner in hits:
                hits[owner] += 1
        best = min(candidates, key=lambda e: (-hits[e.instance_id], flight[e.instance_id],
                                              e.instance_id))
        for key in mm_hashes:
            self._affinity[key] = best.instance_id
            self._affinity.move_to_end(key)
        while len(self._affinity) > self.max_entries:
            self._affinity.popitem(last=False)
        self._requests[request_id] = best.instance_id
        return EncoderPick(best, hits[best.instance_id], flight[best.instance_id])

    def release(self, request_id: str) -> bool:
        return self._requests.pop(request_id, None) is not None
