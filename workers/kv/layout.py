"""The KV layout of a vLLM engine, as one comparable string.

Contract:

- ``kv_layout(vllm_config) -> str``: equal for two engines exactly when a KV block of one
  can be copied into the other unchanged: model architecture, model dtype, KV cache dtype,
  attention kind (MLA or not), total layers, total KV heads, head size and block size.
  Tensor parallelism is left out (NIXL maps between TP sizes itself). Reads only the
  config (duck-typed, so this module imports no vllm).
"""

from __future__ import annotations

from typing import Any


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
