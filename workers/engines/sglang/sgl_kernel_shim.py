"""A CPU shim for SGLang's ``sgl_kernel`` package: torch code for the few ops that
SGLang 0.5.23's torch_native CPU path imports, registered as ``sys.modules["sgl_kernel"]``.

Why: SGLang's CPU build imports ``sgl_kernel`` (``from sgl_kernel import ...``) whenever
``is_cpu()``. The real package ships CUDA kernels (``sglang-kernel`` on PyPI) or, in its
CPU build, AMX kernels; neither exists for this machine (AVX-512, no AMX, no GPU). This
shim is **not** that package: it has no ``torch.ops.sgl_kernel`` library, so SGLang's AMX
probe (``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``) stays false and every
layer (RMSNorm, SiLU, RoPE, linear, logits) takes its plain torch path.

Contract:

- :func:`install` puts a module named ``sgl_kernel`` into ``sys.modules`` (idempotent) with
  exactly the names in :data:`OPS`; it marks it ``__kvmesh_shim__ = True`` and is not a
  package, so ``sgl_kernel.scalar_type`` (quantisation) raises ImportError and SGLang uses
  its own fallback. Importing any other name from it raises ImportError: a new SGLang
  version that needs another op fails loudly at import, never silently.
- Ops with a torch implementation (found by a recording stub on an agg run; P/D over NIXL
  needed no other op): :func:`assign_req_to_token_pool_cpu`.
- Ops SGLang imports at module level only for features we do not serve (speculative
  decoding, KV moves between slots): present so the import works, raise
  NotImplementedError naming the op when called.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

MODULE_NAME = "sgl_kernel"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table.

    Same as SGLang's triton ``assign_req_to_token_pool``: for request ``i`` (in batch
    order), ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` gets the
    next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the slots of
    earlier requests come first). ``pool_len`` is the row length (unused: torch indexes
    rows directly).
    """
    del pool_len
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _unsupported(name: str, feature: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by kvmesh's CPU shim ({feature} is not "
            "supported on the SGLang CPU runtime)"
        )

    op.__name__ = name
    op.__qualname__ = name
    return op


_SPEC = "speculative decoding"
OPS: dict[str, Callable[..., Any]] = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "copy_all_layer_kv_cache_cpu": _unsupported("copy_all_layer_kv_cache_cpu", "moving KV slots"),
    "assign_draft_cache_locs_contiguous_cpu": _unsupported(
        "assign_draft_cache_locs_contiguous_cpu", _SPEC
    ),
    "assign_extend_cache_locs_cpu": _unsupported("assign_extend_cache_locs_cpu", _SPEC),
    "build_tree_kernel_efficient_cpu": _unsupported("build_tree_kernel_efficient_cpu", _SPEC),
    "fill_accept_out_cache_loc_cpu": _unsupported("fill_accept_out_cache_loc_cpu", _SPEC),
    "fill_bonus_tokens_cpu": _unsupported("fill_bonus_tokens_cpu", _SPEC),
    "verify_tree_greedy_cpu": _unsupported("verify_tree_greedy_cpu", _SPEC),
}


def install() -> types.ModuleType:
    """Register the shim as ``sys.modules["sgl_kernel"]`` (once) and return it.

    Raises RuntimeError when a different ``sgl_kernel`` (a real one) is already imported.
    """
    existing = sys.modules.get(MODULE_NAME)
    if existing is not None:
        if getattr(existing, "__kvmesh_shim__", False):
            return existing
        raise RuntimeError(f"a real sgl_kernel is already imported from {existing!r}")
    module = types.ModuleType(MODULE_NAME, __doc__)
    module.__file__ = __file__
    module.__spec__ = importlib.machinery.ModuleSpec(MODULE_NAME, None, origin=__file__)
    module.__kvmesh_shim__ = True  # type: ignore[attr-defined]
    module.__version__ = "0.0.0+kvmesh.cpu.shim"  # type: ignore[attr-defined]
    for name, op in OPS.items():
        setattr(module, name, op)
    sys.modules[MODULE_NAME] = module
    return module
