import argparse
import dataclasses
import random
from pathlib import Path

import pytest

from services.common.config import (
    BaseConfig,
    ConfigError,
    SeededConfig,
    add_fields,
    from_args,
    load_config,
    seeded_rng,
)
from services.router.main import RouterConfig
from services.store_master.main import StoreMasterConfig
from workers.config import WorkerConfig
from workers.fleet import FleetConfig


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


def test_every_bad_env_value_is_named_in_one_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(BaseConfig, [], {"KVMESH_PORT": "eighty", "KVMESH_GRACE_S": "soon"})
    assert "KVMESH_PORT='eighty'" in str(err.value) and "KVMESH_GRACE_S='soon'" in str(err.value)


def test_any_dataclass_drives_a_parser_with_choices_paths_and_fixed_fields() -> None:
    @dataclasses.dataclass
    class Spec:
        mode: str = dataclasses.field(default="a", metadata={"choices": ("a", "b")})
        out: Path = Path("x")
        n: int = 1
        fixed: int = dataclasses.field(default=7, metadata={"flag": False})

    parser = argparse.ArgumentParser()
    problems = add_fields(parser, Spec, {"KVMESH_MODE": "c", "KVMESH_N": "two",
                                         "KVMESH_OUT": "/o", "KVMESH_FIXED": "9"})
    assert problems[0] == "KVMESH_MODE='c': not one of a, b"
    assert problems[1].startswith("KVMESH_N='two': ") and len(problems) == 2
    assert from_args(Spec, parser.parse_args([])) == Spec(out=Path("/o"))  # bad ones: default
    assert from_args(Spec, parser.parse_args(["--mode", "b", "--n", "3"])) == Spec(
        "b", Path("/o"), 3)
    for argv in (["--mode", "c"], ["--fixed", "9"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


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


@pytest.mark.parametrize("value", ["0", "-1", "nan", "3601"])
def test_kv_handoff_timeout_must_be_a_positive_bound(value: str) -> None:
    with pytest.raises(ConfigError, match="kv_handoff_timeout_s must be in"):
        load_config(WorkerConfig, ["--model-path", "/m", "--kv-handoff-timeout-s", value], {})
    cfg = load_config(WorkerConfig, ["--model-path", "/m"], {"KVMESH_KV_HANDOFF_TIMEOUT_S": "2.5"})
    assert cfg.kv_handoff_timeout_s == 2.5
    assert load_config(WorkerConfig, ["--model-path", "/m"], {}).kv_handoff_timeout_s == 10.0


@pytest.mark.parametrize("cls", [WorkerConfig, FleetConfig])
@pytest.mark.parametrize("value", ["-1", "nan", "1001"])
def test_the_kv_event_flush_delay_is_bounded(cls: type[WorkerConfig], value: str) -> None:
    with pytest.raises(ConfigError, match="kv_event_flush_ms must be in"):
        load_config(cls, ["--model-path", "/m", "--kv-event-flush-ms", value], {})
    assert load_config(cls, ["--model-path", "/m"], {}).kv_event_flush_ms == 2.0
    assert load_config(cls, ["--model-path", "/m", "--kv-event-flush-ms", "0"],
                       {}).kv_event_flush_ms == 0


@pytest.mark.parametrize("cls", [SeededConfig, RouterConfig, StoreMasterConfig])
def test_seed_below_minus_one_is_rejected_naming_the_field(cls: type[SeededConfig]) -> None:
    assert load_config(cls, ["--seed", "-1"], {}).seed == -1
    with pytest.raises(ConfigError, match=r"seed must be >= 0, or -1 .*got -2"):
        load_config(cls, ["--seed", "-2"], {})
    with pytest.raises(ValueError, match="got -5"):
        seeded_rng(-5)


def test_seeded_rng_is_reproducible_and_minus_one_is_not_fixed() -> None:
    def draws(rng: random.Random) -> list[float]:
        return [rng.random() for _ in range(8)]

    assert draws(seeded_rng(7)) == draws(seeded_rng(7)) == draws(random.Random(7))
    assert draws(seeded_rng(7)) != draws(seeded_rng(8))
    assert draws(seeded_rng(0)) == draws(random.Random(0))  # 0 is a seed, not "unseeded"
    assert draws(seeded_rng(-1)) != draws(seeded_rng(-1))  # from the OS: 2^-512 to collide
