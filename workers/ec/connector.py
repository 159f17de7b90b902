"""kvmesh's vLLM EC (encoder cache) connector: embeddings from E to P over NIXL.

Loaded by vLLM inside EngineCore through ``ec_transfer_config``
(:func:`workers.ec.configs.nixl_ec_transfer_config`)::

    {"ec_connector": "KvmeshECConnector",
     "ec_connector_module_path": "workers.ec.connector",
     "ec_role": "ec_producer" | "ec_consumer",
     "ec_connector_extra_config": {"lease_s": 30, "pool_mib": 64, ...}}

Extra config: :class:`~workers.ec.core.EcSettings` (an unknown key is a ValueError).

The flow (the orchestrator carries E's answer to the consumer):

1. E (``ec_producer``, encoder only) gets the request with its image and
   ``multi_modal_uuids`` (vLLM uses them as ``mm_hash`` unchanged). It encodes, copies
   each embedding into its NIXL-registered region and answers with
   ``RequestOutput.ec_transfer_params = {mm_hash: {"kvmesh": descriptor, ...}}``.
2. The consumer (P, or the aggregated worker) gets the same prompt, image and uuids with
   ``SamplingParams.extra_args = {"ec_transfer_params": <E's params>}``. Its scheduler
   READs each embedding from E over NIXL into its staging region before it schedules the
   request; the worker puts it into vLLM's encoder cache, so vLLM skips the encoder.
   The consumer's ``request_finished`` returns, as the request's ``ec_transfer_params``,
   a :class:`~workers.ec.core.TransferReport` per embedding (READ or fallback, bytes,
   start/end): the worker records the ``embedding_transfer`` span and metrics from the
   final ``RequestOutput`` (:mod:`workers.service`).
3. The READ notifies E, which unpins the slot; E unpins it anyway when the lease
   (``lease_s``) ends: the KV handoff's delayed-free rule. An unpinned slot is freed, or
   with ``retain_mib`` kept as E's embedding cache until evicted (LRU); the consumer
   re-reads the header after the payload, so an eviction during its READ is seen. A
   consumer that cannot get an embedding (E gone, lease over, evicted, bad descriptor)
   encodes the image itself.

:class:`KvmeshECConnector` is a facade, as :mod:`workers.kv.store_connector` is: in role
SCHEDULER it holds a :class:`~workers.ec.scheduler.ProducerScheduler` or
:class:`~workers.ec.scheduler.ConsumerScheduler` (by ``ec_role``), in role WORKER an
:class:`~workers.ec.worker.EcWorker`, and forwards each hook to it (contracts there):

- scheduler side: ``has_cache_item``, ``ensure_cache_available`` (consumer),
  ``update_state_after_alloc`` (consumer), ``build_connector_meta``, ``request_finished``;
- worker side: ``start_save_caches`` / ``save_caches`` (producer), ``start_load_caches``
  (consumer); ``get_finished`` and worker metadata are vLLM's defaults (every copy ends
  within its step);
- ``counters()``: the half's counters; ``shutdown()``: shuts the half down.

``ec_both`` is refused (ValueError): an engine is either E or a consumer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from workers.ec.core import EcSettings
from workers.ec.metadata import EcMeta
from workers.ec.scheduler import ConsumerScheduler, ProducerScheduler
from workers.ec.worker import EcWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KvmeshECConnector"]


class KvmeshECConnector(ECConnectorBase):
    """vLLM EC connector over NIXL; see the module docstring for each hook."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        assert ec is not None  # the base class checked
        if self.is_producer and self.is_consumer:
            raise ValueError("KvmeshECConnector: ec_role must be ec_producer or ec_consumer, "
                             "not ec_both")
        self.settings = EcSettings.from_extra(ec.ec_connector_extra_config or {})
        self._producer: ProducerScheduler | None = None
        self._consumer: ConsumerScheduler | None = None
        self._worker: EcWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            if self.is_producer:
                self._producer = ProducerScheduler(vllm_config, self.settings)
            else:
                self._consumer = ConsumerScheduler(vllm_config, self.settings)
        else:
            self._worker = EcWorker()

    def _meta(self) -> EcMeta | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, EcMeta) else None

    # -- worker side --------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.start_load_caches(meta, encoder_cache)

    def start_save_caches(self, **kwargs: Any) -> None:
        meta, cache = self._meta(), kwargs.get("encoder_cache")
        if self._worker is not None and meta is not None and cache is not None:
            self._worker.start_save_caches(meta, cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str,
                    **kwargs: Any) -> None:
        if self._worker is not None and self.is_producer:
            self._worker.save_caches(encoder_cache, mm_hash)

    # -- scheduler side -----------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        return self._consumer is not None and self._consumer.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._consumer is None:
            return True
        return self._consumer.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self._consumer is not None:
            self._consumer.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        if self._producer is not None:
            return self._producer.build_connector_meta(scheduler_output)
        if self._consumer is not None:
            return self._consumer.build_connector_meta(scheduler_output)
        return EcMeta()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._producer is not None:
            return self._producer.request_finished(request)
        if self._consumer is not None:
            return self._consumer.request_finished(request)
        return False, None

    # -- both ---------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        half = self._producer or self._consumer or self._worker
        return half.counters() if half is not None else {}

    def shutdown(self) -> None:
        for half in (self._producer, self._consumer, self._worker):
            if half is not None:
                half.shutdown()
