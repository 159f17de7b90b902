"""What a worker refuses before its engine sees it: kv_transfer params by the engine's
handoff mode (kv_params.validate_request) and sampling fields (validate_sampling), each
naming the field."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from protos import common_pb2, worker_pb2
from services.common.kv_params import KvParamsError, from_dict, to_dict, validate_request
from workers.engines.base import EngineError, Sampling, validate_sampling
from workers.kv.nixl import decode_params_from_prefill, prefill_params, push_decode_params
from workers.service import sampling_from_proto

# What a vLLM NIXL P returns on its final output (pull mode).
P_OUT = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
         "remote_engine_id": "p-1", "remote_request_id": "cmpl-1-0", "remote_host": "h",
         "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 40, "transfer_mode": "pull"}
PUSH_HANDOFF = {"mode": "push", "engine_id": "p-2", "host": "127.0.0.1", "port": 5601,
                "tp_size": 1}


def where(key: str) -> str:
    return re.escape(f"kv_transfer_params[{key!r}]")


def wire(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as the servicer sees them: typed through protobuf and back."""
    return to_dict(worker_pb2.KvTransferParams.FromString(
        from_dict(params).SerializeToString()))


def test_what_the_mesh_sends_passes() -> None:
    p_req = wire(prefill_params())
    for mode in ("pull", "push", "mock", ""):
        validate_request(p_req, mode)
    validate_request(wire(decode_params_from_prefill(P_OUT)), "pull")
    validate_request(wire(push_decode_params(PUSH_HANDOFF, "r-1")), "push")
    # the mock's P hands D its engine and block ids only; the mock engine needs no more
    validate_request(wire({"do_remote_prefill": True, "remote_engine_id": "m",
                           "remote_request_id": "r", "remote_block_ids": [], "tp_size": 1}),
                     "mock")


def test_the_issue_row_1_request_is_refused() -> None:
    """do_remote_prefill with a request id, port 1 and no block ids asserted in vLLM's
    NIXL scheduler and killed EngineCore."""
    crafted = wire({"do_remote_prefill": True, "remote_request_id": "x", "remote_port": 1})
    with pytest.raises(KvParamsError, match=where("remote_engine_id")):
        validate_request(crafted, "pull")
    full = {**crafted, "remote_engine_id": "e", "remote_host": "h"}
    with pytest.raises(KvParamsError, match=where("remote_block_ids")):
        validate_request(full, "pull")
    empties: list[list[Any]] = [[], [[], []]]
    for empty in empties:
        with pytest.raises(KvParamsError, match=where("remote_block_ids")):
            validate_request({**full, "remote_block_ids": empty}, "pull")
    validate_request({**full, "remote_block_ids": [0]}, "pull")


@pytest.mark.parametrize("mode,key", [
    ("pull", k) for k in ("remote_engine_id", "remote_request_id", "remote_host",
                          "remote_port", "remote_block_ids")
] + [
    ("push", k) for k in ("remote_engine_id", "remote_request_id", "remote_host",
                          "remote_port", "tp_size")
])
def test_remote_prefill_needs_every_key_of_its_mode(mode: str, key: str) -> None:
    good = (wire(decode_params_from_prefill(P_OUT)) if mode == "pull"
            else wire(push_decode_params(PUSH_HANDOFF, "r-1")))
    validate_request(good, mode)
    missing = {k: v for k, v in good.items() if k != key}
    with pytest.raises(KvParamsError, match=where(key) + ".*required"):
        validate_request(missing, mode)
    if isinstance(good[key], str):
        with pytest.raises(KvParamsError, match=where(key)):
            validate_request({**good, key: ""}, mode)
    # without do_remote_prefill nothing is required
    validate_request({**missing, "do_remote_prefill": False}, mode)


@pytest.mark.parametrize("params,key", [
    ({"do_remote_prefill": True, "do_remote_decode": True}, "do_remote_prefill"),
    ({"remote_port": 0}, "remote_port"),
    ({"remote_port": 65536}, "remote_port"),
    ({"remote_port": -1}, "remote_port"),
    ({"tp_size": 0}, "tp_size"),
    ({"dcp_size": 0}, "dcp_size"),
    ({"pp_size": -3}, "pp_size"),
    ({"remote_block_size": 0}, "remote_block_size"),
    ({"remote_num_tokens": -1}, "remote_num_tokens"),
    ({"remote_prefill_cached_tokens": -1}, "remote_prefill_cached_tokens"),
    ({"remote_blocks_expiry_time": math.inf}, "remote_blocks_expiry_time"),
    ({"remote_blocks_expiry_time": math.nan}, "remote_blocks_expiry_time"),
    ({"remote_block_ids": [3, -1]}, "remote_block_ids"),
    ({"remote_block_ids": [[3], [-2]]}, "remote_block_ids"),
    ({"transfer_mode": "teleport"}, "transfer_mode"),
])
@pytest.mark.parametrize("mode", ["pull", "push", "mock", ""])
def test_bad_values_are_refused_in_every_mode(params: dict[str, Any], key: str,
                                              mode: str) -> None:
    with pytest.raises(KvParamsError, match=where(key)):
        validate_request({"do_remote_prefill": False, "do_remote_decode": False, **params},
                         mode)


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_non_finite_extra_numbers_are_refused(number: float) -> None:
    msg = worker_pb2.KvTransferParams()
    msg.extra["future"].list_value.values.add().number_value = number
    with pytest.raises(KvParamsError, match=re.escape("kv_transfer_params['future'][0]")):
        to_dict(msg)


def greedy(**kw: Any) -> Sampling:
    return Sampling(**{"max_tokens": 4, **kw})


def test_good_sampling_passes() -> None:
    for s in (greedy(), greedy(temperature=0.0, top_p=1.0, top_k=-1),
              greedy(temperature=1.5, top_p=0.01, top_k=0, seed=-5, presence_penalty=-2.0,
                     frequency_penalty=2.0, repetition_penalty=0.5, stop_token_ids=(0, 7))):
        validate_sampling(s)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -0.5),
    ("top_p", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("presence_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -math.inf),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("stop_token_ids", (1, -1)),
])
def test_bad_sampling_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(EngineError, match=re.escape(f"sampling.{field} ")):
        validate_sampling(greedy(**{field: value}))


def test_sampling_from_the_wire_keeps_nan_for_the_check() -> None:
    """float32 fields carry NaN and inf; unset ones stay None (the model's default)."""
    s = sampling_from_proto(common_pb2.SamplingParams(max_tokens=2, temperature=math.nan))
    assert s.top_p is None and math.isnan(s.temperature or 0.0)
    with pytest.raises(EngineError, match="sampling.temperature"):
        validate_sampling(s)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs", "structured",
                                   "logit_bias", "min_tokens", "min_p"])
def test_sampling_fields_no_engine_serves_yet_are_refused(field: str) -> None:
    from protos import common_pb2
    from workers.engines.base import EngineError
    from workers.service import sampling_from_proto

    values: dict[str, object] = {
        "logprobs": 0, "prompt_logprobs": 1, "min_tokens": 2, "min_p": 0.1,
        "structured": common_pb2.StructuredOutputs(json_object=True),
        "logit_bias": {5: 1.0}}
    p = common_pb2.SamplingParams(max_tokens=4, **{field: values[field]})  # type: ignore[arg-type]
    with pytest.raises(EngineError, match=f"sampling.{field} is not served"):
        sampling_from_proto(p)
    sampling_from_proto(common_pb2.SamplingParams(max_tokens=4))  # nothing set: fine
