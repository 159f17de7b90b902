"""The engine's ``kv_transfer_config`` (and its environment), as plain dicts; no vllm import.

Contract:

- ``store_kv_transfer_config(store_master, *, kv_load_failure_policy, replicas, save,
  load, extra)``: the kvmesh store connector alone
  (:mod:`workers.kv.store_connector`); ``extra`` joins its ``kv_connector_extra_config``.
  ValueError for a policy other than None, "recompute" or "fail".
- ``combined_kv_transfer_config(nixl_config, store_master, *, kv_load_failure_policy,
  store_extra)``: vLLM's ``MultiConnector`` with NIXL (P→D) first, then the store.
- ``worker_kv_transfer(cfg)`` → :class:`KvTransferSetup`: for a
  :class:`~workers.config.WorkerConfig`, the NIXL handoff of its mode and/or the store
  connector (``--store-master``), and the environment its EngineCore must get
  (:func:`~workers.kv.nixl.nixl_env`: the NIXL side channel on ``--nixl-port``, else a
  free port, and UCX on loopback, which the store's NIXL transfers use too). Pass it as
  ``VllmEngineConfig.env``: the engine applies it only while it spawns its EngineCore,
  never to the worker process as a whole. Push mode also gets vLLM's
  ``push_registration_timeout`` = ``--kv-handoff-timeout-s`` (in vLLM 0.32 that watchdog
  only logs; the worker bounds pull mode only, push waits for the frontend's timeout). No
  config and no environment without either connector; every call gets a fresh NIXL
  engine id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.kv.nixl import new_engine_id, nixl_env, nixl_kv_transfer_config

if TYPE_CHECKING:
    from workers.config import WorkerConfig

STORE_MODULE = "workers.kv.store_connector"
STORE_CLASS = "KvmeshStoreConnector"


def store_kv_transfer_config(
    store_master: str,
    *,
    kv_load_failure_policy: str | None = None,
    replicas: int = 1,
    save: bool = True,
    load: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``kv_transfer_config`` for an engine using the kvmesh store connector alone."""
    if kv_load_failure_policy not in (None, "recompute", "fail"):
        raise ValueError(f"bad kv_load_failure_policy {kv_load_failure_policy!r}")
    cfg: dict[str, Any] = {
        "kv_connector": STORE_CLASS,
        "kv_connector_module_path": STORE_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_master": store_master, "replicas": replicas,
                                      "save": save, "load": load, **(extra or {})},
    }
    if kv_load_failure_policy is not None:
        cfg["kv_load_failure_policy"] = kv_load_failure_policy
    return cfg


def combined_kv_transfer_config(
    nixl_config: dict[str, Any],
    store_master: str,
    *,
    kv_load_failure_policy: str | None = None,
    store_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM ``MultiConnector``: NIXL P→D handoff first, then the kvmesh store.

    ``nixl_config`` is :func:`workers.kv.nixl.nixl_kv_transfer_config`'s dict (its engine
    id and role become the top level's). vLLM loads from the first connector reporting
    matched tokens: a decode request with ``do_remote_prefill`` loads from P over NIXL;
    any other request (P's prefill, an aggregated one) loads its prefix from the store.
    Both save: NIXL keeps P's blocks for D under its own lease (request_finished → True),
    while the store's copy lives by the master's leases, pins and eviction: two separate
    retention rules. The failure policy applies to both.
    """
    nixl = dict(nixl_config)
    policy = kv_load_failure_policy or nixl.pop("kv_load_failure_policy", None)
    nixl.pop("kv_load_failure_policy", None)  # the top level carries it
    # vLLM 0.32's MultiConnector passes the top-level engine_id to every child and fails
    # ("multiple values for keyword argument 'engine_id'") when a child repeats it.
    engine_id = nixl.pop("engine_id", None)
    store = store_kv_transfer_config(store_master, extra=store_extra)
    cfg: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": nixl.get("kv_role", "kv_both"),
        "engine_id": engine_id,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"connectors": [nixl, store]},
    }
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return cfg


@dataclass(frozen=True)
class KvTransferSetup:
    """An engine's KV connector config and the environment its EngineCore needs."""

    config: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)


def worker_kv_transfer(cfg: WorkerConfig) -> KvTransferSetup:
    """The worker's KV connectors: the NIXL P→D handoff for its mode, the kvmesh store
    connector when ``--store-master`` is set, both through vLLM's MultiConnector when
    both are on (no config, no environment without either)."""
    mode = cfg.resolved_handoff()
    if mode == "none" and not cfg.store_master:
        return KvTransferSetup(None)
    from services.common.procs import free_port

    env = nixl_env(cfg.nixl_port or free_port(), cfg.public_host)
    store_extra = {"l1_mib": cfg.store_l1_mib, "replicas": cfg.store_replicas,
                   "async_load": cfg.store_async_load,
                   # mTLS to the store master, as the worker's identity
                   **({"tls_dir": cfg.tls_dir, "tls_cert": cfg.tls_cert or "worker"}
                      if cfg.tls_dir and not cfg.insecure else {})}
    if mode == "none":
        return KvTransferSetup(store_kv_transfer_config(
            cfg.store_master, kv_load_failure_policy=cfg.kv_load_failure_policy,
            extra=store_extra), env)
    # A decode worker also prefills locally (conditional disaggregation): kv_both for all.
    nixl_cfg = nixl_kv_transfer_config(
        mode,  # type: ignore[arg-type]
        new_engine_id(cfg.resolved_worker_id()), "kv_both",
        cfg.kv_load_failure_policy,  # type: ignore[arg-type]
        kv_lease_duration=30 if mode == "pull" else 60,
        # vLLM's own connector classes, with NIXL's busy-polling progress thread off: it
        # keeps a core busy per idle engine on this 2-core machine (workers/kv/nixl_quiet).
        progress_thread=False,
        # vLLM's own D-side push watchdog: it logs and drops a registration P never
        # fulfilled; the frontend's PUSH_TIMEOUT_S bounds the request (VllmEngineConfig).
        extra={"push_registration_timeout": cfg.kv_handoff_timeout_s} if mode == "push"
        else None,
    )
    if not cfg.store_master:
        return KvTransferSetup(nixl_cfg, env)
    return KvTransferSetup(
        combined_kv_transfer_config(nixl_cfg, cfg.store_master, store_extra=store_extra),
        env)
