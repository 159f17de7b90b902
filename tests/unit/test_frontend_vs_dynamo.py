"""bench.frontend_vs_dynamo's pure parts: medians, ratios and the report; the request
bodies and the fairness check of answers; Dynamo's loopback environment, command lines and
install requirements. No network, no Dynamo install."""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from bench.frontend_vs_dynamo import report as rep
from bench.frontend_vs_dynamo.client import _Tally, body, check_response, summary
from bench.frontend_vs_dynamo.dynamo_side import (
    EXTRA_HOST_VARS,
    DynamoMesh,
    dynamo_env,
    ensure_dynvenv,
    filter_requirements,
)
from bench.frontend_vs_dynamo.run import non_loopback, parse_list
from bench.offline.dynamo import HOST_VARS


def _round(rps: float, p50: float, p99: float, ok: int = 10, errors: int = 0) -> dict:
    return {"requests": ok + errors, "ok": ok, "errors": errors, "req_per_s": rps,
            "p50_ms": p50, "p99_ms": p99}


# --- medians and ratios ---------------------------------------------------------------

def test_median_of_finite_numbers_only() -> None:
    assert rep.median([3, 1, 2]) == 2
    assert rep.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert rep.median([1.0, math.nan, None, 5.0, True]) == 3.0
    assert rep.median([]) is None
    assert rep.median([math.nan, None]) is None


def test_ratio_is_none_when_undefined() -> None:
    assert rep.ratio(50.0, 200.0) == 0.25
    assert rep.ratio(None, 2.0) is None
    assert rep.ratio(1.0, None) is None
    assert rep.ratio(1.0, 0.0) is None
    assert rep.ratio(math.nan, 2.0) is None
    assert rep.ratio(1.0, math.inf) is None


def test_side_summary_takes_medians_over_rounds_that_ran() -> None:
    rounds = [_round(100, 10, 30), _round(300, 30, 90, errors=2), _round(200, 20, 60),
              {"error": "dynamo did not start"}, _round(0, math.nan, math.nan, ok=0)]
    s = rep.side_summary(rounds)
    assert (s["req_per_s"], s["p50_ms"], s["p99_ms"]) == (200, 20, 60)
    assert s["rounds"] == 5 and s["rounds_ok"] == 3
    assert s["errors"] == 2
    assert s["side_errors"] == ["dynamo did not start"]
    assert s["cpu_us_per_req"] is None  # not recorded by these rounds


def test_side_summary_of_a_side_that_never_ran() -> None:
    s = rep.side_summary([{"error": "boom"}, {"error": "boom"}])
    assert s["req_per_s"] is None and s["p50_ms"] is None and s["rounds_ok"] == 0
    assert s["side_errors"] == ["boom"]


def test_build_rows_orders_points_numerically_and_divides_kvmesh_by_dynamo() -> None:
    results = {
        "closed": {
            "32": {"kvmesh": [_round(150, 200, 300)], "dynamo": [_round(600, 40, 60)]},
            "8": {"kvmesh": [_round(100, 80, 120), _round(140, 60, 100)],
                  "dynamo": [_round(500, 16, 30), _round(700, 12, 20)]},
        },
        "open": {"50": {"kvmesh": [_round(50, 10, 40)], "dynamo": [{"error": "x"}]}},
    }
    rows = rep.build_rows(results)
    assert [r["point"] for r in rows["closed"]] == [8, 32]
    c8 = rows["closed"][0]
    assert c8["kvmesh"]["req_per_s"] == 120 and c8["dynamo"]["req_per_s"] == 600
    assert c8["ratio"]["req_per_s"] == pytest.approx(0.2)
    assert c8["ratio"]["p50_ms"] == pytest.approx(70 / 14)
    assert rows["closed"][1]["ratio"]["p99_ms"] == pytest.approx(5.0)
    assert c8["ratio"]["cpu_us_per_req"] is None
    (o50,) = rows["open"]
    assert o50["point"] == 50.0
    assert o50["ratio"] == {k: None for k in (*rep.KEYS, "cpu_us_per_req")}


def test_goal_is_reported_per_target() -> None:
    def row(point: int, rps: float, p50: float) -> dict:
        return {"point": point, "ratio": {"req_per_s": rps, "p50_ms": p50, "p99_ms": 1.0}}

    g = rep.goal([row(1, 0.3, 0.9), row(8, 1.0, 2.0), row(32, 0.99, 2.0)])
    assert g == {"req_per_s_ratio_ge_1_at_c8": True, "req_per_s_ratio_ge_1_at_c32": False,
                 "p50_ratio_le_1_at_c1": True}
    assert rep.goal([row(8, None, None)]) == {  # type: ignore[arg-type]
        "req_per_s_ratio_ge_1_at_c8": None, "req_per_s_ratio_ge_1_at_c32": None,
        "p50_ratio_le_1_at_c1": None}


def test_format_table_shows_numbers_and_dashes_for_missing() -> None:
    rows = rep.build_rows({"closed": {
        "1": {"kvmesh": [_round(79, 12.4, 20)], "dynamo": [_round(344, 2.8, 5)]},
        "8": {"kvmesh": [_round(134, 59.7, 90)], "dynamo": [{"error": "down"}]}}})
    table = rep.format_table(rows["closed"]).splitlines()
    assert table[0].startswith("| concurrency | Dynamo req/s")
    assert table[2] == ("| 1 | 344 | 2.8 | 5.0 | 79 | 12.4 | 20.0 | 0.23× | 4.43× |")
    assert table[3] == "| 8 | — | — | — | 134 | 59.7 | 90.0 | — | — |"
    assert rep.format_table([], "open").startswith("| offered req/s")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = rep.build_rows({
        "closed": {"1": {"kvmesh": [_round(79, 12, 20)], "dynamo": [{"error": "down"}]}},
        "open": {"25": {"kvmesh": [_round(25, 5, 9)], "dynamo": [_round(25, 2, 4)]}}})
    out = tmp_path / "x.png"
    rep.plot(rows, out, "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the client's requests and its fairness check -------------------------------------

def test_bodies_are_identical_per_index_and_share_a_head() -> None:
    a, b = body("tiny", 7, 240, 16), body("tiny", 7, 240, 16)
    assert a == b
    assert a["max_tokens"] == 16 and a["ignore_eos"] is True and a["stream"] is False
    assert a["temperature"] == 0 and a["model"] == "tiny"
    words = a["prompt"].split()
    assert len(words) == 240
    other = body("tiny", 8, 240, 16)["prompt"].split()
    assert words[:200] == other[:200] and words[200:] != other[200:]


def test_check_response_accepts_only_the_full_token_count() -> None:
    ok = {"usage": {"completion_tokens": 16}}
    assert check_response(200, ok, 16) is None
    assert check_response(200, {"usage": {"completion_tokens": 15}}, 16) == (
        "usage.completion_tokens 15 != 16")
    assert "None" in str(check_response(200, {"choices": []}, 16))
    assert check_response(200, "text", 16) == "response is not a JSON object"
    assert str(check_response(503, {"error": "busy"}, 16)).startswith("HTTP 503")


def test_summary_percentiles_and_nan_without_answers() -> None:
    s = summary(4, [0.010, 0.020, 0.030], Counter({"HTTP 500": 1}), Counter({"16": 3}), 0.5)
    assert s["ok"] == 3 and s["errors"] == 1 and s["first_errors"] == ["HTTP 500"]
    assert s["req_per_s"] == 6.0 and s["p50_ms"] == pytest.approx(20.0)
    assert s["completion_tokens"] == {"16": 3}
    empty = summary(2, [], Counter({"boom": 2}), Counter(), 1.0)
    assert empty["ok"] == 0 and math.isnan(empty["p50_ms"]) and math.isnan(empty["mean_ms"])


async def test_tally_counts_short_answers_as_errors() -> None:
    """The response check inside the client's request path (a transport that answers
    from memory: no server runs in a unit test)."""
    answers = iter([16, 3])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"usage": {"completion_tokens": next(answers)}})

    tally = _Tally()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        await tally.one(http, "http://127.0.0.1:1", body("tiny", 0, 10, 16))
        await tally.one(http, "http://127.0.0.1:1", body("tiny", 1, 10, 16))
    assert len(tally.lat) == 1
    assert tally.errors == Counter({"usage.completion_tokens 3 != 16": 1})
    assert tally.tokens == Counter({"16": 1, "3": 1})


# --- Dynamo's side: environment, command lines, install -------------------------------

def test_dynamo_env_is_loopback_only() -> None:
    base = {"PATH": "/usr/bin", "DYN_CUSTOM_THING_HOST": "10.1.2.3",
            "DYN_HTTP_HOST": "0.0.0.0", "PYTHONPATH": "/work/main", "DYN_LOG": "debug"}
    env = dynamo_env("/tmp/kvdir", base)
    hosts = {k: v for k, v in env.items() if k.startswith("DYN_") and k.endswith("_HOST")}
    assert set(hosts) >= {*HOST_VARS, *EXTRA_HOST_VARS, "DYN_CUSTOM_THING_HOST"}
    assert {"DYN_EVENT_PLANE_HOST", "DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST",
            "DYN_SYSTEM_HOST"} <= set(hosts)
    assert set(hosts.values()) == {"127.0.0.1"}
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and env["DYN_FILE_KV"] == "/tmp/kvdir"
    assert env["DYN_REQUEST_PLANE"] == "tcp" and env["DYN_EVENT_PLANE"] == "zmq"
    assert env["DYN_SYSTEM_PORT"] == "-1" and env["DYN_SELF_HOST_METADATA"] == "0"
    assert env["DYN_LOG"] == "debug" and env["PATH"] == "/usr/bin"
    assert "PYTHONPATH" not in env
    assert base["DYN_HTTP_HOST"] == "0.0.0.0"  # the caller's mapping is not changed


def test_dynamo_env_defaults_to_this_process_environment(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("DYN_SOMETHING_HOST", "192.0.2.9")
    env = dynamo_env("/tmp/kv")
    assert env["DYN_SOMETHING_HOST"] == "127.0.0.1"
    assert os.environ["DYN_SOMETHING_HOST"] == "192.0.2.9"


def test_dynamo_command_lines() -> None:
    mesh = DynamoMesh("/x/bin/python", "/models/tiny", "tiny")
    try:
        argv = mesh.argv(4567)
    finally:
        mesh.close()
    assert not mesh.tmp.exists()
    assert argv["dynamo-frontend"] == ["/x/bin/python", "-m", "dynamo.frontend",
                                       "--http-host", "127.0.0.1", "--http-port", "4567",
                                       "--router-mode", "kv"]
    mockers = [v for k, v in argv.items() if k.startswith("dynamo-mocker")]
    assert len(mockers) == 2
    for m in mockers:
        assert m[:3] == ["/x/bin/python", "-m", "dynamo.mocker"]
        flags = dict(zip(m[3::2], m[4::2], strict=True))
        assert flags == {"--model-path": "/models/tiny", "--model-name": "tiny",
                         "--block-size": "32", "--num-gpu-blocks-override": "4096",
                         "--speedup-ratio": "10000"}


def test_filter_requirements_drops_aisimulate_the_runtime_and_extras() -> None:
    reqs = ["ai-dynamo-runtime==1.6.1", "aiohttp<4.0,>=3.14.3",
            "aisimulate==0.13.0; python_version >= '3.11' and python_version < '3.14'",
            "transformers>=4.56.0", "pyzmq>=26.0.0",
            "uvloop; extra == 'vllm'", "vllm[flashinfer,otel,runai]==0.31.0; extra == 'vllm'",
            "tomli; (python_version < '3.11') and extra == 'sglang'",
            "typing-extensions>=4.10.0; python_version >= '3.8'"]
    assert filter_requirements(reqs) == [
        "aiohttp<4.0,>=3.14.3", "transformers>=4.56.0", "pyzmq>=26.0.0",
        "typing-extensions>=4.10.0; python_version >= '3.8'"]


def test_ensure_dynvenv_installs_nothing_when_stamped(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / ".kvmesh-dynamo-1.6.1").write_text("[]")
    info = ensure_dynvenv(tmp_path)
    assert info["installed_now"] is False and info["install_s"] is None
    assert info["python"] == str(tmp_path / "bin" / "python")
    assert set(info["versions"]) == {"ai-dynamo", "ai-dynamo-runtime", "pydantic"}


# --- run's helpers --------------------------------------------------------------------

def test_parse_list() -> None:
    assert parse_list("1,8,32", int) == [1, 8, 32]
    assert parse_list("", float) == []
    assert parse_list("25, 50.5", float) == [25.0, 50.5]
    with pytest.raises(ValueError):
        parse_list("1,0", int)
    with pytest.raises(ValueError):
        parse_list("1,x", int)


def test_non_loopback() -> None:
    addrs = ["127.0.0.1:1", "::ffff:127.0.0.1:2", "::1:3", "0.0.0.0:4", "192.0.2.2:5",
             "::ffff:10.0.0.1:6", "::7"]
    assert non_loopback(addrs) == ["0.0.0.0:4", "192.0.2.2:5", "::ffff:10.0.0.1:6", "::7"]


# --- paced pairs: one request at a time, both sides in one sequence ---------------------

async def test_paced_pairs_times_both_sides_alike_and_counts_unfair_answers() -> None:
    """Two loopback servers, one answering with a content-length, one chunked (as
    Dynamo); the second gives one unfair answer (2 tokens) and one 500: each is an error
    of its side, not a latency, and its round leaves the paired difference."""
    import asyncio
    import json

    from bench.frontend_vs_dynamo.client import paced_pairs
    from tests.http_peer import read_post

    seen: dict[str, list[dict]] = {"a": [], "b": []}

    def serve_as(name: str, chunked: bool) -> object:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    req = json.loads(await read_post(reader))
                    seen[name].append(req)
                    k = len(seen[name])
                    tokens = 2 if (name == "b" and k == 2) else 1
                    status = b"500 Oops" if (name == "b" and k == 3) else b"200 OK"
                    payload = json.dumps({"usage": {"completion_tokens": tokens}}).encode()
                    if chunked:
                        writer.write(b"HTTP/1.1 " + status + b"\r\ntransfer-encoding: chunked"
                                     b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
                    else:
                        writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(payload), payload))
            except asyncio.IncompleteReadError:
                pass
            finally:
                writer.close()
        return serve

    servers = [await asyncio.start_server(serve_as(n, n == "b"), "127.0.0.1", 0)  # type: ignore[arg-type]
               for n in ("a", "b")]
    urls = {n: f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}"
            for n, s in zip(("a", "b"), servers, strict=True)}
    try:
        out = await asyncio.wait_for(paced_pairs(urls, "tiny", 5, 0.0), 30)
    finally:
        for s in servers:
            s.close()
            await s.wait_closed()
    assert out["a"]["ok"] == 5 and out["a"]["errors"] == 0
    assert out["b"]["ok"] == 3 and out["b"]["errors"] == 2
    assert any("completion_tokens 2" in e for e in out["b"]["first_errors"])
    assert any("HTTP 500" in e for e in out["b"]["first_errors"])
    assert math.isfinite(out["paired_diff_p50_ms"]) and out["gap_ms"] == 0.0
    # request i is the same for both sides: token ids, one token, no tokenizer
    assert seen["a"] == seen["b"]
    assert all(isinstance(r["prompt"], list) and r["max_tokens"] == 1 for r in seen["a"])


def test_the_paced_goal_is_void_when_a_side_failed_its_requests() -> None:
    def side(errors: int) -> dict[str, object]:
        return {"requests": 1000, "ok": 1000 - errors, "errors": errors,
                "first_errors": ["HTTP 404"] if errors else []}

    ran = {"kvmesh": side(0), "dynamo": side(10), "ratio": {"p50_ms": 0.9}}
    assert rep.paced_goal(ran) == (True, None)  # 1 % failed: still counted
    ran["ratio"] = {"p50_ms": 1.1}
    assert rep.paced_goal(ran) == (False, None)
    ran["dynamo"] = side(834)  # (as Dynamo's frontend once answered after the load)
    assert rep.paced_goal(ran) == (None, "dynamo failed 834 of 1000 paced requests "
                                         "(first: HTTP 404)")
    assert rep.paced_goal({"error": "kvmesh: down"}) == (None, "kvmesh: down")
