"""P's sampled token as the request's first token (pull P/D): which requests may do it,
which tokens may go out, the machine's effect order, D's load capped at P's tokens, and
the model's EOS ids as vLLM takes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protos import common_pb2, worker_pb2
from services.frontend import handoff_machine as hm
from services.frontend.handoff import Request, _decode_request, _first_chunk, p_token_first
from services.frontend.models import _eos_token_ids
from workers.kv.nixl_quiet import capped_match

PROMPT = list(range(10, 30))


def req(stops: frozenset[int] | None = frozenset({2}), **sampling: object) -> Request:
    s = common_pb2.SamplingParams(**{"max_tokens": 8, **sampling})  # type: ignore[arg-type]
    return Request("r", "m", PROMPT, s, first_token_stops=stops)


def p_last(num_tokens: int | None = len(PROMPT)) -> worker_pb2.GenerateResponse:
    last = worker_pb2.GenerateResponse(worker_id="p1")
    last.kv_transfer.do_remote_prefill = True
    if num_tokens is not None:
        last.kv_transfer.remote_num_tokens = num_tokens
    return last


def test_plain_sampling_may_send_ps_token_first() -> None:
    assert p_token_first(req())
    assert p_token_first(req(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.1))
    assert p_token_first(req(temperature=0.0, seed=3))  # greedy: the seed draws nothing


@pytest.mark.parametrize("why", [
    {"stops": None}, {"max_tokens": 1}, {"logprobs": 0}, {"stop": ["x"]},
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"min_tokens": 2},
    {"seed": 3}, {"temperature": 0.5, "seed": 3}, {"bad_words": ["a"]},
    {"allowed_token_ids": [5]}, {"logit_bias": {5: 1.0}},
    {"structured": common_pb2.StructuredOutputs(regex="a+")}])
def test_sampling_that_depends_on_ps_state_keeps_d_generating(why: dict[str, object]) -> None:
    args = dict(why)
    stops = args.pop("stops", frozenset({2}))
    r = req(stops, **args)  # type: ignore[arg-type]
    assert not p_token_first(r)


def test_images_keep_d_generating() -> None:
    r = req()
    r.images = [worker_pb2.ImageItem(data=b"x", mm_hash="h")]
    assert not p_token_first(r)


def test_ps_token_goes_out_with_ps_text_and_worker() -> None:
    chunk = _first_chunk(req(), [7], " hi", p_last())
    assert chunk is not None
    assert (list(chunk.token_ids), chunk.text, chunk.worker_id) == ([7], " hi", "p1")
    assert chunk.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert _first_chunk(req(), [7], " hi", p_last(None)) is not None  # the mock says none


@pytest.mark.parametrize(("tokens", "text", "num_tokens", "sampling"), [
    ([2], " x", len(PROMPT), {}),  # EOS
    ([9], " x", len(PROMPT), {"stop_token_ids": [9]}),
    ([7], "", len(PROMPT), {}),  # no text (a special token)
    ([7], "\ufffd", len(PROMPT), {}),  # half a character
    ([7, 8], " x", len(PROMPT), {}),
    ([7], " x", len(PROMPT) - 1, {}),  # P held another count of tokens
])
def test_tokens_d_must_recompute(tokens: list[int], text: str, num_tokens: int,
                                 sampling: dict[str, object]) -> None:
    assert _first_chunk(req(**sampling), tokens, text,  # type: ignore[arg-type]
                        p_last(num_tokens)) is None


def test_eos_goes_out_first_when_ignored() -> None:
    assert _first_chunk(req(ignore_eos=True), [2], " x", p_last()) is not None
    assert _first_chunk(req(ignore_eos=True, stop_token_ids=[2]), [2], " x", p_last()) is None


def test_d_continues_after_ps_token() -> None:
    params = p_last().kv_transfer
    d = _decode_request(req(), params, 7)
    assert list(d.token_ids) == [*PROMPT, 7]
    assert d.sampling.max_tokens == 7
    assert d.kv_transfer.do_remote_prefill and d.kv_transfer.remote_num_tokens == len(PROMPT)
    plain = _decode_request(req(), params)
    assert list(plain.token_ids) == PROMPT and plain.sampling.max_tokens == 8


def test_machine_emits_ps_token_before_starting_d() -> None:
    m = hm.HandoffMachine("pull")
    assert m.start() == [hm.StartPrefill()]
    assert m.handle(hm.PrefillDone("last", "first")) == [hm.EmitChunk("first"),
                                                         hm.StartDecode("last")]
    assert m.handle(hm.DecodeChunk("c", True)) == [hm.EmitChunk("c", "last")]
    assert m.handle(hm.DecodeEnded()) == [hm.Done()]
    m2 = hm.HandoffMachine("pull")
    m2.start()
    assert m2.handle(hm.PrefillDone("last")) == [hm.StartDecode("last")]


def test_d_loads_at_most_what_p_holds() -> None:
    d = {"do_remote_prefill": True, "remote_num_tokens": 20}
    assert capped_match((21, True), d, 0) == (20, True)  # prompt + P's token
    assert capped_match((20, True), d, 0) == (20, True)  # P's own prompt: unchanged
    assert capped_match((5, True), d, 16) == (4, True)  # a local prefix hit first
    assert capped_match((5, True), d, 20) == (0, False)  # all of P's tokens held locally
    assert capped_match((21, True), {"do_remote_prefill": True}, 0) == (21, True)
    assert capped_match((0, False), {"do_remote_decode": True, "remote_num_tokens": 3},
                        0) == (0, False)
    assert capped_match((None, False), d, 0) == (None, False)


def test_eos_ids_are_the_tokenizers_and_the_generation_configs(tmp_path: Path) -> None:
    assert _eos_token_ids(str(tmp_path), 2) == {2}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert _eos_token_ids(str(tmp_path), 0) == {0, 2, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert _eos_token_ids(str(tmp_path), None) == {5}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert _eos_token_ids(str(tmp_path), 1) == {1}


async def test_the_catalog_names_no_eos_ids_for_a_model_without_a_tokenizer(
        tmp_path: Path) -> None:
    from services.frontend.models import ModelCatalog, ModelInfo

    info = ModelInfo("m", str(tmp_path / "missing"), 128, 16, 1, 0)
    assert await ModelCatalog().eos_token_ids(info) is None
