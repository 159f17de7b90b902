"""The replay benchmark's pure parts: trace loading, prompt construction, statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay.stats import Result, goodput, summarize
from bench.replay.trace import PromptMaker, TraceRequest, load_trace, schedule

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"


def test_load_trace_and_reject_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
                    '\n{"timestamp": 5, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n')
    reqs = load_trace(good)
    assert [r.timestamp_ms for r in reqs] == [0, 5] and reqs[0].hash_ids == (0,)
    assert len(load_trace(good, limit=1)) == 1
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x"}\n')
    with pytest.raises(ValueError, match="b.jsonl:1"):
        load_trace(bad)


def test_equal_hash_ids_give_equal_prefixes() -> None:
    m = PromptMaker(trace_block=512, token_scale=1 / 16, vocab=700, seed=3)
    a = TraceRequest(0, 512 * 3, 10, (0, 1, 2))
    b = TraceRequest(0, 512 * 2 + 100, 10, (0, 1, 9))
    c = TraceRequest(0, 512 * 3, 10, (5, 1, 2))
    ta, tb, tc = m.tokens(a), m.tokens(b), m.tokens(c)
    assert m.block_tokens == 32 and len(ta) == 96 and len(tb) == 70
    assert ta[:64] == tb[:64] and ta[64:70] != tb[64:70]
    assert ta[:32] != tc[:32] and all(3 <= t < 700 for t in ta + tb)
    assert m.tokens(a) == ta  # deterministic
    assert m.output_len(a) == 1 and PromptMaker(max_output=4).output_len(a) == 4
    # Inputs longer than their blocks are padded, not truncated.
    assert len(m.tokens(TraceRequest(0, 512 * 4, 1, (0,)))) == 128


def test_schedule_scales_arrival_times() -> None:
    reqs = [TraceRequest(t, 1, 1, (0,)) for t in (1000, 1500, 3000)]
    assert schedule(reqs, 1) == [0, 0.5, 2.0]
    assert schedule(reqs, 2) == [0, 0.25, 1.0]
    with pytest.raises(ValueError):
        schedule(reqs, 0)


def test_summary_counts_rejections_as_slo_misses() -> None:
    rs = [Result(0, 0, ttft_s=0.1, e2e_s=1.0, prompt_tokens=100, cached_tokens=50,
                 completion_tokens=10),  # tpot 0.1
          Result(1, 0, ttft_s=0.2, e2e_s=0.47, prompt_tokens=100, completion_tokens=10),
          Result(2, 0, status="rejected"),
          Result(3, 0, ttft_s=3.0, e2e_s=3.09, prompt_tokens=100, completion_tokens=10)]
    s = summarize(rs, duration_s=2.0, rate_rps=2.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert s["ok"] == 3 and s["rejected"] == 1
    assert s["slo_attainment"] == pytest.approx(1 / 4)  # only request 1 meets both
    assert s["hit_ratio"] == pytest.approx(50 / 300)
    assert s["tpot_s"]["p50"] == pytest.approx(0.03)
    assert s["output_tok_s"] == pytest.approx(15.0)
    runs = [{"rate_rps": 1.0, "slo_attainment": 0.95}, {"rate_rps": 2.0, "slo_attainment": 0.92},
            {"rate_rps": 4.0, "slo_attainment": 0.5}]
    assert goodput(runs) == 2.0 and goodput(runs[2:]) == 0.0


@pytest.mark.skipif(not (SHARED / "mooncake_conversation_trace.jsonl").exists(),
                    reason="shared trace not present")
def test_the_shared_trace_loads() -> None:
    reqs = load_trace(SHARED / "mooncake_conversation_trace.jsonl", limit=200)
    assert len(reqs) == 200
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs[:50])
    json.dumps([r.hash_ids for r in reqs])
