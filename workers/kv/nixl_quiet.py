"""vLLM's NIXL connectors with NIXL's progress thread off (loaded inside EngineCore).

Select with ``nixl_kv_transfer_config(..., progress_thread=False)``, which sets
``kv_connector_module_path`` to this module; vLLM then imports it in the EngineCore
process and takes the class named by ``kv_connector`` from here.

Why: vLLM builds its NIXL agent with ``nixl_agent_config(num_threads=4,
capture_telemetry=True)`` (``nixl/base_worker.py``), so NIXL's progress thread is on, and
NIXL's Python API fixes its poll delay at 0 (``nixl_cu12/_api.py``: ``pthrDelay = 0``):
``nixlUcxSharedThread::run`` spins on ``poll(timeout=0)`` and keeps one core busy per
idle engine (measured: ~80-100 % per P or D, ~1 % with the thread off). vLLM polls
transfers and notifications itself every engine step (and push mode's writer thread
polls too), so the handoff does not need the thread.

Contract:

- Importing this module wraps ``base_worker.nixl_agent_config`` (once per process) so
  every NIXL agent built afterwards in this process has ``enable_prog_thread=False``;
  nothing else changes.
- ``NixlConnector`` / ``NixlPullConnector`` / ``NixlPushConnector``: vLLM's classes,
  subclassed without changes, so ``kv_connector`` keeps vLLM's names.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPullConnector as _VllmPull,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPushConnector as _VllmPush,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

_QUIET_MARK = "_kvmesh_quiet"


def _install() -> None:
    original = base_worker.nixl_agent_config
    if original is None or getattr(original, _QUIET_MARK, False):
        return  # NIXL missing (vLLM then fails on its own) or already installed

    def quiet_config(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return original(*args, **kwargs)

    setattr(quiet_config, _QUIET_MARK, True)
    base_worker.nixl_agent_config = quiet_config


_install()


class NixlPullConnector(_VllmPull):
    """vLLM's pull (READ) connector; NIXL agent without progress thread."""


class NixlPushConnector(_VllmPush):
    """vLLM's push (WRITE) connector; NIXL agent without progress thread."""


NixlConnector = NixlPullConnector
