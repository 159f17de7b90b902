"""The AFD NIXL transport between real processes (NIXL 1.5.1, UCX on loopback DRAM).

Every endpoint lives in a spawned child process that ends with ``os._exit`` (NIXL may crash
at interpreter exit, which must not take pytest down); pytest relays the endpoint infos
between them over pipes, as the mesh will over etcd/gRPC. The FFN child answers every
attention output with ``hidden + 1``.

Covered: 1A1F with two microbatches in flight over several layers and steps, exact tensors
and contexts both ways, bad input refused (ValueError), the attention side's close seen by
the FFN (``peers()``), recv after close → AfdPeerGone; 2A1F (two attention processes share
one FFN process, contexts keep their attention id, one leaves and the other stays); a
silent FFN → AfdTimeout, then the FFN killed mid-exchange →
AfdPeerGone on the next send (the WRITE fails) and recv (the peer's process is gone),
whichever comes first, never a wait for the timeout. And a tiny run of the benchmark.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_for_sync

REPO_ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
CFG = (576, 16, 2, 1)  # hidden, max_tokens, microbatches, attention_workers
CHILD_S = 60.0  # bound on how long a child may take to answer (start-up on 2 busy cores)


def _ffn_child(conn: Connection, cfg: tuple[int, ...], peers: int, silent_after: int) -> None:
    """FFN endpoint: echo ``hidden + 1``; stop answering after ``silent_after`` messages."""
    code = 1
    try:
        os.environ.update(UCX_ENV)
        import torch

        torch.set_num_threads(1)
        from tests.waiting import wait_for_sync
        from workers.engines.afd.connector import AfdPeerGone, AfdTimeout, AfdTransportConfig
        from workers.engines.afd.transport_nixl import NixlAfdConnector

        ffn = NixlAfdConnector("ffn", AfdTransportConfig(*cfg))
        conn.send(ffn.info())
        for _ in range(peers):
            ffn.connect(conn.recv())
        conn.send("ready")
        served: list[tuple[int, ...]] = []
        while not conn.poll():
            try:
                hidden, ctx = ffn.recv_attn_output(timeout=0.2)
            except AfdTimeout:
                continue
            served.append((ctx.attention_id, ctx.layer, ctx.microbatch, ctx.stage, ctx.step,
                           ctx.num_tokens))
            if len(served) > silent_after:
                continue
            ffn.send_ffn_output(hidden + 1, ctx.answer())
        want_gone = conn.recv()  # the stop message: attention ids the FFN must see gone

        def noticed() -> bool:
            try:
                ffn.recv_attn_output(timeout=0)  # drives UCX progress
            except AfdTimeout:
                pass
            return all(ffn.peers()[i] for i in want_gone)

        wait_for_sync(noticed, CHILD_S, f"the FFN to see {want_gone} gone")
        conn.send({"served": served, "peers": ffn.peers()})
        ffn.close()
        ffn.close()  # idempotent
        try:
            ffn.recv_attn_output(timeout=0)
            conn.send("recv after close did not fail")
        except AfdPeerGone:
            conn.send("closed")
        code = 0
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


def _attn_child(conn: Connection, cfg: tuple[int, ...], attention_id: int, steps: int,
                layers: int, recv_timeout: float, after_kill: str) -> None:
    """Attention endpoint: random hidden states, both microbatches in flight per layer."""
    code = 1
    try:
        os.environ.update(UCX_ENV)
        import torch

        torch.set_num_threads(1)
        from workers.engines.afd.connector import (
            STAGE_ATTN_OUTPUT,
            AfdContext,
            AfdTransportConfig,
            AfdTransportError,
        )
        from workers.engines.afd.transport_nixl import NixlAfdConnector

        config = AfdTransportConfig(*cfg)
        attn = NixlAfdConnector("attention", config, attention_id)
        conn.send(attn.info())
        attn.connect(conn.recv())
        assert conn.recv() == "go"
        out: dict[str, Any] = {"sent": [], "checked": 0, "mismatch": 0}
        gen = torch.Generator().manual_seed(attention_id)
        bad: list[Any] = []
        for kwargs in ({"num_tokens": config.max_tokens + 1}, {"microbatch": 2},
                       {"attention_id": attention_id + 1}):
            fields = {"attention_id": attention_id, "layer": 0, "microbatch": 0,
                      "stage": STAGE_ATTN_OUTPUT, "step": 0, "num_tokens": 1, **kwargs}
            ctx = AfdContext(**fields)
            try:
                attn.send_attn_output(torch.zeros(ctx.num_tokens, config.hidden_size), ctx)
            except ValueError:
                bad.append(kwargs)
        try:
            attn.send_attn_output(torch.zeros(2, config.hidden_size),
                                  AfdContext(attention_id, 0, 0, STAGE_ATTN_OUTPUT, 0, 3))
        except ValueError:
            bad.append("shape")
        out["refused"] = len(bad)
        try:
            for step in range(steps):
                for layer in range(layers):
                    sent = []
                    for mb in range(config.microbatches):
                        n = 1 + (step * 7 + layer * 3 + mb * 5) % config.max_tokens
                        x = torch.randn(n, config.hidden_size, generator=gen)
                        ctx = AfdContext(attention_id, layer, mb, STAGE_ATTN_OUTPUT, step, n)
                        attn.send_attn_output(x, ctx)
                        out["sent"].append((attention_id, layer, mb, STAGE_ATTN_OUTPUT,
                                            step, n))
                        sent.append((x, ctx))
                    for x, ctx in reversed(sent):  # answers may be awaited in any order
                        y = attn.recv_ffn_output(ctx, timeout=recv_timeout)
                        out["checked"] += 1
                        out["mismatch"] += int(not torch.equal(y, x + 1))
        except AfdTransportError as exc:
            if not after_kill:
                raise
            out["failure"] = type(exc).__name__
            conn.send(out)
            out = _after_failure(conn, attn, config, after_kill)
        conn.send(out)
        assert conn.recv() == "close"
        attn.close()
        attn.close()
        conn.send({"closed": True})
        code = 0
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


def _after_failure(conn: Connection, attn: Any, config: Any, order: str) -> dict[str, Any]:
    """After a silent FFN timed out: wait for the kill, then a send and a recv (in ``order``)
    must fail."""
    import torch

    from workers.engines.afd.connector import STAGE_ATTN_OUTPUT, AfdContext, AfdTransportError

    assert conn.recv() == "killed"
    out: dict[str, Any] = {}
    ctx = AfdContext(attn.attention_id, 0, 0, STAGE_ATTN_OUTPUT, 99, 1)
    # send first: its WRITE meets the dead peer (NIXL reports the disconnect); recv first:
    # the wait sees the peer's process gone. Either way the other call fails at once.
    calls = {"send": lambda: attn.send_attn_output(torch.zeros(1, config.hidden_size), ctx),
             "recv": lambda: attn.recv_ffn_output(ctx, timeout=20.0)}
    for what in order.split(","):
        call = calls[what]
        try:
            call()
            out[what] = "no error"
        except AfdTransportError as exc:
            out[what] = type(exc).__name__
    return out


class Kids:
    """Spawned children and their pipes; always killed (by their PIDs) at the end."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []

    def start(self, target: Any, *args: Any) -> tuple[Connection, Any]:
        ours, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(theirs, *args), daemon=True)
        proc.start()
        self.procs.append(proc)
        return ours, proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


@contextmanager
def kids() -> Iterator[Kids]:
    k = Kids()
    try:
        yield k
    finally:
        k.close()


def recv(conn: Connection) -> Any:
    assert conn.poll(CHILD_S), "child did not answer"
    msg = conn.recv()
    assert not (isinstance(msg, dict) and "error" in msg), msg["error"]
    return msg


def pair(k: Kids, cfg: tuple[int, ...], n_attn: int, steps: int, layers: int,
         silent_after: int = 1 << 30, after_kill: str = ""
         ) -> tuple[Connection, Any, list[Connection]]:
    """Start one FFN and ``n_attn`` attention children, cross-connect them, say go."""
    f, fproc = k.start(_ffn_child, cfg, n_attn, silent_after)
    timeout = 1.0 if after_kill else 20.0
    attns = [k.start(_attn_child, cfg, i, steps, layers, timeout, after_kill)[0]
             for i in range(n_attn)]
    ffn_info = recv(f)
    for a in attns:
        f.send(recv(a))
        a.send(ffn_info)
    assert recv(f) == "ready"
    for a in attns:
        a.send("go")
    return f, fproc, attns


def test_one_attention_one_ffn_round_trip() -> None:
    with kids() as k:
        f, _, (a,) = pair(k, CFG, 1, steps=3, layers=4)
        got = recv(a)
        assert got["refused"] == 4
        assert got["checked"] == 3 * 4 * 2 and got["mismatch"] == 0
        a.send("close")
        assert recv(a) == {"closed": True}
        # The attention side's goodbye (or its exit) marks it gone; the FFN goes on.
        f.send([0])  # stop serving; attention 0 must be seen gone
        ffn = recv(f)
        assert ffn["peers"][0]
        assert [tuple(c) for c in ffn["served"]] == [tuple(c) for c in got["sent"]]
        assert recv(f) == "closed"


def test_two_attention_workers_share_one_ffn() -> None:
    cfg = (576, 16, 2, 2)
    with kids() as k:
        f, _, attns = pair(k, cfg, 2, steps=2, layers=3)
        results = [recv(a) for a in attns]
        for r in results:
            assert r["checked"] == 2 * 3 * 2 and r["mismatch"] == 0
        # Attention 0 leaves; the FFN keeps attention 1.
        attns[0].send("close")
        assert recv(attns[0]) == {"closed": True}
        f.send([0])  # stop serving; attention 0 must be seen gone
        ffn = recv(f)
        assert ffn["peers"][0] and ffn["peers"][1] == ""
        served = [tuple(c) for c in ffn["served"]]
        for i, r in enumerate(results):
            assert [c for c in served if c[0] == i] == [tuple(c) for c in r["sent"]]
        assert recv(f) == "closed"
        attns[1].send("close")
        assert recv(attns[1]) == {"closed": True}


@pytest.mark.parametrize("order", ["send,recv", "recv,send"])
def test_silent_then_killed_ffn_fails_fast(order: str) -> None:
    # The FFN answers 4 messages, then goes silent: the attention side's recv times out
    # with both microbatches of layer 2 outstanding. Then the FFN is killed: the next send
    # and recv (either first) fail with AfdPeerGone.
    with kids() as k:
        f, fproc, (a,) = pair(k, CFG, 1, steps=1, layers=8, silent_after=4, after_kill=order)
        first = recv(a)
        assert first["checked"] == 4 and first["mismatch"] == 0
        assert first["failure"] == "AfdTimeout"
        os.kill(fproc.pid, signal.SIGKILL)
        wait_for_sync(lambda: not fproc.is_alive(), CHILD_S, "the FFN child to die")
        a.send("killed")
        after = recv(a)
        assert after == {"send": "AfdPeerGone", "recv": "AfdPeerGone"}
        a.send("close")
        assert recv(a) == {"closed": True}
        del f


@pytest.mark.slow
def test_bench_afd_transport_tiny(tmp_path: Path) -> None:
    """``python -m bench.afd.transport`` end to end, tiny (no timing asserts)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.afd.transport", "--tokens", "1,4", "--iters", "3",
         "--warmup", "1", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env={**os.environ, **UCX_ENV}, capture_output=True, text=True,
        timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads((tmp_path / "afd_transport.json").read_text())
    assert report["all_verified"] is True
    for name, t in report["transports"].items():
        assert t["status"] in ("ran", "skipped"), name
        if t["status"] == "ran":
            assert [r["num_tokens"] for r in t["results"]] == [1, 4]
            assert all(r["verified"] and r["round_trip"]["n"] == 3 for r in t["results"])
            assert t["ffn_exit_code"] == 0
    assert report["transports"]["nixl"]["status"] == "ran"
