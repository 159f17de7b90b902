import dataclasses

import pytest

from services.common.config import BaseConfig, ConfigError, load_config
from workers.config import WorkerConfig


def test_defaults_env_and_flags_precedence() -> None:
    env = {"KVMESH_NAMESPACE": "fromenv", "KVMESH_LEASE_TTL": "7"}
    cfg = load_config(BaseConfig, ["--lease-ttl", "3"], env)
    assert cfg.namespace == "fromenv"  # env beats default
    assert cfg.lease_ttl == 3  # flag beats env
    assert cfg.etcd_endpoint == "127.0.0.1:2379"  # default


def test_validate_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(BaseConfig, ["--port", "70000", "--lease-ttl", "0"], {})
    assert "port out of range" in str(err.value)
    assert "lease_ttl" in str(err.value)


def test_bad_env_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="KVMESH_PORT"):
        load_config(BaseConfig, [], {"KVMESH_PORT": "eighty"})


def test_bool_fields_parse_from_env_and_flag() -> None:
    @dataclasses.dataclass
    class C(BaseConfig):
        flag: bool = False

    assert load_config(C, [], {"KVMESH_FLAG": "yes"}).flag is True
    assert load_config(C, ["--flag"], {}).flag is True
    assert load_config(C, ["--flag", "false"], {"KVMESH_FLAG": "1"}).flag is False


def test_worker_config_rules() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(WorkerConfig, ["--role", "boss", "--block-size", "48"], {})
    msg = str(err.value)
    assert "role must be one of" in msg and "multiple of 32" in msg and "model_path" in msg
    ok = load_config(WorkerConfig, ["--model-path", "/m", "--role", "prefill"], {})
    assert ok.role == "prefill"
    first = ok.resolved_worker_id()
    assert first.startswith("worker-") and ok.resolved_worker_id() == first
    again = load_config(WorkerConfig, ["--model-path", "/m"], {})
    assert again.resolved_worker_id() != first  # fresh id per launch
