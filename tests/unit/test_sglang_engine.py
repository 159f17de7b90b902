"""The SGLang engine adapter's pure parts: sampling and request mapping, the stream's
deltas, loads, layouts, pairing with vLLM workers, worker config and the frontend's
sglang handoff mode. (The server itself: tests/integration/test_sglang_mesh.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protos import common_pb2
from services.common.config import ConfigError, load_config
from services.frontend import handoff
from services.router.disagg import PairInfo, can_prefill_locally, incompatibility
from workers.config import WorkerConfig
from workers.engines import create_engine, engine_kinds
from workers.engines.base import OPTIONAL_FEATURES, EngineError, EngineRequest, Sampling
from workers.engines.sglang.engine import (
    SERVED,
    SglangEngine,
    StreamState,
    abort_message,
    bootstrap_room,
    check_request,
    kv_pool_tokens,
    load_of,
    request_body,
    sampling_params,
    sglang_kv_layout,
)

MODEL = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
         "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 2,
         "max_position_embeddings": 512}


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    return str(tmp_path)


def req(tokens: list[int] | None = None, kv: dict | None = None, **sampling: object  # type: ignore[type-arg]
        ) -> EngineRequest:
    s = Sampling(**{"max_tokens": 8, **sampling})  # type: ignore[arg-type]
    return EngineRequest("r-1", [5, 6, 7] if tokens is None else tokens, s, kv)


def test_sampling_maps_to_sglang_names() -> None:
    s = Sampling(max_tokens=9, temperature=0.0, top_p=0.5, top_k=0, stop=("x",),
                 stop_token_ids=(3,), ignore_eos=True, presence_penalty=0.1,
                 frequency_penalty=-0.2, repetition_penalty=1.1, min_tokens=2, min_p=0.05,
                 skip_special_tokens=False, spaces_between_special_tokens=False, seed=7)
    assert sampling_params(s) == {
        "max_new_tokens": 9, "temperature": 0.0, "top_p": 0.5, "top_k": -1,
        "stop": ["x"], "stop_token_ids": [3], "ignore_eos": True, "presence_penalty": 0.1,
        "frequency_penalty": -0.2, "repetition_penalty": 1.1, "min_new_tokens": 2,
        "min_p": 0.05, "skip_special_tokens": False, "spaces_between_special_tokens": False,
        "sampling_seed": 7}
    # None fields are left to SGLang; -1 is vLLM's "no seed"
    assert sampling_params(Sampling(max_tokens=1, seed=-1, top_k=5)) == {
        "max_new_tokens": 1, "top_k": 5}


def test_served_features_are_a_subset_and_the_rest_is_refused_upstream() -> None:
    assert SERVED < set(OPTIONAL_FEATURES)
    assert SglangEngine.serves == SERVED
    assert {"logprobs", "structured", "logit_bias", "include_stop_str_in_output"} \
        .isdisjoint(SERVED)


@pytest.mark.parametrize(("request_", "role", "needle"), [
    (req([]), "agg", "prompt is empty"),
    (req(list(range(500)), max_tokens=20), "agg", "exceeds max_model_len (512)"),
    (req(seed=3, temperature=0.7), "agg", "sampling.seed"),
    (req(seed=3), "agg", "sampling.seed"),  # temperature None: SGLang's default, not 0
    (req(kv={"do_remote_decode": True}), "agg", "do_remote_decode"),
    (req(), "decode", "cannot prefill locally"),
    (req(kv={"do_remote_prefill": True, "remote_port": 5}), "decode", "'remote_host'"),
    (req(kv={"do_remote_prefill": True}), "prefill", "do_remote_prefill"),
])
def test_refusals_name_the_field(request_: EngineRequest, role: str, needle: str) -> None:
    with pytest.raises(EngineError) as err:
        check_request(request_, 512, role)
    assert needle in str(err.value)


def test_greedy_seed_is_fine() -> None:
    check_request(req(seed=3, temperature=0.0), 512, "agg")


def test_p_and_d_bodies_share_the_bootstrap_room() -> None:
    p = request_body(req(kv={"do_remote_decode": True}), "prefill", ("127.0.0.1", 8998))
    d = request_body(req(kv={"do_remote_prefill": True, "remote_host": "127.0.0.1",
                             "remote_port": 8998, "remote_request_id": "r-1"}),
                     "decode", None)
    assert p["bootstrap_room"] == d["bootstrap_room"] == bootstrap_room("r-1")
    assert (p["bootstrap_host"], p["bootstrap_port"]) == ("127.0.0.1", 8998)
    assert (d["bootstrap_host"], d["bootstrap_port"]) == ("127.0.0.1", 8998)
    agg = request_body(EngineRequest("r-2", [1], Sampling(max_tokens=1), cache_salt="t"),
                       "agg", None)
    assert agg == {"rid": "r-2", "input_ids": [1], "sampling_params": {"max_new_tokens": 1},
                   "stream": True, "cache_salt": "t"}


def test_bootstrap_room_is_a_deterministic_63_bit_int() -> None:
    rooms = {bootstrap_room(f"req-{i}") for i in range(1000)}
    assert len(rooms) == 1000 and all(0 <= r < 1 << 63 for r in rooms)
    assert bootstrap_room("x") == bootstrap_room("x")


def events(cumulative: bool) -> list[dict]:  # type: ignore[type-arg]
    steps = [([11], "a"), ([11, 12], "ab"), ([11, 12, 13], "abc")]
    out = []
    for i, (ids, text) in enumerate(steps):
        last = i == len(steps) - 1
        prev_ids, prev_text = (steps[i - 1] if i else ([], ""))
        meta = {"prompt_tokens": 4, "completion_tokens": len(ids), "cached_tokens": 2,
                "finish_reason": {"type": "length", "length": 3} if last else None}
        if cumulative:
            out.append({"output_ids": ids, "text": text, "meta_info": meta})
        else:
            out.append({"output_ids": ids[len(prev_ids):], "text": text[len(prev_text):],
                        "meta_info": meta})
    return out


@pytest.mark.parametrize("cumulative", [True, False])
def test_stream_becomes_deltas(cumulative: bool) -> None:
    st = StreamState(4)
    outs = [st.delta(e) for e in events(cumulative)]
    assert [o.token_ids for o in outs] == [[11], [12], [13]]
    assert "".join(o.text for o in outs) == "abc"
    assert [o.completion_tokens for o in outs] == [1, 2, 3]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "length" and outs[-1].cached_tokens == 2
    assert outs[-1].prompt_tokens == 4


def test_finish_reasons_and_abort_messages() -> None:
    for theirs, ours in (("stop", "stop"), ("length", "length"), ("abort", "abort"),
                         ("weird", "abort")):
        ev = {"output_ids": [], "meta_info": {"finish_reason": {"type": theirs},
                                              "completion_tokens": 0}}
        assert StreamState(1).delta(ev).finish_reason == ours
    ev = {"meta_info": {"finish_reason": {"type": "abort", "message": "bootstrap timeout",
                                          "status_code": 500}}}
    assert abort_message(ev) == (500, "bootstrap timeout")
    assert abort_message({"error": {"message": "too long", "code": 400}}) == (400, "too long")


def test_loads() -> None:
    body = {"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.25,
                       "max_total_num_tokens": 640,
                       "disaggregation": {"mode": "decode", "decode_prealloc_queue_reqs": 1,
                                          "decode_transfer_queue_reqs": 2}}]}
    load = load_of(body, 32)
    assert (load.num_running, load.num_waiting, load.kv_usage, load.kv_total_blocks) == (
        2, 4, 0.25, 20)
    assert load_of({"loads": []}, 32).num_running == 0


def test_layout_and_pool(model_dir: str) -> None:
    layout = sglang_kv_layout(model_dir, "float32", 32)
    assert layout == "sglang|LlamaForCausalLM|float32|kv=float32|mha|L2|KVH2|D16|B32"
    # 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token
    assert kv_pool_tokens(model_dir, "float32", 1 / 1024) == 2048


def test_an_sglang_worker_never_pairs_with_a_vllm_one() -> None:
    vllm_layout = "LlamaForCausalLM|float32|kv=auto|mha|L2|KVH2|D16|B32"
    sgl_layout = "sglang|LlamaForCausalLM|float32|kv=float32|mha|L2|KVH2|D16|B32"
    sgl_p = PairInfo("sgl-p", "sglang", 32, sgl_layout)
    sgl_d = PairInfo("sgl-d", "sglang", 32, sgl_layout)
    vllm_p = PairInfo("vllm-p", "pull", 32, vllm_layout)
    vllm_d = PairInfo("vllm-d", "push", 32, vllm_layout)
    assert incompatibility(sgl_p, sgl_d) is None
    why = incompatibility(vllm_p, sgl_d)
    assert why is not None and why.startswith("engines differ") and "vllm-p is vLLM" in why \
        and "sgl-d is SGLang" in why
    why = incompatibility(sgl_p, vllm_d)
    assert why is not None and "sgl-p is SGLang" in why and "vllm-d is vLLM" in why
    assert not can_prefill_locally(sgl_d) and can_prefill_locally(vllm_d)


def test_worker_config_for_sglang() -> None:
    base = ["--engine", "sglang", "--model-path", "m", "--block-size", "16"]
    cfg = load_config(WorkerConfig, [*base, "--role", "prefill"], {})
    assert cfg.resolved_handoff() == "sglang"
    assert load_config(WorkerConfig, [*base], {}).resolved_handoff() == "none"
    for extra, needle in ((["--role", "decode", "--handoff", "pull"], "bootstrap"),
                          (["--store-master", "h:1"], "needs the vllm engine"),
                          (["--ec-role", "ec_consumer"], "needs the vllm engine"),
                          (["--afd-role", "ffn"], "needs engine afd"),
                          (["--handoff", "sglang"], "role prefill or decode")):
        with pytest.raises(ConfigError, match=needle):
            load_config(WorkerConfig, [*base, *extra], {})
    with pytest.raises(ConfigError, match="needs engine sglang"):
        load_config(WorkerConfig, ["--model-path", "m", "--role", "prefill",
                                   "--handoff", "sglang"], {})


def test_engine_kind_is_registered(model_dir: str) -> None:
    assert "sglang" in engine_kinds()
    eng = create_engine("sglang", model_path=model_dir, role="prefill")
    assert isinstance(eng, SglangEngine) and eng.config.role == "prefill"


def test_frontend_runs_sglang_as_push_with_ds_sampling() -> None:
    sampling = common_pb2.SamplingParams(max_tokens=7, temperature=0.0, min_tokens=2)
    r = handoff.Request("r-9", "m", [1, 2, 3], sampling)
    p = handoff._prefill_request(r, "sglang")
    assert p.sampling.max_tokens == 7 and p.sampling.min_tokens == 2  # D continues P's token
    assert p.kv_transfer.do_remote_decode and p.kv_transfer.transfer_mode == "push"
    pull = handoff._prefill_request(r, "pull")
    assert pull.sampling.max_tokens == 1 and pull.sampling.min_tokens == 0
    assert "sglang" in handoff.PUSH_LIKE
