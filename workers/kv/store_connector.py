"""kvmesh's vLLM KV connector: prefix blocks saved to and loaded from the kvmesh store.

Loaded by vLLM inside EngineCore through ``kv_transfer_config`` (:func:`store_kv_transfer_config`)::

    {"kv_connector": "KvmeshStoreConnector",
     "kv_connector_module_path": "workers.kv.store_connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"store_master": "host:port", ...}}

Extra config: ``store_master`` (required), ``replicas`` (1), ``save`` / ``load`` (true),
``segment_mib`` (0: the worker contributes no memory; store nodes do), ``publish_events``
(true), ``l1_mib`` (0: no L1; see below), ``async_load`` (false), ``rpc_timeout_s``,
``transfer_timeout_s``.
:func:`combined_kv_transfer_config` builds the ``MultiConnector`` form (NIXL P→D + store).

Objects and keys. One store object per full KV block: for every attention layer (in
vLLM's layer order) the block's bytes in vLLM's paged cache ``[num_blocks, kv_heads,
block_size, 2*head_size]`` (one contiguous range per layer), concatenated. The key is
``kv/<layout id>/tp<rank>of<size>/<chained hash, 16 hex>``: the chained block hash of
:mod:`services.common.block_hash` over the prompt's token ids, and a hash of
:func:`workers.kv.layout.kv_layout` (architecture, dtypes, layers, KV heads, head and
block size), so engines with incompatible layouts never read each other's objects; a
size mismatch on read is a load error, never a silent copy. Requests with LoRA, multimodal
inputs or prompt embeddings are neither saved nor loaded (their KV is not a function of
the token ids alone).

Scheduler side (role SCHEDULER):

- ``get_num_new_matched_tokens(request, num_computed)``: hashes the prompt (cached per
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
- ``build_connector_meta`` → :class:`StoreMeta`: the loads planned this step (keys, block
  ids) and the saves: for every scheduled request, the prompt blocks that become full in
  this step and were neither loaded nor hit locally (each block is saved once per
  request).
- ``update_connector_output`` / ``take_events`` (tier ``store`` for the indexer): for each
  job the worker reports (:class:`StoreWorkerMeta`: the leading blocks now in the store),
  one vLLM ``BlockStored`` event with ``medium="STORAGE"`` covering the request's prefix
  up to that block, block hashes = kvmesh's chained hashes, no parent; vLLM publishes it
  with its own KV events, and the worker's relay maps STORAGE to tier ``store``. Loaded
  prefixes are announced too (this worker can load them). The store does not report
  evictions, so tier ``store`` entries can go stale (approximate, like Dynamo's
  host/disk tiers). ``publish_events: false`` turns this off.
- ``request_finished`` / ``request_finished_all_groups`` → ``(False, None)``: every save
  and load finishes inside the step that scheduled it (below), so vLLM may free the blocks
  at once.
- HMA: the class declares ``SupportsHMA`` so that a ``MultiConnector`` with NIXL keeps
  vLLM's hybrid allocator setting equal to a NIXL-only peer's (it is part of NIXL's
  handshake compatibility hash); with more than one KV cache group (hybrid models) the
  connector turns itself off (saves and loads nothing).

Worker side (role WORKER):

- ``register_kv_caches``: creates the NIXL-backed :class:`StoreClient` and registers every
  layer's cache tensor with NIXL, so blocks move between the paged cache and the store
  with no staging copy (the NIXL descriptor list is the gather/scatter).
- ``start_load_kv``: vLLM calls it *before* the forward pass when the step has
  synchronous loads (``SchedulerOutput.has_sync_kv_loads``); it reads every planned block
  from the store into the blocks vLLM allocated and returns when done. A block that the
  master no longer has, or whose read fails (segment owner gone, transfer error), is a
  *load error*: its id is reported by ``get_block_ids_with_load_errors`` in the same step,
  and vLLM applies ``kv_load_failure_policy`` (recompute from the first failed block, or
  fail the request).
- ``wait_for_layer_load``: nothing (loads are complete before the forward).
- Prefetch keys in the metadata are handed to L1 in ``start_load_kv``.
- ``save_kv_layer``: nothing; ``wait_for_save`` (after the forward, while vLLM still holds
  every block of the step) writes the step's saves (PutStart → NIXL WRITE → PutEnd) and
  returns when done, so no block is freed or reused while a save may touch it. A failed or
  refused save (no space, key already stored) only costs a future miss.
- L1 (``l1_mib > 0``, :class:`workers.kv.store.l1.L1Pool` in the worker): saves are
  copied into the CPU pool inside ``wait_for_save`` and written to the store by the pool's
  thread (write-behind: the step no longer waits for the store; a full pool falls back
  to the synchronous save); loads read L1 first, then the store; when a lookup hits but
  the request is not scheduled in that step (queued), the scheduler lists the hit keys in
  ``StoreMeta.prefetch`` once and the worker prefetches them store → L1.
- ``build_connector_worker_meta`` → :class:`StoreWorkerMeta` of the jobs that reached
  the store since the last step (synchronous ones, and L1 write-behind completions).
- ``get_finished`` → ``(None, finished loads)``: with ``async_load``, ``start_load_kv``
  (after the forward) hands each request's load to a loader thread, and ``get_finished``
  returns the requests whose load ended (failed blocks join the load errors in that same
  step, as vLLM requires). vLLM keeps a parked request's blocks, even when it is aborted,
  until its id comes back here. Saves are never reported: nothing vLLM owns is touched
  after the step that scheduled it (L1 write-behind works on its own copy).
- ``get_kv_connector_stats``: None (loads show in vLLM's connector hit / external token
  counters); ``counters()`` (this process) has the store client's op/byte counts.
- ``shutdown``: drains and closes the L1 pool, then closes the store client.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import takewhile
from typing import TYPE_CHECKING, Any

import xxhash
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from services.common.block_hash import block_hashes
from workers.kv.layout import kv_layout
from workers.kv.store.l1 import L1Pool
from workers.kv.store_client import Region, StoreClient

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

MODULE = "workers.kv.store_connector"
CLASS = "KvmeshStoreConnector"


def store_kv_transfer_config(
    store_master: str,
    *,
    kv_load_failure_policy: str | None = None,
    replicas: int = 1,
    save: bool = True,
    load: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``kv_transfer_config`` for an engine using the kvmesh store connector alone."""
    if kv_load_failure_policy not in (None, "recompute", "fail"):
        raise ValueError(f"bad kv_load_failure_policy {kv_load_failure_policy!r}")
    cfg: dict[str, Any] = {
        "kv_connector": CLASS,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_master": store_master, "replicas": replicas,
                                      "save": save, "load": load, **(extra or {})},
    }
    if kv_load_failure_policy is not None:
        cfg["kv_load_failure_policy"] = kv_load_failure_policy
    return cfg


def combined_kv_transfer_config(
    nixl_config: dict[str, Any],
    store_master: str,
    *,
    kv_load_failure_policy: str | None = None,
    store_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM ``MultiConnector``: NIXL P→D handoff first, then the kvmesh store.

    ``nixl_config`` is :func:`workers.kv.nixl.nixl_kv_transfer_config`'s dict (its engine
    id and role become the top level's). vLLM loads from the first connector reporting
    matched tokens: a decode request with ``do_remote_prefill`` loads from P over NIXL;
    any other request (P's prefill, an aggregated one) loads its prefix from the store.
    Both save: NIXL keeps P's blocks for D under its own lease (request_finished → True),
    while the store's copy lives by the master's leases, pins and eviction: two separate
    retention rules. The failure policy applies to both.
    """
    nixl = dict(nixl_config)
    policy = kv_load_failure_policy or nixl.pop("kv_load_failure_policy", None)
    nixl.pop("kv_load_failure_policy", None)  # the top level carries it
    # vLLM 0.32's MultiConnector passes the top-level engine_id to every child and fails
    # ("multiple values for keyword argument 'engine_id'") when a child repeats it.
    engine_id = nixl.pop("engine_id", None)
    store = store_kv_transfer_config(store_master, extra=store_extra)
    cfg: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": nixl.get("kv_role", "kv_both"),
        "engine_id": engine_id,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"connectors": [nixl, store]},
    }
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return cfg


@dataclass
class BlockJob:
    """Blocks of one request to load or save: ``keys[i]`` ↔ ``block_ids[i]``."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    first: int = 0  # the request's block index of keys[0]


@dataclass
class StoreMeta(KVConnectorMetadata):
    """What the worker side does in one step (crosses the scheduler → worker boundary)."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    prefetch: list[str] = field(default_factory=list)  # store → L1 (queued requests)


@dataclass
class StoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, per step: ``(req_id, first, n)`` for each job whose first ``n``
    blocks are now in the store (saved, already there, or loaded from it)."""

    done: list[tuple[str, int, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, StoreWorkerMeta):
            return StoreWorkerMeta(self.done + other.done)
        return self


@dataclass
class _ReqState:
    """Scheduler-side bookkeeping of one live request."""

    request: Request
    keys: list[str]
    hashes: list[int]  # keys[i] ends with hashes[i] (chained block hashes of the prompt)
    saved_upto: int = -1  # prompt blocks [0, saved_upto) are in the store or need no save
    load_from: int = 0  # planned load: blocks [load_from, load_to)
    load_to: int = 0
    eligible: bool = True
    hit_keys: list[str] = field(default_factory=list)  # last lookup's store hits
    lookup_local: int = 0  # blocks the engine had locally at the last lookup
    loading: bool = False  # an asynchronous load is in flight
    load_failed: bool = False  # a load of this request failed: do not offer the store again
    prefetched: bool = False


def _leading(results: Sequence[str], good: tuple[str, ...]) -> int:
    """How many leading ``results`` are in ``good``."""
    return sum(1 for _ in takewhile(lambda r: r in good, results))


def _eligible(request: Request) -> bool:
    return (getattr(request, "lora_request", None) is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
            and bool(request.prompt_token_ids))


class KvmeshStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM connector for the kvmesh store; see the module docstring for each hook."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        self._extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        master = self._extra.get("store_master")
        if not master:
            raise ValueError("kv_connector_extra_config.store_master is required")
        self._master = str(master)
        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        self._block_size = int(vllm_config.cache_config.block_size)
        self._replicas = int(self._extra.get("replicas", 1))
        self._save = bool(self._extra.get("save", True))
        self._load = bool(self._extra.get("load", True))
        self._async_load = bool(self._extra.get("async_load", False))
        if groups > 1:  # block ids of one group only; hybrid models are not served
            log.warning("kvmesh store connector: %d KV cache groups; store disabled", groups)
            self._save = self._load = False
        par = vllm_config.parallel_config
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self._layout = kv_layout(vllm_config)
        self._key_prefix_base = f"tp{tp_rank}of{par.tensor_parallel_size}"
        self._key_prefix = self._prefix()
        self._rpc_timeout_s = float(self._extra.get("rpc_timeout_s", 5.0))
        self._transfer_timeout_s = float(self._extra.get("transfer_timeout_s", 10.0))
        # Scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: dict[str, None] = {}  # ordered set
        self._publish = bool(self._extra.get("publish_events", True))
        self._l1_bytes = int(self._extra.get("l1_mib", 0)) << 20
        self._prefetch_wanted: set[str] = set()
        self._load_jobs: dict[tuple[str, int], int] = {}  # (req_id, first) → blocks
        # (req_id, first) → (prompt token ids, prompt block hashes), until reported
        self._jobs: dict[tuple[str, int], tuple[Sequence[int], list[int]]] = {}
        self._events: list[BlockStored] = []
        # Worker side
        self._client: StoreClient | None = None
        self._layers: list[tuple[int, int, int]] = []  # (base addr, block stride, bytes)
        self._load_errors: set[int] = set()
        self._done: list[tuple[str, int, int]] = []
        self._done_lock = threading.Lock()  # the L1 thread reports saves too
        self._l1: L1Pool | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[BlockJob, Future[list[str]]]] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._client = StoreClient(self._master, nixl=False,
                                       rpc_timeout_s=self._rpc_timeout_s)

    # -- keys -------------------------------------------------------------------------

    def _prefix(self) -> str:
        layout = xxhash.xxh3_64_hexdigest(self._layout.encode())
        return f"kv/{layout}/{self._key_prefix_base}/"

    def _keys(self, token_ids: Sequence[int]) -> list[str]:
        return self._keys_of(block_hashes(token_ids, self._block_size))

    def _keys_of(self, hashes: Sequence[int]) -> list[str]:
        return [f"{self._key_prefix}{h:016x}" for h in hashes]

    # -- scheduler side ---------------------------------------------------------------

    def _state(self, request: Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            ok = _eligible(request)
            hashes = block_hashes(request.prompt_token_ids or [], self._block_size) if ok else []
            st = self._reqs[request.request_id] = _ReqState(
                request, self._keys_of(hashes), hashes, eligible=ok)
        return st

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if not (self._load and st.eligible) or st.load_failed:
            return 0, False
        local = num_computed_tokens // self._block_size
        n_prompt = len(request.prompt_token_ids or [])
        limit = min(len(st.keys), (n_prompt - 1) // self._block_size)
        if local >= limit:
            return 0, False
        assert self._client is not None
        hits = self._client.exists_prefix(st.keys[local:limit])
        st.lookup_local = local  # vLLM sets num_computed_tokens only after the allocation
        if self._l1_bytes and hits and not st.prefetched:
            st.hit_keys = st.keys[local:local + hits]
            self._prefetch_wanted.add(request.request_id)
        return hits * self._block_size, self._async_load and hits > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        if num_external_tokens <= 0 or st.loading:  # (async: the call after the load)
            return
        st.loading = self._async_load
        start = st.lookup_local  # the local hit the matching lookup saw
        st.load_from, st.load_to = start, start + num_external_tokens // self._block_size
        self._pending_loads[request.request_id] = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = StoreMeta()
        mgr = self._kv_cache_manager
        for req_id in self._pending_loads:
            st = self._reqs.get(req_id)
            if st is None or mgr is None:
                continue
            ids = mgr.get_block_ids(req_id)[0]
            rng = range(st.load_from, st.load_to)
            meta.loads.append(BlockJob(req_id, [st.keys[i] for i in rng],
                                       [ids[i] for i in rng], st.load_from))
            self._track(st, st.load_from, st.load_to)
            self._load_jobs[(req_id, st.load_from)] = len(rng)
            st.saved_upto = max(st.saved_upto, st.load_to)
        for req_id in self._prefetch_wanted:  # lookup hit, not scheduled (yet): prefetch
            st = self._reqs.get(req_id)
            if st is not None and req_id not in self._pending_loads and not st.prefetched:
                meta.prefetch.extend(st.hit_keys)
                st.prefetched = True
        self._prefetch_wanted.clear()
        self._pending_loads.clear()
        if self._save and mgr is not None:
            computed: dict[str, int] = {
                r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
            for req_id, done in computed.items():
                st = self._reqs.get(req_id)
                if st is None or not st.eligible:
                    continue
                if st.saved_upto < 0:  # first step: blocks hit locally need no save
                    st.saved_upto = done // self._block_size
                upto = (done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                        ) // self._block_size
                upto = min(upto, len(st.keys))
                if upto > st.saved_upto:
                    ids = mgr.get_block_ids(req_id)[0]
                    rng = range(st.saved_upto, upto)
                    meta.saves.append(BlockJob(req_id, [st.keys[i] for i in rng],
                                               [ids[i] for i in rng], st.saved_upto))
                    self._track(st, st.saved_upto, upto)
                    st.saved_upto = upto
        return meta

    def _track(self, st: _ReqState, first: int, upto: int) -> None:
        if not self._publish:
            return
        if len(self._jobs) > 10_000:  # reports lost (worker error): forget the oldest
            self._jobs.pop(next(iter(self._jobs)))
        # references, sliced when the job is reported (no per-step copy of the prompt)
        self._jobs[(st.request.request_id, first)] = (st.request.prompt_token_ids or [],
                                                      st.hashes)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.loading = False
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, StoreWorkerMeta):
            return
        for req_id, first, n in meta.done:
            wanted = self._load_jobs.pop((req_id, first), None)
            st = self._reqs.get(req_id)
            if wanted is not None and n < wanted and st is not None:
                # After a failed load vLLM recomputes; an async request is queued again
                # and looked up again, and the master may still list the lost replicas.
                st.load_failed = True
            job = self._jobs.pop((req_id, first), None)
            if job is None or n <= 0:
                continue
            tokens, hashes = job
            upto = first + n  # the whole prefix up to here is available from the store
            self._events.append(BlockStored(
                block_hashes=list[Any](hashes[:upto]), parent_block_hash=None,
                token_ids=list(tokens[:upto * self._block_size]), block_size=self._block_size,
                lora_id=None, medium=MEDIUM_STORAGE, lora_name=None))

    def take_events(self) -> Iterable[KVCacheEvent]:
        out, self._events = self._events, []
        return out

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        if len(self._load_jobs) > 10_000:  # reports lost (worker error): forget the oldest
            self._load_jobs.pop(next(iter(self._load_jobs)))
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        client = StoreClient(self._master, int(self._extra.get("segment_mib", 0)) << 20,
                             rpc_timeout_s=self._rpc_timeout_s,
                             transfer_timeout_s=self._transfer_timeout_s)
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
        if self._l1_bytes >= total > 0:
            self._l1 = L1Pool(client, total, self._l1_bytes // total, self._replicas,
                              on_saved=self._l1_saved)
        log.info("kvmesh store connector: %d layers, %d B per block, keys %s, L1 %s",
                 len(self._layers), total, self._key_prefix,
                 f"{self._l1_bytes // total} blocks" if self._l1 else "off")

    def _regions(self, block_id: int) -> list[Region]:
        return [(base + block_id * stride, n) for base, stride, n in self._layers]

    def _get(self, items: list[tuple[str, list[Region]]]) -> list[str]:
        """L1 first, then the store."""
        assert self._client is not None
        if self._l1 is None:
            return list(self._client.get_many(items))
        results = ["ok" if hit else "" for hit in self._l1.load(items)]
        rest = [i for i, r in enumerate(results) if not r]
        for i, r in zip(rest, self._client.get_many([items[i] for i in rest]), strict=True):
            results[i] = r
        return results

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, StoreMeta) and meta.prefetch and self._l1 is not None:
            self._l1.prefetch(meta.prefetch)
        if not isinstance(meta, StoreMeta) or not meta.loads or self._client is None:
            return
        if self._async_load:  # into blocks of requests vLLM keeps waiting for us
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-load")
            for job in meta.loads:
                items = [(k, self._regions(b)) for k, b in zip(job.keys, job.block_ids,
                                                               strict=True)]
                self._inflight[job.req_id] = (job, self._loader.submit(self._get, items))
            return
        items = [(k, self._regions(b)) for job in meta.loads
                 for k, b in zip(job.keys, job.block_ids, strict=True)]
        results = self._get(items)
        ids = [b for job in meta.loads for b in job.block_ids]
        failed = {b for b, r in zip(ids, results, strict=True) if r != "ok"}
        self._report(meta.loads, results, ("ok",))
        if failed:
            log.warning("kvmesh store: %d of %d blocks failed to load", len(failed), len(ids))
            self._load_errors |= failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, StoreMeta) or not meta.saves or self._client is None:
            return
        direct = []
        for job in meta.saves:  # L1: copy now, write to the store in the background
            items = [(k, self._regions(b)) for k, b in zip(job.keys, job.block_ids,
                                                           strict=True)]
            if self._l1 is None or not self._l1.save((job.req_id, job.first), items):
                direct.append(job)
        if not direct:
            return
        items = [(k, self._regions(b)) for job in direct
                 for k, b in zip(job.keys, job.block_ids, strict=True)]
        results = self._client.put_many(items, replicas=self._replicas)
        self._report(direct, results, ("ok", "exists"))
        if "failed" in results:
            log.info("kvmesh store: %d of %d block saves failed",
                     results.count("failed"), len(results))

    def _report(self, jobs: list[BlockJob], results: Sequence[str],
                good: tuple[str, ...]) -> None:
        i = 0
        for job in jobs:
            n = _leading(results[i:i + len(job.keys)], good)
            i += len(job.keys)
            with self._done_lock:
                self._done.append((job.req_id, job.first, n))

    def _l1_saved(self, job_id: tuple[str, int], results: list[str]) -> None:
        """L1 thread: a write-behind job reached the store (or failed)."""
        with self._done_lock:
            self._done.append((job_id[0], job_id[1], _leading(results, ("ok", "exists"))))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._done_lock:
            if not self._done:
                return None
            out, self._done = StoreWorkerMeta(self._done), []
        return out

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        done = {r for r, (_, fut) in self._inflight.items() if fut.done()}
        for req_id in done:
            job, fut = self._inflight.pop(req_id)
            try:
                results = fut.result()
            except Exception:  # the loader thread failed: every block is a load error
                log.exception("kvmesh store: async load of %s failed", req_id)
                results = ["failed"] * len(job.keys)
            self._report([job], results, ("ok",))
            failed = {b for b, r in zip(job.block_ids, results, strict=True) if r != "ok"}
            if failed:  # reported in this same step, as vLLM requires
                log.warning("kvmesh store: %d of %d blocks failed to load", len(failed),
                            len(job.block_ids))
                self._load_errors |= failed
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
