"""The kvmesh EC connector's worker half (vLLM role WORKER, next to the model runner).

:class:`EcWorker` copies embeddings between vLLM's encoder cache (``mm_hash`` → tensor)
and the region its scheduler half shares with it (:class:`~workers.ec.metadata.EcMeta`
names the region file; it is mapped on first use). Hooks, as
:class:`workers.ec.connector.KvmeshECConnector` forwards them:

- producer: ``start_save_caches(meta, encoder_cache)`` (before the step's encoder runs)
  forgets ``drops``, records ``saves`` as pending and writes those the encoder cache
  already holds (an item vLLM will not encode again); ``save_caches(encoder_cache,
  mm_hash)`` (right after vLLM encoded ``mm_hash``) writes a pending one. A write copies
  the payload, then the header; a tensor whose dtype or shape differs from the slot's is
  not written (logged, counted): its header stays clear, so the consumer encodes it.
  Every ``save_caches`` call is one vision encoder run (``encodes``); the producer's
  counters are written into the worker block of the region's stats
  (:data:`~workers.ec.core.WORKER_STATS_OFFSET`) after each step's saves, so the
  encoder service can read them.
- consumer: ``start_load_caches(meta, encoder_cache)`` (before the step gathers
  embeddings) puts a copy of each ``load``'s staged payload into the encoder cache,
  with the descriptor's dtype and shape (items already there are left alone).
- ``counters()``: encodes, saves, save bytes, save mismatches, loads, load bytes.
- ``shutdown()``: unmaps the region (the scheduler half removes the file).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from workers.ec.core import (
    HEADER_BYTES,
    WORKER_STATS_FIELDS,
    WORKER_STATS_OFFSET,
    pack_header,
    pack_stats,
)
from workers.ec.metadata import EcMeta, SlotItem
from workers.ec.transport import Region

log = logging.getLogger(__name__)


class EcWorker:
    """See the module docstring."""

    def __init__(self) -> None:
        self._region: Region | None = None
        self._pending: dict[str, SlotItem] = {}
        self._counters: Counter[str] = Counter()

    def _mapped(self, meta: EcMeta) -> Region:
        region = self._region
        if region is None or region.path != meta.region:
            if region is not None:
                region.close()
            region = self._region = Region.open(meta.region, meta.region_bytes)
        return region

    # -- producer -----------------------------------------------------------------------

    def start_save_caches(self, meta: EcMeta, encoder_cache: dict[str, torch.Tensor]) -> None:
        for mm_hash in meta.drops:
            self._pending.pop(mm_hash, None)
        for slot in meta.saves:
            self._pending[slot.mm_hash] = slot
        if not meta.region:
            return
        region = self._mapped(meta)
        for mm_hash in [h for h in self._pending if h in encoder_cache]:
            self._write(region, self._pending.pop(mm_hash), encoder_cache[mm_hash])
        self._publish_stats()

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        self._counters["encodes"] += 1
        slot = self._pending.pop(mm_hash, None)
        if slot is not None and self._region is not None:
            self._write(self._region, slot, encoder_cache[mm_hash])
        self._publish_stats()

    def _publish_stats(self) -> None:
        if self._region is not None:
            self._region.write(WORKER_STATS_OFFSET,
                               pack_stats(self._counters, WORKER_STATS_FIELDS))

    def _write(self, region: Region, slot: SlotItem, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != slot.dtype or tuple(t.shape) != slot.shape:
            self._counters["save_mismatches"] += 1
            log.error("kvmesh EC: encoder output of %s is %s %s, its slot expects %s %s: "
                      "not published", slot.mm_hash, dtype, tuple(t.shape), slot.dtype,
                      slot.shape)
            return
        start = slot.offset + HEADER_BYTES
        region.tensor[start:start + slot.nbytes].copy_(t.view(-1).view(torch.uint8))
        region.write(slot.offset, pack_header(slot.mm_hash, slot.nbytes))
        self._counters["saves"] += 1
        self._counters["save_bytes"] += slot.nbytes

    # -- consumer -----------------------------------------------------------------------

    def start_load_caches(self, meta: EcMeta, encoder_cache: dict[str, torch.Tensor]) -> None:
        if not meta.loads:
            return
        region = self._mapped(meta)
        for slot in meta.loads:
            if slot.mm_hash in encoder_cache:
                continue
            start = slot.offset + HEADER_BYTES
            raw = region.tensor[start:start + slot.nbytes].clone()
            encoder_cache[slot.mm_hash] = raw.view(getattr(torch, slot.dtype)).reshape(
                slot.shape)
            self._counters["loads"] += 1
            self._counters["load_bytes"] += slot.nbytes

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def shutdown(self) -> None:
        region, self._region = self._region, None
        if region is not None:
            region.close()

