"""The fleet's config: flags and env vars, validation, per-worker ids, roles and ports."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from workers.fleet import FleetConfig, worker_config


def test_flags_env_and_roles() -> None:
    cfg = load_config(FleetConfig, ["--workers", "2", "--prefill-workers", "1",
                                    "--decode-workers", "3", "--timing", "zero"],
                      {"KVMESH_SPEEDUP_RATIO": "4", "KVMESH_BLOCK_SIZE": "16"})
    assert cfg.engine == "mock" and cfg.metrics_port == -1
    assert cfg.speedup_ratio == 4.0 and cfg.block_size == 16  # any block size for mock
    assert cfg.roles() == ["agg", "agg", "prefill", "decode", "decode", "decode"]
    assert cfg.engine_config("agg", "", "m").handoff == ""
    e = cfg.engine_config("decode", "", "m")
    assert (e.handoff, e.block_size, e.timing, e.speedup_ratio) == ("mock", 16, "zero", 4.0)


def test_per_worker_ids_and_ports() -> None:
    cfg = load_config(FleetConfig, ["--port", "7000", "--metrics-port", "9000"], {})
    w = worker_config(cfg, 3, "prefill", "x-")
    assert (w.worker_id, w.role, w.port, w.metrics_port) == ("x-p3", "prefill", 7003, 9003)
    free = worker_config(load_config(FleetConfig, [], {}), 3, "agg", "x-")
    assert (free.port, free.metrics_port) == (0, -1)


@pytest.mark.parametrize("argv", [
    ["--workers", "0"],
    ["--prefill-workers", "1"],  # no decode workers
    ["--engine", "vllm"],
    ["--speedup-ratio", "0"],
    ["--timing", "bogus"],
    ["--transfer-bandwidth", "0"],
])
def test_bad_configs_are_rejected(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        load_config(FleetConfig, argv, {})
