"""GenerateRequest.whole on the worker (:class:`workers.service.WholeAnswer`): the first
message with tokens passes at once, the later ones go together with the finish, or per
WHOLE_FLUSH_TOKENS tokens; nothing is lost or reordered on the way."""

from __future__ import annotations

from protos import common_pb2, worker_pb2
from workers.service import WHOLE_FLUSH_TOKENS, WholeAnswer


def msg(ids: list[int], finish: bool = False) -> worker_pb2.GenerateResponse:
    resp = worker_pb2.GenerateResponse(token_ids=ids, text="".join(f" w{t}" for t in ids),
                                       worker_id="w")
    resp.logprobs.extend(common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=t, logprob=-0.5, rank=1)) for t in ids)
    if finish:
        resp.finish_reason = common_pb2.FINISH_REASON_LENGTH
        resp.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=9))
    return resp


def run(parts: list[tuple[list[int], bool]]) -> list[worker_pb2.GenerateResponse]:
    whole = WholeAnswer()
    sent = [whole.take(msg(ids, fin)) for ids, fin in parts]
    return [m for m in sent if m is not None]


def test_first_tokens_at_once_then_the_rest_with_the_finish() -> None:
    sent = run([([], False), ([1], False), ([2], False), ([3, 4], False), ([5], True)])
    assert [list(m.token_ids) for m in sent] == [[], [1], [2, 3, 4, 5]]
    last = sent[-1]
    assert last.text == " w2 w3 w4 w5"
    assert [p.token.token_id for p in last.logprobs] == [2, 3, 4, 5]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 9 and last.worker_id == "w"


def test_a_one_token_answer_is_one_message() -> None:
    sent = run([([7], True)])
    assert [list(m.token_ids) for m in sent] == [[7]]
    assert sent[0].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_held_tokens_go_out_per_flush_size() -> None:
    n = 2 * WHOLE_FLUSH_TOKENS + 10
    sent = run([([i], i == n - 1) for i in range(n)])
    assert [len(m.token_ids) for m in sent] == [1, WHOLE_FLUSH_TOKENS, WHOLE_FLUSH_TOKENS, 9]
    assert [t for m in sent for t in m.token_ids] == list(range(n))
    assert sent[-1].HasField("usage") and not sent[1].HasField("usage")


def run_mixed(parts: list[tuple[list[int], str]]) -> list[worker_pb2.GenerateResponse]:
    """Like the Generate loop: once the first tokens passed, ``plain`` parts go through
    take_plain, ``logprobs`` and ``finish`` parts through take."""
    whole = WholeAnswer("w")
    sent = []
    for ids, kind in parts:
        if kind == "plain" and whole.passed:
            sent.append(whole.take_plain(ids, "".join(f" w{t}" for t in ids)))
        else:
            sent.append(whole.take(msg(ids, kind == "finish")))
    return [m for m in sent if m is not None]


def test_plain_outputs_are_held_in_order_with_the_others() -> None:
    sent = run_mixed([([1], "plain"), ([2], "plain"), ([3, 4], "logprobs"), ([5], "plain"),
                      ([6], "plain"), ([7], "finish")])
    assert [list(m.token_ids) for m in sent] == [[1], [2, 3, 4, 5, 6, 7]]
    last = sent[-1]
    assert last.text == " w2 w3 w4 w5 w6 w7" and last.worker_id == "w"
    assert [p.token.token_id for p in last.logprobs] == [3, 4, 7]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 9


def test_plain_outputs_flush_per_size_as_messages_do() -> None:
    n = 2 * WHOLE_FLUSH_TOKENS + 10
    mixed = run_mixed([([i], "finish" if i == n - 1 else "plain") for i in range(n)])
    assert [len(m.token_ids) for m in mixed] == [1, WHOLE_FLUSH_TOKENS, WHOLE_FLUSH_TOKENS, 9]
    assert [t for m in mixed for t in m.token_ids] == list(range(n))
    assert "".join(m.text for m in mixed) == "".join(f" w{t}" for t in range(n))
    assert all(m.worker_id == "w" for m in mixed)
    # a held logprobs message counts toward the flush size too
    held = run_mixed([([0], "plain"), (list(range(1, WHOLE_FLUSH_TOKENS)), "logprobs"),
                      ([WHOLE_FLUSH_TOKENS], "plain"), ([WHOLE_FLUSH_TOKENS + 1], "finish")])
    assert [len(m.token_ids) for m in held] == [1, WHOLE_FLUSH_TOKENS, 1]
