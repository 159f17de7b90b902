"""``kvmesh up``: every flag has a ``KVMESH_*`` variable (flag > env var > default), and a bad
value exits 2 naming the variable before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from services.common.config import from_args
from services.launcher import cli
from services.launcher.up import MeshSpec

# One valid non-default value per ``kvmesh up`` flag: (env value, parsed value).
SAMPLES: dict[str, tuple[str, Any]] = {
    "model": ("tiny", "tiny"),
    "http_port": ("8123", 8123),
    "mode": ("agg", "agg"),
    "handoff": ("push", "push"),
    "workers": ("3", 3),
    "engine": ("mock", "mock"),
    "policy": ("round_robin", "round_robin"),
    "indexer": ("embedded", "embedded"),
    "kv_cache_gib": ("0.5", 0.5),
    "max_model_len": ("1024", 1024),
    "log_dir": ("/tmp/kvmesh-logs", Path("/tmp/kvmesh-logs")),
    "admission": ("early", "early"),
    "admission_ttft_slo_ms": ("900", 900.0),
    "admission_itl_slo_ms": ("12.5", 12.5),
    "planner": ("yes", True),
    "insecure": ("yes", True),
    # --epd refuses the mock engine and tiny model sampled above (and --encoders needs
    # --epd): their non-defaults are test_launcher_cli's test_epd_* tests.
    "epd": ("no", False),
    "encoders": ("1", 1),
    "router": ("embedded", "embedded"),  # needs --insecure, sampled above
    # 2 with the embedded router and admission sampled here is refused: test_launcher_cli
    "frontends": ("1", 1),
    # --afd's options need --afd (which needs a model the mock does not serve): defaults
    "afd": ("no", False),
    "afd_transport": ("shm", "shm"),
    "afd_attention": ("1", 1),
}


def up_args(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    return cli.build_parser(environ).parse_args(["up", *argv])


def up_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser({})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    up: argparse.ArgumentParser = sub.choices["up"]
    return up


def up_flags() -> set[str]:
    return {a.dest for a in up_parser()._actions if a.option_strings and a.dest != "help"}


def test_every_up_flag_takes_its_default_from_kvmesh_env() -> None:
    assert up_flags() == set(SAMPLES)  # a new flag needs a sample here (and gets its env var)
    env = {f"KVMESH_{name.upper()}": raw for name, (raw, _) in SAMPLES.items()}
    args = up_args([], env)
    assert args.env_problems == []
    assert {name: getattr(args, name) for name in SAMPLES} == {
        name: value for name, (_, value) in SAMPLES.items()}
    spec = from_args(MeshSpec, args)
    assert spec.problems() == [] and spec.log_dir == Path("/tmp/kvmesh-logs")
    assert spec == MeshSpec(**{name: value for name, (_, value) in SAMPLES.items()})
    help_text = up_parser().format_help()
    for name in SAMPLES:
        assert f"KVMESH_{name.upper()}" in help_text


def test_flag_beats_env_var_beats_default() -> None:
    assert up_args([], {}).workers == 1
    assert up_args([], {"KVMESH_WORKERS": "4"}).workers == 4
    assert up_args(["--workers", "2"], {"KVMESH_WORKERS": "4"}).workers == 2
    assert up_args([], {"KVMESH_PLANNER": "0"}).planner is False
    assert up_args(["--planner"], {"KVMESH_PLANNER": "0"}).planner is True
    assert up_args(["--planner", "no"], {"KVMESH_PLANNER": "1"}).planner is False
    assert from_args(MeshSpec, up_args([], {})) == MeshSpec()


@pytest.mark.parametrize("env,value", [
    ("KVMESH_WORKERS", "two"),
    ("KVMESH_HTTP_PORT", "80.5"),
    ("KVMESH_KV_CACHE_GIB", "lots"),
    ("KVMESH_MODE", "pipe"),
    ("KVMESH_HANDOFF", "carrier-pigeon"),
    ("KVMESH_INDEXER", "remote2"),
    ("KVMESH_ADMISSION", "always"),
    ("KVMESH_PLANNER", "maybe"),
    ("KVMESH_WORKERS", "0"),
    ("KVMESH_HTTP_PORT", "70000"),
    ("KVMESH_MAX_MODEL_LEN", "-1"),
    ("KVMESH_ADMISSION_ITL_SLO_MS", "0"),
    ("KVMESH_MODEL", ""),
])
def test_a_bad_env_value_exits_2_naming_the_variable(
        env: str, value: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_launch(*_: object) -> None:
        raise AssertionError("kvmesh up started a mesh despite a bad value")

    monkeypatch.setattr(cli, "LocalMesh", no_launch)
    monkeypatch.setenv(env, value)
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmesh up: ") and env in err


def test_a_bad_flag_value_exits_2_naming_it(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "LocalMesh", None)
    assert cli.main(["up", "--workers", "0", "--kv-cache-gib", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--workers (KVMESH_WORKERS) must be >= 1" in err
    assert "--kv-cache-gib (KVMESH_KV_CACHE_GIB) must be > 0" in err


def test_a_bad_up_variable_does_not_break_other_commands() -> None:
    args = cli.build_parser({"KVMESH_WORKERS": "two"}).parse_args(["model", "tiny"])
    assert args.what == "tiny"  # parsed; the variable is kvmesh up's alone
