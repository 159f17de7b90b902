"""E's engine: vLLM as an ``ec_producer`` (encoder only) with the kvmesh EC connector.

Built on :class:`workers.engines.vllm_engine.VllmEngine` (start in a thread, scoped
EngineCore environment, death watch, shutdown); only the image request is E's own.

Contract of :class:`EncoderEngine`:

- ``EncoderEngine(config)``: the ``ec_transfer_config`` is
  :func:`workers.ec.configs.nixl_ec_transfer_config` ("ec_producer", a fresh engine id,
  ``lease_s``, ``pool_mib``, ``retain_mib``), one image per prompt, UCX on loopback
  (:func:`workers.ec.configs.ec_env`) for EngineCore only.
- ``start()`` / ``shutdown()`` / ``wait_dead()`` / ``info``: the VllmEngine's.
- ``encode(image, mm_hash, request_id)`` -> :class:`Encoded`: one engine request, prompt
  ``config.image_placeholder`` with the image and ``multi_modal_uuids = [mm_hash]`` (vLLM
  uses it as the ``mm_hash``), ``max_tokens=1`` (E produces no token); returns E's
  ``ec_transfer_params[mm_hash]`` (the connector's descriptor, see
  :mod:`workers.ec.connector`), the queue time (EngineCore's timestamps) and the time
  from scheduling to the answer. :class:`NotPublished` when E could not publish it (its
  region full: the connector logs it); :class:`~workers.engines.base.EngineDeadError`
  when the engine is dead; :class:`~workers.engines.base.EngineError` for what vLLM
  refuses.
- ``slot_valid(mm_hash, entry)``: whether the slot ``entry``'s descriptor names still holds its
  embedding, read from E's region file on this host (the slot header; see
  :func:`workers.ec.core.check_header`). This is how a cache hit is checked against the
  connector's own retention (its LRU may have evicted the slot first).
- ``stats()``: the connector's counters from the region's stats block (scheduler and
  worker halves: ``encodes`` counts vision encoder runs); ``{}`` before EngineCore
  created the region.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.ec.configs import ec_env, nixl_ec_transfer_config
from workers.ec.core import HEADER_BYTES, PARAMS_KEY, STATS_BYTES, check_header, unpack_stats
from workers.ec.transport import find_region, peek
from workers.engines.base import EngineDeadError, EngineError, EngineInfo
from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig


class NotPublished(Exception):
    """E encoded the image but could not publish the embedding (region full)."""


@dataclass
class EncoderEngineConfig:
    model_path: str
    model_name: str = ""
    dtype: str = "float32"
    max_model_len: int = 512
    max_num_seqs: int = 8
    pool_mib: int = 64  # E's NIXL region: embeddings held for consumers, and retained
    retain_mib: int = 32  # of which kept as the embedding cache after leases end
    lease_s: float = 30.0
    image_placeholder: str = "<image>"
    region_dir: str = "/dev/shm"
    host: str = "127.0.0.1"  # where consumers reach E's NIXL agent (the public host)
    extra_engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Encoded:
    entry: dict[str, Any]  # E's ec_transfer_params[mm_hash]
    nbytes: int  # the slot's bytes (header + payload): what the cache holds
    queue_s: float
    encode_s: float


class EncoderEngine:
    """See the module docstring."""

    def __init__(self, config: EncoderEngineConfig) -> None:
        self.config = config
        self.ec_transfer_config = nixl_ec_transfer_config(
            "ec_producer", lease_s=config.lease_s, pool_mib=config.pool_mib,
            extra={"retain_mib": config.retain_mib, "region_dir": config.region_dir})
        self.engine_id = str(self.ec_transfer_config["engine_id"])
        kwargs = {"ec_transfer_config": self.ec_transfer_config,
                  "limit_mm_per_prompt": {"image": 1}, "max_num_seqs": config.max_num_seqs,
                  **config.extra_engine_kwargs}
        self._vllm = VllmEngine(VllmEngineConfig(
            model_path=config.model_path, served_model_name=config.model_name or None,
            max_model_len=config.max_model_len, dtype=config.dtype,
            kv_cache_space_gib=0.25, enable_prefix_caching=False, engine_kwargs=kwargs,
            env=ec_env(config.host)))
        self._ids = itertools.count(1)
        self._region: str | None = None

    @property
    def info(self) -> EngineInfo:
        return self._vllm.info

    async def start(self) -> None:
        await self._vllm.start()

    async def shutdown(self) -> None:
        await self._vllm.shutdown()

    async def wait_dead(self) -> str:
        return await self._vllm.wait_dead()

    async def encode(self, image: Any, mm_hash: str, request_id: str) -> Encoded:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        llm = self._vllm.llm
        prompt: Any = {"prompt": self.config.image_placeholder,
                       "multi_modal_data": {"image": image},
                       "multi_modal_uuids": {"image": [mm_hash]}}
        params = SamplingParams(max_tokens=1, temperature=0.0,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        rid = f"{request_id}-e{next(self._ids)}"
        t0 = time.monotonic()
        final = None
        try:
            async for out in llm.generate(prompt, params, rid):
                final = out
        except VllmDeadError as exc:
            raise EngineDeadError(f"the encoder engine died: {exc}") from exc
        except (VLLMClientError, ValueError) as exc:
            raise EngineError(str(exc)) from exc
        wall = time.monotonic() - t0
        entry = ((final.ec_transfer_params or {}).get(mm_hash)
                 if final is not None and final.finished else None)
        if not isinstance(entry, Mapping) or PARAMS_KEY not in entry:
            raise NotPublished(f"the encoder could not publish the embedding of {mm_hash} "
                               "(its region is full; see its log)")
        metrics = getattr(final, "metrics", None)
        queued = getattr(metrics, "queued_ts", 0.0)
        scheduled = getattr(metrics, "scheduled_ts", 0.0)
        queue_s = max(0.0, scheduled - queued) if queued and scheduled else 0.0
        desc = entry[PARAMS_KEY]
        self._region = str(desc.get("region") or "") or self._region
        return Encoded(dict(entry), HEADER_BYTES + int(desc["nbytes"]), queue_s,
                       max(0.0, wall - queue_s))

    def slot_valid(self, mm_hash: str, entry: Mapping[str, Any]) -> bool:
        desc = entry.get(PARAMS_KEY) or {}
        try:
            header = peek(str(desc["region"]), int(desc["offset"]), HEADER_BYTES)
        except (KeyError, OSError, ValueError):
            return False
        return check_header(header, mm_hash, int(desc["nbytes"])) is None

    def stats(self) -> dict[str, int]:
        region = self._region or find_region(self.config.region_dir, self.engine_id,
                                             "producer")
        if region is None:
            return {}
        try:
            return unpack_stats(peek(region, 0, STATS_BYTES))
        except OSError:
            return {}
