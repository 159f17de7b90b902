"""The store connector's worker half (vLLM role WORKER, next to the model runner).

:class:`StoreConnectorWorker` moves the blocks a :class:`StoreMeta` names between vLLM's
paged KV cache and the store; :class:`workers.kv.store_connector.KvmeshStoreConnector`
delegates to it, hook by hook (``meta`` is the step's bound connector metadata):

- ``register_kv_caches(kv_caches)``: creates the NIXL-backed :class:`StoreClient` and
  registers every layer's cache tensor with NIXL, so blocks move between the paged cache
  and the store with no staging copy (the NIXL descriptor list is the gather/scatter).
  A layer whose blocks are not contiguous is a ValueError.
- ``start_load_kv(meta)``: vLLM calls it *before* the forward pass when the step has
  synchronous loads (``SchedulerOutput.has_sync_kv_loads``); it reads every planned block
  from the store into the blocks vLLM allocated and returns when done. A block that the
  master no longer has, or whose read fails (segment owner gone, transfer error), is a
  *load error*: its id is reported by ``get_block_ids_with_load_errors`` in the same step,
  and vLLM applies ``kv_load_failure_policy`` (recompute from the first failed block, or
  fail the request). Prefetch keys in the metadata are handed to L1 here.
- ``wait_for_save(meta)`` (after the forward, while vLLM still holds every block of the
  step) writes the step's saves (PutStart → NIXL WRITE → PutEnd) and returns when done,
  so no block is freed or reused while a save may touch it. A failed or refused save (no
  space, key already stored) only costs a future miss. (``wait_for_layer_load`` and
  ``save_kv_layer`` do nothing: loads are complete before the forward.)
- L1 (``l1_mib > 0``, :class:`workers.kv.store.l1.L1Pool`): saves are copied into the CPU
  pool inside ``wait_for_save`` and written to the store by the pool's thread
  (write-behind: the step no longer waits for the store; a full pool falls back to the
  synchronous save); loads read L1 first, then the store; prefetch reads store → L1.
- ``build_connector_worker_meta()`` → :class:`StoreWorkerMeta` of the jobs that reached
  the store since the last step (synchronous ones, and L1 write-behind completions), or
  None when there are none.
- ``get_finished()`` → ``(None, finished loads)``: with ``async_load``, ``start_load_kv``
  (after the forward) hands each request's load to a loader thread, and ``get_finished``
  returns the requests whose load ended (failed blocks join the load errors in that same
  step, as vLLM requires; a loader exception fails every block of its job). vLLM keeps a
  parked request's blocks, even when it is aborted, until its id comes back here. Saves
  are never reported: nothing vLLM owns is touched after the step that scheduled it (L1
  write-behind works on its own copy).
- ``get_block_ids_with_load_errors()``: the failed block ids since the last call.
- ``counters()``: the store client's op/byte counts ({} before ``register_kv_caches``).
- ``shutdown()``: waits for the loader, drains and closes the L1 pool, then closes the
  store client. Idempotent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from services.common.tls import tls_for
from workers.kv.store.l1 import L1Pool
from workers.kv.store.metadata import StoreMeta, StoreWorkerMeta
from workers.kv.store.planner import (
    BlockJob,
    StoreSettings,
    failed_blocks,
    job_counts,
    leading,
)
from workers.kv.store_client import Region, StoreClient

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

log = logging.getLogger(__name__)

Items = list[tuple[str, list[Region]]]


class StoreConnectorWorker:
    """See the module docstring."""

    def __init__(self, settings: StoreSettings, key_prefix: str) -> None:
        self.settings = settings
        self.key_prefix = key_prefix
        self._client: StoreClient | None = None
        self._layers: list[tuple[int, int, int]] = []  # (base addr, block stride, bytes)
        self._load_errors: set[int] = set()
        self._done: list[tuple[str, int, int]] = []
        self._done_lock = threading.Lock()  # the L1 thread reports saves too
        self._l1: L1Pool | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[BlockJob, Future[list[str]]]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        s = self.settings
        client = StoreClient(s.store_master, s.segment_bytes, rpc_timeout_s=s.rpc_timeout_s,
                             transfer_timeout_s=s.transfer_timeout_s,
                             tls=tls_for(s, "worker") if s.tls_dir else None)
        seen: set[int] = set()
        total = 0
        for name, kv in kv_caches.items():
            if not kv[0].is_contiguous():
                raise ValueError(f"KV cache of {name} has non-contiguous blocks: "
                                 f"shape {tuple(kv.shape)}, stride {kv.stride()}")
            stride = kv.stride(0) * kv.element_size()
            nbytes = kv[0].numel() * kv.element_size()
            base = int(kv.data_ptr())
            if base not in seen:  # layers may share one tensor
                client.register(base, kv.shape[0] * stride)
                seen.add(base)
            self._layers.append((base, stride, nbytes))
            total += nbytes
        self._client = client
        if s.l1_bytes >= total > 0:
            self._l1 = L1Pool(client, total, s.l1_bytes // total, s.replicas,
                              on_saved=self._l1_saved)
        log.info("kvmesh store connector: %d layers, %d B per block, keys %s, L1 %s",
                 len(self._layers), total, self.key_prefix,
                 f"{s.l1_bytes // total} blocks" if self._l1 else "off")

    def _items(self, jobs: list[BlockJob]) -> Items:
        """``(key, regions)`` of every block of ``jobs``, in order."""
        return [(k, [(base + b * stride, n) for base, stride, n in self._layers])
                for job in jobs for k, b in zip(job.keys, job.block_ids, strict=True)]

    def _get(self, items: Items) -> list[str]:
        """L1 first, then the store."""
        assert self._client is not None
        if self._l1 is None:
            return list(self._client.get_many(items))
        results = ["ok" if hit else "" for hit in self._l1.load(items)]
        rest = [i for i, r in enumerate(results) if not r]
        for i, r in zip(rest, self._client.get_many([items[i] for i in rest]), strict=True):
            results[i] = r
        return results

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if isinstance(meta, StoreMeta) and meta.prefetch and self._l1 is not None:
            self._l1.prefetch(meta.prefetch)
        if not isinstance(meta, StoreMeta) or not meta.loads or self._client is None:
            return
        if self.settings.async_load:  # into blocks of requests vLLM keeps waiting for us
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-load")
            for job in meta.loads:
                self._inflight[job.req_id] = (job, self._loader.submit(self._get,
                                                                       self._items([job])))
            return
        results = self._get(self._items(meta.loads))
        self._report(meta.loads, results, ("ok",))
        self._load_failed(meta.loads, results)

    def _load_failed(self, jobs: list[BlockJob], results: Sequence[str]) -> None:
        failed = failed_blocks(jobs, results)
        if failed:
            log.warning("kvmesh store: %d of %d blocks failed to load", len(failed),
                        sum(len(job.block_ids) for job in jobs))
            self._load_errors |= failed

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, StoreMeta) or not meta.saves or self._client is None:
            return
        direct = []
        for job in meta.saves:  # L1: copy now, write to the store in the background
            if self._l1 is None or not self._l1.save((job.req_id, job.first),
                                                     self._items([job])):
                direct.append(job)
        if not direct:
            return
        results = self._client.put_many(self._items(direct), replicas=self.settings.replicas)
        self._report(direct, results, ("ok", "exists"))
        if "failed" in results:
            log.info("kvmesh store: %d of %d block saves failed",
                     results.count("failed"), len(results))

    def _report(self, jobs: list[BlockJob], results: Sequence[str],
                good: tuple[str, ...]) -> None:
        counts = job_counts(jobs, results, good)
        with self._done_lock:
            self._done.extend(counts)

    def _l1_saved(self, job_id: tuple[str, int], results: list[str]) -> None:
        """L1 thread: a write-behind job reached the store (or failed)."""
        with self._done_lock:
            self._done.append((job_id[0], job_id[1], leading(results, ("ok", "exists"))))

    def build_connector_worker_meta(self) -> StoreWorkerMeta | None:
        with self._done_lock:
            if not self._done:
                return None
            out, self._done = StoreWorkerMeta(self._done), []
        return out

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        done = {r for r, (_, fut) in self._inflight.items() if fut.done()}
        for req_id in done:
            job, fut = self._inflight.pop(req_id)
            try:
                results = fut.result()
            except Exception:  # the loader thread failed: every block is a load error
                log.exception("kvmesh store: async load of %s failed", req_id)
                results = ["failed"] * len(job.keys)
            self._report([job], results, ("ok",))
            self._load_failed([job], results)  # reported in this same step, as vLLM requires
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def counters(self) -> dict[str, int]:
        return dict(vars(self._client.counters)) if self._client is not None else {}

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._l1 is not None:
            self._l1.close()
            self._l1 = None
        client, self._client = self._client, None
        if client is not None:
            client.close()
