"""What a worker refuses before its engine sees it: kv_transfer params by the engine's
handoff mode (kv_params.validate_request) and sampling fields (validate_sampling), each
naming the field."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest

from protos import common_pb2, worker_pb2
from services.common.kv_params import KvParamsError, from_dict, to_dict, validate_request
from workers.engines.base import (
    MAX_LOGIT_BIAS,
    MAX_STRUCTURED_BYTES,
    MAX_STRUCTURED_CHOICES,
    EngineError,
    PositionLogprobs,
    Sampling,
    StructuredOutputs,
    TokenLogprob,
    validate_sampling,
)
from workers.kv.nixl import decode_params_from_prefill, prefill_params, push_decode_params
from workers.service import check_served, position_logprobs_to_proto, sampling_from_proto

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


SO = StructuredOutputs


def test_good_optional_features_pass() -> None:
    for s in (greedy(logprobs=0), greedy(logprobs=20, prompt_logprobs=0),
              greedy(logit_bias=((0, -100.0), (5, 100.0))), greedy(min_tokens=4),
              greedy(min_p=0.0), greedy(min_p=1.0),
              greedy(structured=SO(json_schema='{"type": "object"}', compact_json=True)),
              greedy(structured=SO(json_object=True)), greedy(structured=SO(regex="a+")),
              greedy(structured=SO(choice=("yes", "no"))),
              greedy(structured=SO(grammar='root ::= "a"')),
              greedy(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS))),
              greedy(structured=SO(regex="a" * MAX_STRUCTURED_BYTES)),
              greedy(structured=SO(choice=("a",) * MAX_STRUCTURED_CHOICES))):
        validate_sampling(s)


@pytest.mark.parametrize("field,value,where", [
    ("logprobs", -1, "logprobs"),
    ("logprobs", 21, "logprobs"),
    ("prompt_logprobs", 21, "prompt_logprobs"),
    ("logit_bias", ((-1, 1.0),), "logit_bias"),
    ("logit_bias", ((3, 100.5),), "logit_bias[3]"),
    ("logit_bias", ((3, math.nan),), "logit_bias[3]"),
    ("min_tokens", -1, "min_tokens"),
    ("min_tokens", 5, "min_tokens"),  # > max_tokens=4
    ("min_p", 1.5, "min_p"),
    ("min_p", math.nan, "min_p"),
    ("structured", SO(), "structured"),
    ("structured", SO(regex="a", grammar="b"), "structured"),
    ("structured", SO(json_schema="{not json"), "structured.json_schema"),
    ("structured", SO(json_schema="[1]"), "structured.json_schema"),
    ("structured", SO(regex=" "), "structured.regex"),
    ("structured", SO(grammar=""), "structured.grammar"),
    ("structured", SO(choice=()), "structured.choice"),
    ("structured", SO(regex="a", compact_json=True), "structured.compact_json"),
    # size caps: what the engine is asked to compile or apply
    ("logit_bias", tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)), "logit_bias"),
    ("structured", SO(json_schema='{"d":"' + "x" * MAX_STRUCTURED_BYTES + '"}'),
     "structured.json_schema"),
    ("structured", SO(regex="a" * (MAX_STRUCTURED_BYTES + 1)), "structured.regex"),
    ("structured", SO(grammar="é" * (MAX_STRUCTURED_BYTES // 2 + 1)), "structured.grammar"),
    ("structured", SO(choice=("a",) * (MAX_STRUCTURED_CHOICES + 1)), "structured.choice"),
    ("structured", SO(choice=("a" * (MAX_STRUCTURED_BYTES // 2), "b" * (
        MAX_STRUCTURED_BYTES // 2 + 1))), "structured.choice"),
])
def test_bad_optional_features_are_refused_naming_the_field(field: str, value: Any,
                                                            where: str) -> None:
    with pytest.raises(EngineError, match=re.escape(f"sampling.{where} ")):
        validate_sampling(greedy(**{field: value}))


def test_features_names_what_a_request_sets() -> None:
    assert greedy().features() == []
    assert greedy(min_p=0.0, logprobs=0, structured=SO(json_object=True),
                  logit_bias=((1, 0.0),), min_tokens=1, prompt_logprobs=0).features() == [
        "logprobs", "prompt_logprobs", "structured", "logit_bias", "min_tokens", "min_p"]


def test_optional_features_from_the_wire() -> None:
    p = common_pb2.SamplingParams(
        max_tokens=4, logprobs=0, prompt_logprobs=3, logit_bias={7: -2.5, 3: 1.0},
        min_tokens=2, min_p=0.25,
        structured=common_pb2.StructuredOutputs(
            choice=common_pb2.ChoiceList(choices=["a", "b"]), compact_json=False))
    s = sampling_from_proto(p)
    assert (s.logprobs, s.prompt_logprobs, s.min_tokens, s.min_p) == (0, 3, 2, 0.25)
    assert s.logit_bias == ((3, 1.0), (7, -2.5))
    assert s.structured == SO(choice=("a", "b"))
    none = sampling_from_proto(common_pb2.SamplingParams(max_tokens=4))
    assert none.features() == [] and none.structured is None and none.logprobs is None
    for kind, msg in (("json_schema", common_pb2.StructuredOutputs(json_schema="{}")),
                      ("json_object", common_pb2.StructuredOutputs(json_object=True)),
                      ("regex", common_pb2.StructuredOutputs(regex="x")),
                      ("grammar", common_pb2.StructuredOutputs(grammar="g"))):
        got = sampling_from_proto(common_pb2.SamplingParams(max_tokens=1, structured=msg))
        assert got.structured is not None and got.structured.kinds() == [kind]
    # a StructuredOutputs with no kind (or json_object=false) is refused by the check
    for msg in (common_pb2.StructuredOutputs(),
                common_pb2.StructuredOutputs(json_object=False)):
        got = sampling_from_proto(common_pb2.SamplingParams(max_tokens=1, structured=msg))
        with pytest.raises(EngineError, match=re.escape("sampling.structured must set")):
            validate_sampling(got)


class _Engine:
    serves = frozenset({"min_p"})
    info = type("Info", (), {"engine": "e", "model": "m"})()


def test_an_unserved_feature_is_refused_naming_it() -> None:
    check_served(greedy(min_p=0.5), _Engine())  # type: ignore[arg-type]
    with pytest.raises(EngineError, match=re.escape("sampling.logprobs is not served by "
                                                    "engine e (model m)")):
        check_served(greedy(min_p=0.5, logprobs=1), _Engine())  # type: ignore[arg-type]


def test_logprobs_to_proto() -> None:
    p = PositionLogprobs(TokenLogprob(5, -1.5, 3), (TokenLogprob(1, -0.1, 1),
                                                   TokenLogprob(2, -0.9, 2)))
    pb = position_logprobs_to_proto(p)
    assert (pb.token.token_id, pb.token.logprob, pb.token.rank) == (5, -1.5, 3)
    assert [(t.token_id, t.rank) for t in pb.top] == [(1, 1), (2, 2)]


def test_the_wire_s_sampling_fields_are_the_engine_s() -> None:
    """Every SamplingParams field is a Sampling field of the same name (the worker takes
    the fields a message sets by name), and a message setting each one gives each."""
    wire = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    assert wire == {f.name for f in dataclasses.fields(Sampling)}
    p = common_pb2.SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.75, top_k=3, seed=11, stop=["x", "y"],
        stop_token_ids=[5, 6], ignore_eos=True, presence_penalty=0.25,
        frequency_penalty=-0.5, repetition_penalty=1.5, logprobs=2, prompt_logprobs=1,
        structured=common_pb2.StructuredOutputs(regex="a+"), logit_bias={4: 1.0, 2: -1.0},
        min_tokens=1, min_p=0.125, bad_words=["bad"], allowed_token_ids=[2, 4, 7],
        include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False)
    assert {f.name for f, _ in p.ListFields()} == wire  # the message sets every field
    assert sampling_from_proto(p) == Sampling(
        max_tokens=9, temperature=0.5, top_p=0.75, top_k=3, seed=11, stop=("x", "y"),
        stop_token_ids=(5, 6), ignore_eos=True, presence_penalty=0.25,
        frequency_penalty=-0.5, repetition_penalty=1.5, logprobs=2, prompt_logprobs=1,
        structured=SO(regex="a+"), logit_bias=((2, -1.0), (4, 1.0)), min_tokens=1,
        min_p=0.125, bad_words=("bad",), allowed_token_ids=(2, 4, 7),
        include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False)
    # optional fields set to their zero value are set; plain ones at zero are defaults
    zeros = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, top_k=0))
    assert zeros == Sampling(max_tokens=0, temperature=0.0, top_k=0)
    # a field the wire cannot tell unset (no presence) reads its zero then, which must be
    # the engine's default for it (or the worker would take "unset" for a value)
    defaults = {f.name: f.default for f in dataclasses.fields(Sampling)}
    defaults["max_tokens"] = 0  # required in the dataclass: the worker's default
    empty = common_pb2.SamplingParams()
    for f in common_pb2.SamplingParams.DESCRIPTOR.fields:
        if not f.has_presence and f.message_type is None:
            value = getattr(empty, f.name)
            assert (tuple(value) if f.is_repeated else value) == defaults[f.name], f.name
