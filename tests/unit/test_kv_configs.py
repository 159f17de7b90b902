"""The worker's kv_transfer_config and EngineCore environment (workers.kv.configs), and
that building the engine leaves this process's environment alone."""

from __future__ import annotations

import os

import pytest

from workers.config import WorkerConfig
from workers.kv import nixl
from workers.kv.configs import (
    KvTransferSetup,
    combined_kv_transfer_config,
    store_kv_transfer_config,
    worker_kv_transfer,
)
from workers.main import build_engine

STORE_EXTRA = {"l1_mib": 2, "replicas": 2, "async_load": True}


def worker(**kw: object) -> WorkerConfig:
    base: dict[str, object] = {"engine": "vllm", "model_path": "/models/m", "nixl_port": 5999,
                               "worker_id": "w1", "store_l1_mib": 2, "store_replicas": 2,
                               "store_async_load": True}
    return WorkerConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_no_connector_no_environment() -> None:
    assert worker_kv_transfer(worker()) == KvTransferSetup(None, {})


def test_store_alone() -> None:
    setup = worker_kv_transfer(worker(store_master="h:1", kv_load_failure_policy="fail"))
    assert setup.config == store_kv_transfer_config("h:1", kv_load_failure_policy="fail",
                                                    extra=STORE_EXTRA)
    assert setup.config["kv_connector_module_path"] == "workers.kv.store_connector"
    assert setup.env == nixl.nixl_env(5999)  # the store's NIXL transfers use UCX too


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_handoff_alone_and_with_the_store(mode: str) -> None:
    plain = worker_kv_transfer(worker(role="prefill", handoff=mode))
    assert plain.config is not None and plain.env == nixl.nixl_env(5999)
    assert plain.config["kv_connector"] == nixl.CONNECTORS[mode]
    assert plain.config["kv_role"] == "kv_both"
    assert plain.config["kv_connector_module_path"] == nixl.QUIET_MODULE
    assert plain.config["engine_id"].startswith("w1-")
    assert plain.config["kv_connector_extra_config"] == (
        {"kv_lease_duration": 30} if mode == "pull"
        else {"kv_lease_duration": 60, "push_registration_timeout": 10.0})
    both = worker_kv_transfer(worker(role="prefill", handoff=mode, store_master="h:1"))
    assert both.config is not None and both.config["kv_connector"] == "MultiConnector"
    assert both.env == nixl.nixl_env(5999)
    nixl_part = {k: v for k, v in plain.config.items() if k != "kv_load_failure_policy"}
    nixl_part["engine_id"] = both.config["engine_id"]  # a fresh id per call
    assert both.config == combined_kv_transfer_config(nixl_part, "h:1",
                                                      kv_load_failure_policy="recompute",
                                                      store_extra=STORE_EXTRA)
    assert both.config["engine_id"] != plain.config["engine_id"]


def test_a_free_port_without_nixl_port() -> None:
    setup = worker_kv_transfer(worker(store_master="h:1", nixl_port=0))
    assert int(setup.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0


def test_building_the_engine_leaves_this_process_environment_alone() -> None:
    before = dict(os.environ)
    engine = build_engine(worker(role="decode", store_master="h:1"))
    assert dict(os.environ) == before
    cfg = engine.config  # type: ignore[attr-defined]
    assert cfg.env == nixl.nixl_env(5999)
    assert cfg.kv_transfer_config["kv_connector"] == "MultiConnector"
