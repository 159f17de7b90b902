"""bench.frontend_vs_dynamo.added's own parts: the direct caller's command loop (in this
process, and over a real pipe to a child running it), the summary and the error check.
Dynamo itself is not run here (an anchor, not a kvmesh requirement): the child's call is
a stand-in that sleeps briefly or fails on demand."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.frontend_vs_dynamo import added
from bench.frontend_vs_dynamo.dynamo_direct import serve

ROOT = Path(__file__).resolve().parents[2]


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def test_serve_answers_each_command_in_order_and_stops_at_quit() -> None:
    seen: list[tuple[list[int], int]] = []

    async def call(token_ids: list[int], max_tokens: int) -> None:
        seen.append((token_ids, max_tokens))
        if token_ids == [666]:
            raise RuntimeError("no such prompt")

    out: list[str] = []
    await serve(call, _lines('{"op": "call", "id": 1, "token_ids": [1, 2], "max_tokens": 1}\n',
                             "not json\n", '{"op": "call", "id": 2, "token_ids": [666], '
                             '"max_tokens": 1}\n', '{"op": "quit"}\n',
                             '{"op": "call", "id": 3, "token_ids": [3], "max_tokens": 1}\n'),
                out.append)
    answers = [json.loads(line) for line in out]
    assert answers[0] == {"ready": True}
    assert answers[1]["id"] == 1 and answers[1]["ok"] is True
    assert answers[1]["s"] >= 0 and answers[1]["cpu_s"] >= 0
    assert answers[2]["id"] is None and "not json" in answers[2]["error"]
    assert answers[3] == {"id": 2, "ok": False, "error": "RuntimeError: no such prompt"}
    assert len(answers) == 4  # nothing after quit
    assert seen == [([1, 2], 1), ([666], 1)]


_CHILD = """
import asyncio, sys
sys.path.insert(0, {root!r})
from bench.frontend_vs_dynamo import dynamo_direct as d

async def call(token_ids, max_tokens):
    print("a stray line on stdout", flush=True)
    await asyncio.sleep(abs(token_ids[0]) / 1000)  # the first token id: ms to take
    if token_ids[0] < 0:
        raise RuntimeError("refused")

async def main():
    await d.serve(call, d._stdin_lines(), d._write)

asyncio.run(main())
"""


async def test_direct_caller_over_a_pipe(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=str(ROOT)))
    caller = added.DirectCaller(sys.executable, {}, tmp_path / "log" / "child.log")
    caller._argv = [sys.executable, str(script)]
    await caller.start(timeout_s=60)
    try:
        took, cpu = await caller.call([1, 2, 3])
        assert took > 0 and cpu >= 0  # the child's own figures
        with pytest.raises(RuntimeError, match="refused"):
            await caller.call([-1])
        took, _ = await caller.call([4])  # the loop goes on after a failed call
        assert took > 0
    finally:
        await caller.close()
    assert caller._proc is None


async def test_a_late_answer_is_not_taken_for_the_next_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=str(ROOT)))
    caller = added.DirectCaller(sys.executable, {}, tmp_path / "child.log")
    caller._argv = [sys.executable, str(script)]
    await caller.start(timeout_s=60)
    try:
        monkeypatch.setattr(added, "CALL_TIMEOUT_S", 0.2)
        with pytest.raises(added.DynamoError, match="answer to call 1"):
            await caller.call([-600])  # refused 0.6 s later, after the caller gave up
        monkeypatch.setattr(added, "CALL_TIMEOUT_S", 30.0)
        took, _ = await caller.call([1])  # its own answer, not the late refusal
        assert took > 0
    finally:
        await caller.close()


async def test_a_caller_that_never_comes_up_is_killed(tmp_path: Path) -> None:
    caller = added.DirectCaller(sys.executable, {}, tmp_path / "child.log")
    caller._argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    with pytest.raises(added.DynamoError, match="gave no ready"):
        await caller.start(timeout_s=0.5)
    assert caller._proc is None and caller.pid is not None
    with pytest.raises(ProcessLookupError):  # killed and reaped: its PID is free
        os.kill(caller.pid, 0)


async def test_direct_caller_that_exits_names_its_log(tmp_path: Path) -> None:
    caller = added.DirectCaller(sys.executable, {}, tmp_path / "child.log")
    caller._argv = [sys.executable, "-c", "import sys; sys.stderr.write('no runtime here')"]
    with pytest.raises(added.DynamoError, match="no runtime here"):
        await caller.start(timeout_s=60)
    await caller.close()


def _timed(direct: list[float], http: list[float]) -> dict:
    return {f"{s}_{k}": [(i, v, 0.0002 if k == "direct" else None)
                          for i, v in enumerate(vals)]
            for s in ("kvmesh", "dynamo") for k, vals in (("direct", direct), ("http", http))}


def test_summary_reports_added_latency_per_system_and_the_ratio() -> None:
    timed = _timed([0.001] * 5, [0.003] * 5)
    timed["dynamo_http"] = [(i, 0.002, None) for i in range(5)]
    timed["kvmesh_http"][1] = None  # a failed call: out of the pairs, counted
    report = added.summarize(timed)
    assert report["calls"]["kvmesh_http"]["errors"] == 1
    assert report["calls"]["kvmesh_direct"]["client_cpu_us_p50"] == pytest.approx(200)
    assert "client_cpu_us_p50" not in report["calls"]["kvmesh_http"]
    assert report["added"]["kvmesh"]["added_p50_ms"] == pytest.approx(2.0)
    assert report["added"]["kvmesh"]["paired_added_p50_ms"] == pytest.approx(2.0)
    assert report["added"]["dynamo"]["added_p50_ms"] == pytest.approx(1.0)
    assert report["kvmesh_over_dynamo"]["added_p50_ms"] == pytest.approx(2.0)


def test_summary_ratio_is_none_where_dynamo_adds_nothing() -> None:
    timed = _timed([0.002] * 3, [0.001] * 3)
    report = added.summarize(timed)
    assert report["kvmesh_over_dynamo"]["added_p50_ms"] is None
    empty = added.summarize({k: [None] for k in added.CALLS})
    assert math.isnan(empty["added"]["kvmesh"]["paired_added_p50_ms"])


def test_too_many_failed_calls_fail_the_bench() -> None:
    timed = _timed([0.001] * 200, [0.002] * 200)
    timed["dynamo_direct"][5] = timed["dynamo_direct"][6] = None
    added.check_errors(timed)  # 2 of 200: 1 %
    timed["dynamo_direct"][7] = None
    with pytest.raises(RuntimeError, match="dynamo_direct: 3 of 200"):
        added.check_errors(timed)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    timed = _timed([0.001, 0.0012], [0.002, 0.0025])
    added.plot(timed, added.summarize(timed), tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_the_cli_refuses_to_run_without_dynamo_when_told_not_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(added, "DYNVENV", tmp_path / "nothing")
    with pytest.raises(added.DynamoError, match="--no-install"):
        added.main(["--no-install", "--out", str(tmp_path)])

