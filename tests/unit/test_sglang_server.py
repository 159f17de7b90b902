"""server_command: the SGLang CPU server's argv and environment, per role (no processes run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.engines.sglang.server import (
    DEFAULT_MAX_TOTAL_TOKENS,
    SGLANG_VENV_ENV,
    ServerSpec,
    server_command,
    sglang_python,
)


@pytest.fixture()
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(SGLANG_VENV_ENV, raising=False)
    python = tmp_path / ".sglvenv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    return tmp_path


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def test_agg_command_runs_the_launcher_on_cpu(repo: Path) -> None:
    argv, env = server_command(ServerSpec(model_path="/m", port=4100, role="agg"), repo)
    assert argv[:3] == [str(repo / ".sglvenv" / "bin" / "python"), "-m",
                        "workers.engines.sglang.launch"]
    assert flag(argv, "--model-path") == "/m"
    assert flag(argv, "--device") == "cpu"
    assert flag(argv, "--attention-backend") == "torch_native"
    assert flag(argv, "--dtype") == "float32"
    assert flag(argv, "--page-size") == "32"
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--port") == "4100"
    assert flag(argv, "--random-seed") == "0"
    assert flag(argv, "--max-total-tokens") == str(DEFAULT_MAX_TOTAL_TOKENS)
    assert flag(argv, "--cuda-graph-backend-decode") == "disabled"
    assert flag(argv, "--cuda-graph-backend-prefill") == "disabled"
    assert "--sleep-on-idle" in argv
    for absent in ("--disaggregation-mode", "--disaggregation-bootstrap-port",
                   "--kv-events-config", "--context-length"):
        assert absent not in argv
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["UCX_NET_DEVICES"] == "lo"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_prefill_has_the_bootstrap_port_and_decode_has_not(repo: Path) -> None:
    p, _ = server_command(ServerSpec(model_path="/m", port=4100, role="prefill",
                                     bootstrap_port=4101), repo)
    assert flag(p, "--disaggregation-mode") == "prefill"
    assert flag(p, "--disaggregation-bootstrap-port") == "4101"
    assert flag(p, "--disaggregation-transfer-backend") == "nixl"
    d, _ = server_command(ServerSpec(model_path="/m", port=4200, role="decode"), repo)
    assert flag(d, "--disaggregation-mode") == "decode"
    assert flag(d, "--disaggregation-transfer-backend") == "nixl"
    assert flag(d, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert "--disaggregation-bootstrap-port" not in d


def test_events_config_is_json_for_sglang(repo: Path) -> None:
    spec = ServerSpec(model_path="/m", port=4100, role="agg", page_size=16, seed=7,
                      context_length=1024, max_total_tokens=2048,
                      kv_events_endpoint="tcp://127.0.0.1:5557",
                      kv_events_replay_endpoint="tcp://127.0.0.1:5558",
                      extra_args=("--log-level", "debug"))
    argv, _ = server_command(spec, repo)
    assert json.loads(flag(argv, "--kv-events-config")) == {
        "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": True, "topic": "",
        "replay_endpoint": "tcp://127.0.0.1:5558"}
    assert flag(argv, "--page-size") == "16"
    assert flag(argv, "--random-seed") == "7"
    assert flag(argv, "--context-length") == "1024"
    assert flag(argv, "--max-total-tokens") == "2048"
    assert argv[-2:] == ["--log-level", "debug"]
    no_replay, _ = server_command(
        ServerSpec(model_path="/m", port=4100, role="agg",
                   kv_events_endpoint="tcp://127.0.0.1:5557"), repo)
    assert "replay_endpoint" not in json.loads(flag(no_replay, "--kv-events-config"))


@pytest.mark.parametrize(("fields", "named"), [
    ({"role": "both"}, "role"),
    ({"port": 0}, "port"),
    ({"page_size": 0}, "page_size"),
    ({"host": "0.0.0.0"}, "host"),
    ({"max_total_tokens": -1}, "max_total_tokens"),
    ({"role": "prefill"}, "bootstrap_port"),
    ({"role": "decode", "bootstrap_port": 4101}, "bootstrap_port"),
    ({"role": "agg", "bootstrap_port": 4101}, "bootstrap_port"),
    ({"role": "decode", "transfer_backend": "nccl"}, "transfer_backend"),
    ({"kv_events_endpoint": "tcp://*:5557"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://10.0.0.1:5557"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "ipc://relative/events"}, "kv_events_endpoint"),
    ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "kv_events_replay_endpoint"),
])
def test_invalid_specs_are_refused_naming_the_field(repo: Path, fields: dict[str, object],
                                                    named: str) -> None:
    spec = ServerSpec(**{"model_path": "/m", "port": 4100, "role": "agg", **fields})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=named):
        server_command(spec, repo)


def test_missing_venv_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SGLANG_VENV_ENV, raising=False)
    with pytest.raises(RuntimeError, match="make sglang"):
        server_command(ServerSpec(model_path="/m", port=4100, role="agg"), tmp_path)
    assert sglang_python(tmp_path) is None


def test_venv_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "elsewhere"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv(SGLANG_VENV_ENV, str(venv))
    argv, _ = server_command(ServerSpec(model_path="/m", port=4100, role="agg"), tmp_path)
    assert argv[0] == str(venv / "bin" / "python")


def test_sgl_kernel_shim_fills_each_requests_slots_in_batch_order() -> None:
    import torch

    from workers.engines.sglang.sgl_kernel_shim import assign_req_to_token_pool_cpu

    table = torch.zeros((3, 8), dtype=torch.int32)
    assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 0]), torch.tensor([4, 2]),
        torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64), 8)
    assert table[2].tolist() == [0, 10, 11, 12, 0, 0, 0, 0]
    assert table[0].tolist() == [20, 21, 0, 0, 0, 0, 0, 0]
    assert table[1].tolist() == [0] * 8


def test_sgl_kernel_shim_is_not_the_amx_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import torch

    from workers.engines.sglang import sgl_kernel_shim

    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    module = sgl_kernel_shim.install()
    assert sys.modules["sgl_kernel"] is module is sgl_kernel_shim.install()
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    with pytest.raises(ImportError):
        exec("from sgl_kernel import convert_weight_packed", {})
    with pytest.raises(ImportError):
        exec("from sgl_kernel.scalar_type import scalar_types", {})
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        module.verify_tree_greedy_cpu()


def test_nixl_progress_thread_polls_with_a_delay_in_sglang_servers() -> None:
    """The launcher's patch: NIXL's Python API sets pthrDelay 0 (a spinning thread); in an
    SGLang server process it becomes NIXL_PROGRESS_DELAY_US, and 0 turns the patch off."""
    import subprocess
    import sys

    code = ("from workers.engines.sglang import cpu_patches as c; c.patch_nixl_progress_delay(); "
            "import nixl_cu12._bindings as b; cfg = b.nixlAgentConfig(); cfg.pthrDelay = 0; "
            "print(cfg.pthrDelay)")
    root = Path(__file__).resolve().parents[2]
    for env_value, expected in ((None, "1000"), ("0", "0"), ("2500", "2500")):
        env = {"PATH": "/usr/bin:/bin"}
        if env_value is not None:
            env["KVMESH_SGLANG_NIXL_DELAY_US"] = env_value
        out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True,
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.split()[-1] == expected, out
