"""The store connector's scheduler half (vLLM role SCHEDULER, inside EngineCore).

:class:`StoreConnectorScheduler` turns vLLM's requests and scheduler outputs into calls of
the vLLM-free :class:`~workers.kv.store.planner.StorePlanner` and asks the store master
(a metadata-only :class:`~workers.kv.store_client.StoreClient`) which blocks it holds.
:class:`workers.kv.store_connector.KvmeshStoreConnector` delegates to it, hook by hook:

- ``get_num_new_matched_tokens(request, num_computed)``: hashes the prompt (once per
  request), asks the master (BatchExistKey, which grants read leases) for the blocks after
  the engine's local hit, and reports ``consecutive hits × block_size`` extra tokens, full
  blocks only and never the prompt's last token (vLLM must compute at least one). Loads are
  synchronous by default: it returns ``(n, False)``; with ``async_load: true`` it returns
  ``(n, True)`` and vLLM parks the request (WAITING_FOR_REMOTE_KVS) until the worker
  reports the load finished. A miss (or a master error) is ``(0, False)``: vLLM computes.
  After a load of a request failed (reported back in :class:`StoreWorkerMeta`), that
  request is never offered the store again (vLLM recomputes it; an async one is looked up
  again and the master may still list the lost replicas until the owner's TTL).
- ``update_state_after_alloc``: when ``num_external_tokens > 0``, records the load plan:
  block indices from the local hit seen by the lookup just before (vLLM updates
  ``request.num_computed_tokens`` only after this call); the block ids are read in
  ``build_connector_meta``.
- ``build_connector_meta(scheduler_output, kv_cache_manager)`` → :class:`StoreMeta`: the
  loads planned this step (keys, block ids) and the saves: for every scheduled request,
  the prompt blocks that become full in this step and were neither loaded nor hit locally
  (each block is saved once per request); with L1, the hit keys of looked-up requests
  that were not scheduled (queued), once, for the worker to prefetch.
- ``update_connector_output`` / ``take_events`` (tier ``store`` for the indexer): for each
  job the worker reports (:class:`StoreWorkerMeta`: the leading blocks now in the store),
  one vLLM ``BlockStored`` event with ``medium="STORAGE"`` covering the request's prefix
  up to that block, block hashes = kvmesh's chained hashes (salted for a tenant, the salt
  in the first block's ``extra_keys`` as vLLM writes it), no parent; vLLM publishes it
  with its own KV events, and the worker's relay maps STORAGE to tier ``store``. Loaded
  prefixes are announced too (this worker can load them). The store does not report
  evictions, so tier ``store`` entries can go stale (approximate, like Dynamo's
  host/disk tiers). ``publish_events: false`` turns this off.
- ``request_finished`` → ``(False, None)``: every save and load finishes inside the step
  that scheduled it (see :mod:`workers.kv.store.worker`), so vLLM may free the blocks at
  once.
- ``counters()``: the metadata client's op counts ({} after ``shutdown()``, which closes
  it; idempotent).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored

from services.common.tls import tls_for
from workers.kv.store.metadata import StoreMeta, StoreWorkerMeta
from workers.kv.store.planner import StorePlanner, StoreSettings
from workers.kv.store_client import StoreClient

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def eligible(request: Request) -> bool:
    """Whether the request's KV is a function of its prompt's token ids (and its tenant's
    cache salt) alone; an empty prompt is turned away by :meth:`StorePlanner.track`. A
    salted request (a tenant's ``cache_salt``) has salted store keys (:func:`salt_of`), so
    no tenant ever matches another's blocks in the store."""
    return (getattr(request, "lora_request", None) is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None)


def salt_of(request: Request) -> str:
    """The request's cache salt ("" when it has none)."""
    return getattr(request, "cache_salt", None) or ""


class StoreConnectorScheduler:
    """See the module docstring."""

    def __init__(self, settings: StoreSettings, block_size: int, key_prefix: str) -> None:
        self.block_size = block_size
        self.planner = StorePlanner.from_settings(settings, block_size, key_prefix)
        self.client: StoreClient | None = StoreClient(
            settings.store_master, nixl=False, rpc_timeout_s=settings.rpc_timeout_s,
            tls=tls_for(settings, "worker") if settings.tls_dir else None)
        self._events: list[BlockStored] = []

    def _track(self, request: Request) -> str:
        req_id = request.request_id
        self.planner.track(req_id, request.prompt_token_ids or [], eligible(request),
                           salt_of(request))
        return req_id

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        req_id = self._track(request)
        keys = self.planner.lookup(req_id, num_computed_tokens)
        if not keys:
            return 0, False
        assert self.client is not None, "store connector used after shutdown()"
        hits = self.client.exists_prefix(keys)
        return self.planner.matched(req_id, num_computed_tokens, hits)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self.planner.allocated(self._track(request), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             kv_cache_manager: KVCacheManager | None) -> StoreMeta:
        computed: dict[str, int] = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        mgr = kv_cache_manager
        plan = self.planner.plan(
            computed, scheduler_output.num_scheduled_tokens,
            None if mgr is None else (lambda req_id: mgr.get_block_ids(req_id)[0]))
        return StoreMeta(plan.loads, plan.saves, plan.prefetch)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        done = meta.done if isinstance(meta, StoreWorkerMeta) else []
        for prefix in self.planner.reported(connector_output.finished_recving or (), done):
            # a salted prefix names its salt the way vLLM does (first block's extra keys)
            extra = ([(prefix.salt,)] + [None] * (len(prefix.block_hashes) - 1)
                     if prefix.salt else None)
            self._events.append(BlockStored(
                block_hashes=list[Any](prefix.block_hashes), parent_block_hash=None,
                token_ids=prefix.token_ids, block_size=self.block_size, lora_id=None,
                medium=MEDIUM_STORAGE, lora_name=None, extra_keys=extra))

    def take_events(self) -> Iterable[KVCacheEvent]:
        out, self._events = self._events, []
        return out

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None

    def counters(self) -> dict[str, int]:
        return dict(vars(self.client.counters)) if self.client is not None else {}

    def shutdown(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()
