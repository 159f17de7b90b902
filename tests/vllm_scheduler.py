"""A real vLLM scheduler for connector unit tests, as vLLM's own connector tests build one
(``tests/v1/kv_connector/unit/utils.py``, not installed): a real ``VllmConfig`` of the
local tiny model with a ``kv_transfer_config``, a real
``vllm.v1.core.sched.scheduler.Scheduler`` (which creates the connector through vLLM's
factory), real ``Request`` objects and hand-made model runner outputs. No engine, no
model run, no network.

Contract:

- ``create_vllm_config(kv_transfer_config, *, block_size=32, dtype="float32",
  max_num_batched_tokens=1024)`` → ``VllmConfig`` of
  :func:`workers.model.tiny.ensure_tiny_model` on the CPU device.
- ``create_scheduler(vllm_config, num_blocks=256)`` → ``Scheduler`` with one
  full-attention KV cache group of ``num_blocks`` blocks (block 0 is vLLM's null block).
- ``create_request(request_id, token_ids, *, block_size=32, max_tokens=4, lora=None)`` →
  a ``Request`` with vLLM's block hasher for ``block_size`` (which must be the
  scheduler's, so the prefix cache works) and greedy sampling.
- ``runner_output(scheduler, out, *, kv_connector_output=None)`` → the
  ``ModelRunnerOutput`` of the step that ``scheduler`` scheduled as ``out``: one sampled
  token (id 7) for every request whose prompt the step completes, none for a partial
  prefill.
- ``EventRecorder``: a KV event publisher that keeps the batches vLLM publishes
  (``scheduler.kv_event_publisher = EventRecorder()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from workers.model.tiny import EOS_ID, ensure_tiny_model

SAMPLED = 7  # the token every step samples
MAX_MODEL_LEN = 1024
init_none_hash(sha256)


def create_vllm_config(kv_transfer_config: dict[str, Any], *, block_size: int = 32,
                       dtype: Literal["float32", "bfloat16"] = "float32",
                       max_num_batched_tokens: int = 1024
                       ) -> VllmConfig:
    model = ModelConfig(model=str(ensure_tiny_model()), dtype=dtype, seed=0,
                        max_model_len=MAX_MODEL_LEN)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
            is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(**kv_transfer_config),
        device_config=DeviceConfig("cpu"),
    )


def create_scheduler(vllm_config: VllmConfig, num_blocks: int = 256) -> Scheduler:
    block_size = vllm_config.cache_config.block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32))])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=block_size, log_stats=True)


def create_request(request_id: str, token_ids: Sequence[int], *, block_size: int = 32,
                   max_tokens: int = 4, lora: Any = None,
                   cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.update_from_generation_config({}, EOS_ID)
    return Request(request_id=request_id, prompt_token_ids=list(token_ids),
                   sampling_params=params, pooling_params=None, lora_request=lora,
                   cache_salt=cache_salt, block_hasher=get_request_block_hasher(block_size, sha256))


def runner_output(scheduler: Scheduler, out: SchedulerOutput, *,
                  kv_connector_output: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens  # the scheduler already advanced it
        sampled.append([SAMPLED] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
        pooler_output=None, kv_connector_output=kv_connector_output)


class EventRecorder:
    """Stands in for vLLM's ZMQ KV event publisher (the process boundary) and keeps what
    the scheduler publishes."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, events: KVEventBatch) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        return

    def take(self) -> list[Any]:
        out = [ev for batch in self.batches for ev in batch.events]
        self.batches.clear()
        return out
