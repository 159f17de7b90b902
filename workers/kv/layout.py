"""What a built vLLM engine tells peers about its KV: layout string and handoff coordinates.

Contract:

- ``kv_layout(vllm_config) -> str``: equal for two engines exactly when a KV block of one
  can be copied into the other unchanged: model architecture, model dtype, KV cache dtype,
  attention kind (MLA or not), total layers, total KV heads, head size and block size.
  Tensor parallelism is left out (NIXL maps between TP sizes itself). Reads only the
  config (duck-typed, so this module imports no vllm).
- ``handoff_of(vllm_config, environ) -> dict``: :attr:`EngineInfo.handoff` from the
  resolved ``kv_transfer_config`` (vLLM fills in a missing ``engine_id``), the parallel
  config and the environment the EngineCore got (see :func:`workers.kv.nixl.handoff_info`);
  ``{}`` without a KV connector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.kv.nixl import NIXL_CONNECTORS, handoff_info


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def kv_layout(vllm_config: Any) -> str:
    """``arch|dtype|kv=<cache dtype>|mla|L<layers>|KVH<kv heads>|D<head size>|B<block>``."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parts = [
        str(model.architecture),
        _dtype_name(model.dtype),
        f"kv={cache.cache_dtype}",
        "mla" if model.use_mla else "mha",
        f"L{model.get_total_num_hidden_layers()}",
        f"KVH{model.get_total_num_kv_heads()}",
        f"D{model.get_head_size()}",
        f"B{cache.block_size}",
    ]
    return "|".join(parts)


def handoff_of(vllm_config: Any, environ: Mapping[str, str]) -> dict[str, Any]:
    """The engine's handoff coordinates (``{}`` without ``kv_transfer_config``)."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        return {}
    par = vllm_config.parallel_config
    connector = ktc.kv_connector
    if connector == "MultiConnector":  # NIXL P→D handoff + the kvmesh store: the NIXL child
        children = (ktc.kv_connector_extra_config or {}).get("connectors", [])
        connector = next((c["kv_connector"] for c in children
                          if c.get("kv_connector") in NIXL_CONNECTORS), connector)
    return handoff_info(
        connector,
        ktc.engine_id,
        ktc.kv_role,
        tp_size=par.tensor_parallel_size,
        port_offset=getattr(par, "data_parallel_index", 0),
        environ=environ,
    )
