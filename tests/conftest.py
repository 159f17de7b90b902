"""Session fixtures: real etcd and Redis on free loopback ports, stopped by PID; the
fault table (``tests/faults/table.py``), written at the end to ``$KVMESH_FAULTS_JSON`` or
into the session's log folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from services.common.procs import Child, start_etcd, start_redis  # noqa: E402
from tests.faults.table import FaultTable  # noqa: E402


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Child]:
    child = start_etcd(tmp_path_factory.mktemp("etcd"), log_dir)
    yield child
    child.stop()


@pytest.fixture(scope="session")
def redis_server(log_dir: Path) -> Iterator[Child]:
    child = start_redis(log_dir)
    yield child
    child.stop()


@pytest.fixture(scope="session")
def fault_table(log_dir: Path) -> Iterator[FaultTable]:
    table = FaultTable()
    yield table
    table.write(Path(os.environ.get("KVMESH_FAULTS_JSON") or log_dir / "faults.json"))
