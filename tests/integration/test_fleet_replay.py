"""Issue 5's fleet check: 32 mock workers behind the real indexer, router and frontend
replay a multi-turn conversation trace; KV routing serves more prompt tokens from cache
and meets the SLO at least as often as round robin."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.fleet_replay.run import parse_args, run_policy

pytestmark = [pytest.mark.slow]


def conversation_trace(path: Path, conversations: int = 12, turns: int = 5) -> None:
    """Mooncake-format: each turn's hash ids extend the previous turn's (a chat history),
    turns of different conversations interleave in time."""
    rng = random.Random(5)
    lines, next_id = [], 1000
    for c in range(conversations):
        ids: list[int] = [0]  # a system prompt every conversation shares
        for t in range(turns):
            new = rng.randint(1, 3)
            ids = ids + list(range(next_id, next_id + new))
            next_id += new
            lines.append({"timestamp": t * 1500 + c * 120, "input_length": len(ids) * 512 - 40,
                          "output_length": 200, "hash_ids": list(ids)})
    lines.sort(key=lambda d: d["timestamp"])
    path.write_text("\n".join(json.dumps(d) for d in lines))


def test_kv_routing_beats_round_robin_on_a_conversation_trace(tmp_path: Path) -> None:
    trace = tmp_path / "conv.jsonl"
    conversation_trace(trace)
    args = parse_args(["--trace", str(trace), "--limit", "60", "--speedups", "1",
                       "--workers", "32", "--dilation", "2", "--max-output", "8",
                       "--num-blocks", "512", "--no-progress", "--out", str(tmp_path)])
    kv = run_policy("kv", args)["runs"][0]
    rr = run_policy("round_robin", args)["runs"][0]
    assert kv["ok"] == rr["ok"] == 60 and kv["errors"] == rr["errors"] == 0
    # Ideal reuse here is ~70 % of prompt tokens; round robin over 32 workers rarely
    # lands a turn where its history lives.
    assert kv["hit_ratio"] > 0.5, kv
    assert kv["hit_ratio"] > rr["hit_ratio"] + 0.3, (kv["hit_ratio"], rr["hit_ratio"])
    assert kv["slo_attainment"] >= rr["slo_attainment"]
    assert kv["ttft_s"]["p50"] < rr["ttft_s"]["p50"]
