"""The engine's ``ec_transfer_config`` (vLLM ``ECTransferConfig``), as plain dicts.

No vllm import. Pass the dict to ``ECTransferConfig(**cfg)`` (or ``--ec-transfer-config``).

Contract:

- ``nixl_ec_transfer_config(role, *, engine_id=None, lease_s=None, pool_mib=None,
  transfer_timeout_s=None, extra=None)``: the kvmesh NIXL connector
  (:mod:`workers.ec.connector`, the default backend). ``role`` is "ec_producer" (E,
  encoder only) or "ec_consumer" (P, or the aggregated worker). ``engine_id`` None ->
  a fresh one (:func:`workers.kv.nixl.new_engine_id`): one per engine launch, since it
  names the NIXL agent and the region file. The optional settings go to
  ``ec_connector_extra_config`` and are validated here
  (:class:`workers.ec.core.EcSettings`); ValueError on a bad role or setting.
- ``example_ec_transfer_config(role, shared_storage_path)``: vLLM's
  ``ECExampleConnector`` (safetensors files in a folder both engines see): the fallback.
- ``ec_transfer_config(role, backend="nixl", *, shared_storage_path=None, **settings)``:
  either, by ``backend`` ("nixl" or "example"; the latter needs ``shared_storage_path``).
- ``ec_env(host)``: environment the EngineCore of a NIXL EC engine must inherit (UCX over
  TCP/shared memory on loopback, ``VLLM_HOST_IP``), as for the KV handoff.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from workers.ec.core import EcSettings
from workers.kv.nixl import new_engine_id

EcRole = Literal["ec_producer", "ec_consumer"]
Backend = Literal["nixl", "example"]

MODULE = "workers.ec.connector"
CONNECTOR = "KvmeshECConnector"
EXAMPLE_CONNECTOR = "ECExampleConnector"
_ROLES = ("ec_producer", "ec_consumer")
BACKENDS = ("nixl", "example")


def _check_role(role: str) -> None:
    if role not in _ROLES:
        raise ValueError(f"role must be one of {_ROLES}, got {role!r}")


def nixl_ec_transfer_config(
    role: EcRole,
    *,
    engine_id: str | None = None,
    lease_s: float | None = None,
    pool_mib: int | None = None,
    transfer_timeout_s: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``ec_transfer_config`` for the kvmesh NIXL EC connector (see the module doc)."""
    _check_role(role)
    settings: dict[str, Any] = dict(extra or {})
    for key, value in (("lease_s", lease_s), ("pool_mib", pool_mib),
                       ("transfer_timeout_s", transfer_timeout_s)):
        if value is not None:
            settings[key] = value
    EcSettings.from_extra(settings)  # ValueError now, not inside EngineCore
    return {
        "ec_connector": CONNECTOR,
        "ec_connector_module_path": MODULE,
        "ec_role": role,
        "engine_id": engine_id or new_engine_id("ec-e" if role == "ec_producer" else "ec-c"),
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": settings,
    }


def example_ec_transfer_config(role: EcRole, shared_storage_path: str) -> dict[str, Any]:
    """``ec_transfer_config`` for vLLM's ECExampleConnector (a shared folder)."""
    _check_role(role)
    if not shared_storage_path:
        raise ValueError("shared_storage_path must not be empty")
    return {
        "ec_connector": EXAMPLE_CONNECTOR,
        "ec_role": role,
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {"shared_storage_path": str(shared_storage_path)},
    }


def ec_transfer_config(role: EcRole, backend: Backend = "nixl", *,
                       shared_storage_path: str | None = None,
                       **settings: Any) -> dict[str, Any]:
    """The NIXL connector (default) or the ECExampleConnector fallback."""
    if backend == "nixl":
        return nixl_ec_transfer_config(role, **settings)
    if backend == "example":
        if settings:
            raise ValueError(f"settings {sorted(settings)} apply to the nixl backend only")
        return example_ec_transfer_config(role, shared_storage_path or "")
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def ec_env(host: str = "127.0.0.1") -> dict[str, str]:
    """Environment for a NIXL EC engine's EngineCore (set before it starts): UCX as
    :func:`workers.kv.nixl.ucx_env` chooses it for ``host``."""
    from workers.kv.nixl import ucx_env

    return ucx_env(host)
