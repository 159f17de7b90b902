"""kvmesh's vLLM KV connector: prefix blocks saved to and loaded from the kvmesh store.

Loaded by vLLM inside EngineCore through ``kv_transfer_config``
(:func:`workers.kv.configs.store_kv_transfer_config`)::

    {"kv_connector": "KvmeshStoreConnector",
     "kv_connector_module_path": "workers.kv.store_connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"store_master": "host:port", ...}}

Extra config (:class:`~workers.kv.store.planner.StoreSettings`): ``store_master``
(required), ``replicas`` (1), ``save`` / ``load`` (true), ``segment_mib`` (0: the worker
contributes no memory; store nodes do), ``publish_events`` (true), ``l1_mib`` (0: no L1),
``async_load`` (false), ``rpc_timeout_s``, ``transfer_timeout_s``.
:func:`workers.kv.configs.combined_kv_transfer_config` builds the ``MultiConnector`` form
(NIXL P→D + store).

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

:class:`KvmeshStoreConnector` is a facade, as vLLM's ``NixlConnector`` is: in role
SCHEDULER it holds a :class:`~workers.kv.store.scheduler.StoreConnectorScheduler`, in
role WORKER a :class:`~workers.kv.store.worker.StoreConnectorWorker`, and forwards each
hook to its half (contracts in those modules; the planning itself is vLLM-free, in
:mod:`workers.kv.store.planner`):

- scheduler half: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta`` (with the bound KV cache manager), ``update_connector_output``,
  ``take_events``, ``request_finished`` / ``request_finished_all_groups`` (the first
  group's block ids) → ``(False, None)``;
- worker half: ``register_kv_caches``, ``start_load_kv`` / ``wait_for_save`` (with the
  bound :class:`~workers.kv.store.metadata.StoreMeta`), ``build_connector_worker_meta``,
  ``get_finished`` → ``(None, finished async loads)``, ``get_block_ids_with_load_errors``;
- ``wait_for_layer_load`` / ``save_kv_layer``: nothing (loads complete before the
  forward; saves happen in ``wait_for_save``); ``get_kv_connector_stats``: vLLM's default
  None (loads show in vLLM's connector hit / external token counters);
- ``counters()``: the store client's op/byte counts of this process's half;
  ``shutdown()``: shuts the half down.

Called in the other role, a worker hook and the report hooks return their empty answer
(nothing to load, save or report). HMA: the class declares ``SupportsHMA`` so that a
``MultiConnector`` with NIXL keeps vLLM's hybrid allocator setting equal to a NIXL-only
peer's (it is part of NIXL's handshake compatibility hash); with more than one KV cache
group (hybrid models) the connector turns itself off (saves and loads nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from workers.kv.layout import kv_layout
from workers.kv.store.planner import StoreSettings, key_prefix
from workers.kv.store.scheduler import StoreConnectorScheduler
from workers.kv.store.worker import StoreConnectorWorker

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

__all__ = ["KvmeshStoreConnector"]

log = logging.getLogger(__name__)


class KvmeshStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM connector for the kvmesh store; see the module docstring for each hook."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        self.settings = StoreSettings.from_extra(
            self._kv_transfer_config.kv_connector_extra_config or {}, groups)
        if groups > 1:
            log.warning("kvmesh store connector: %d KV cache groups; store disabled", groups)
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        prefix = key_prefix(kv_layout(vllm_config), tp_rank,
                            vllm_config.parallel_config.tensor_parallel_size)
        self.connector_scheduler: StoreConnectorScheduler | None = None
        self.connector_worker: StoreConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = StoreConnectorScheduler(
                self.settings, int(vllm_config.cache_config.block_size), prefix)
        else:
            self.connector_worker = StoreConnectorWorker(self.settings, prefix)

    def _scheduler(self) -> StoreConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side hook in a worker"
        return self.connector_scheduler

    # -- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output,
                                                      self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.connector_scheduler is None:
            return []
        return self.connector_scheduler.take_events()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.connector_scheduler is None:
            return False, None
        return self.connector_scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None, "register_kv_caches in the scheduler"
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.connector_worker is not None:
            self.connector_worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_save(self._connector_metadata)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        if self.connector_worker is None:
            return None, None
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    # -- both ---------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        half = self.connector_worker or self.connector_scheduler
        return half.counters() if half is not None else {}

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
