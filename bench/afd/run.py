"""AFD end to end: TPOT and tokens/s of unsplit, 1A1F and 2A1F, 1 or 2 microbatches, shm and
NIXL, in one run, with where the time goes and a break-even model.

``python -m bench.afd [--model smollm2|tiny|DIR] [--batches 1,4,8] [--steps 8] [--warmup 2]
[--reps 2] [--transports shm,nixl] [--topologies unsplit,1A1F,2A1F] [--microbatches 1,2]
[--out bench/results]``

Contracts:

- Every role is a process of its own (spawned, ``torch.set_num_threads(1)``; more threads
  cost 10x+ per small op on 2 shared cores): ``unsplit`` is one process with the whole model
  (:class:`UnsplitExecutor`); ``1A1F`` one attention process (:class:`SplitExecutor`) and
  one FFN process (:class:`FfnServer`, batching what is pending, ``--gather-us`` more);
  ``2A1F`` two attention processes sharing one FFN process. Per transport (``shm``:
  :mod:`~workers.engines.afd.transport_local`; ``nixl``: :mod:`~workers.engines.afd.
  transport_nixl`, endpoint infos relayed over pipes both ways) one group of processes is
  started once and kept for the whole run. The driver (this process) only coordinates;
  between cells every process blocks on its pipe (no polling).
- A *cell* is (variant, batch): each attention worker builds a fresh :class:`AfdEngine`
  with ``batch`` requests (seeded prompts of ``--prompt-len`` tokens, the same for every
  variant and worker; greedy, ``ignore_eos``), runs the prefill step and ``--warmup`` decode
  steps untimed, then ``--steps`` timed decode steps. TPOT is the mean timed step time
  (every request gets one token per step); tokens/s is all workers' timed tokens over the
  cell's wall window. ``--reps`` rounds run every cell once each, the cell order rotated
  per round (interleaved: machine noise hits every variant alike). Greedy tokens of every
  cell must equal unsplit's (1 microbatch) for the same batch, else the run fails.
- Where the time goes (split cells), from per-message timestamps on one clock
  (``perf_counter`` is CLOCK_MONOTONIC, shared by the processes), recorded by wrappers
  around each connector and the FFN side (the engine core is not changed): ``transfer``
  per message = both send calls (each cut at the peer's receipt: on 2 cores the woken peer
  often preempts the sender inside its send) + both deliveries (the up delivery from the
  end of the attention send to the FFN's recv returning, less any time the FFN was busy
  elsewhere; the down delivery likewise, estimated from the cell's median when the
  attention side was busy as the answer landed); ``ffn_queue`` = time the message waited
  for the FFN (busy with other messages) or, in the server, for its batch's compute and
  the sends before its own; ``hidden`` = the part of the transfer inside the attention
  worker's compute (the gaps before its send calls: its timeline is one thread); ``exposed
  = transfer - hidden``; ``overlap_ratio = hidden / transfer``; idle per role = the
  attention worker's recv waits and the FFN's recv waits over the window. Attention/FFN
  compute per layer per step from :class:`ExecStats` and the FFN's timed forward calls.
- Break-even (:mod:`bench.afd.breakeven`): attention and FFN layer compute is measured in
  this process on synthetic SmolLM2-proportioned layers at ``--fit-hidden`` x
  ``--fit-batches`` and fit; the round trip per message is fit (fixed + per byte) from the
  1-microbatch 1A1F cells of each transport (the echo microbench
  ``bench/results/afd_transport.json`` is fit too, for comparison). The JSON holds the
  constants, a table of predicted per-layer times and the break-even hidden size per batch.
- Writes ``<out>/afd.json`` and ``<out>/afd.png`` (skipped without matplotlib). Exit code
  0 iff every cell ran and every token check passed. Every process is stopped (asked,
  then killed by its PID); processes end with ``os._exit`` (NIXL may segfault at exit).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.afd.breakeven import llama_shape
from bench.afd.report import analyse, build_model, plot, summarize, transport_json_fit, verdict
from bench.process import run_and_exit

REPO_ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
TOPOLOGIES = ("unsplit", "1A1F", "2A1F")
TRANSPORTS = ("shm", "nixl")
START_S = 180.0  # bound on a process's start (import torch, load, pair) on 2 busy cores
CELL_S = 600.0  # bound on one cell
clock = time.perf_counter


def model_dir(name: str) -> Path:
    """``smollm2`` -> the converted SmolLM2 folder, ``tiny`` -> the tiny Llama (built if
    missing), else a folder path."""
    if name == "smollm2":
        from workers.model.paths import models_dir

        return models_dir() / "SmolLM2-135M-Instruct"
    if name == "tiny":
        from workers.model.tiny import ensure_tiny_model

        return Path(ensure_tiny_model())
    return Path(name)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1000 + batch)
    return [[int(t) for t in rng.integers(3, min(vocab, 8000), length)] for _ in range(batch)]


# ------------------------------------------------------------------ child processes

def _make_recorders() -> tuple[type, type, type]:
    """The connector/FFN wrappers (built lazily: children import torch, the driver need not)."""
    from workers.engines.afd.connector import AfdConnector, AfdTimeout
    from workers.engines.afd.model import FfnSide

    def key(ctx: Any) -> tuple[int, int, int, int]:
        return (ctx.attention_id, ctx.step, ctx.layer, ctx.microbatch)

    class AttnRec(AfdConnector):
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.sends: list[tuple[Any, ...]] = []
            self.recvs: list[tuple[Any, ...]] = []

        def send_attn_output(self, hidden: Any, ctx: Any) -> None:
            t0 = clock()
            self.inner.send_attn_output(hidden, ctx)
            self.sends.append((*key(ctx), ctx.num_tokens, t0, clock()))

        def recv_ffn_output(self, ctx: Any, timeout: float) -> Any:
            t0 = clock()
            out = self.inner.recv_ffn_output(ctx, timeout)
            self.recvs.append((*key(ctx), t0, clock()))
            return out

        def close(self) -> None:
            self.inner.close()

    class TimedFfn(FfnSide):
        def __init__(self, base: Any) -> None:
            super().__init__(base.config, base.layers)
            self.last = (0.0, 0.0)

        def forward(self, layer: int, mid: Any) -> Any:
            t0 = clock()
            out = super().forward(layer, mid)
            self.last = (t0, clock())
            return out

    class FfnRec(AfdConnector):
        def __init__(self, inner: Any, ffn: Any) -> None:
            self.inner, self.ffn = inner, ffn
            self.reset()

        def reset(self) -> None:
            self.got: dict[tuple[int, ...], tuple[float, float]] = {}
            self.msgs: list[tuple[Any, ...]] = []
            self.waits: list[tuple[float, float]] = []

        def recv_attn_output(self, timeout: float) -> Any:
            t0 = clock()
            try:
                hidden, ctx = self.inner.recv_attn_output(timeout)
            except AfdTimeout:
                self.waits.append((t0, clock()))
                raise
            t1 = clock()
            self.waits.append((t0, t1))
            self.got[key(ctx)] = (t0, t1)
            return hidden, ctx

        def send_ffn_output(self, hidden: Any, ctx: Any) -> None:
            t0 = clock()
            self.inner.send_ffn_output(hidden, ctx)
            k = key(ctx)
            self.msgs.append((*k, *self.got.pop(k, (t0, t0)), *self.ffn.last, t0, clock()))

        def close(self) -> None:
            self.inner.close()

    return AttnRec, FfnRec, TimedFfn


def _child_setup() -> Any:
    os.environ.update(UCX_ENV)
    import torch

    torch.set_num_threads(1)
    return torch


def _attn_main(conn: Connection, spec: dict[str, Any]) -> None:
    """An attention (or unsplit) worker: run cells on command; os._exit at the end."""
    code = 1
    try:
        _child_setup()
        from workers.engines.afd.connector import AfdTransportConfig
        from workers.engines.afd.engine import SplitExecutor, UnsplitExecutor
        from workers.engines.afd.model import load_attention_side, load_ffn_side

        attn = load_attention_side(spec["model"])
        rec = None
        if spec["topology"] == "unsplit":
            ffn = load_ffn_side(spec["model"])
        else:
            AttnRec, _, _ = _make_recorders()
            cfg = AfdTransportConfig(*spec["tcfg"])
            aid = spec["attention_id"]
            if spec["transport"] == "shm":
                from workers.engines.afd.transport_local import ShmAttentionConnector

                inner: Any = ShmAttentionConnector(spec["name"], aid, cfg, connect_timeout=START_S)
            else:
                from workers.engines.afd.transport_nixl import NixlAfdConnector

                inner = NixlAfdConnector("attention", cfg, aid)
                inner.connect(conn.recv())
                conn.send(inner.info())
            rec = AttnRec(inner)
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break

            def executor() -> Any:
                if rec is None:
                    return UnsplitExecutor(ffn)
                return SplitExecutor(rec, attention_id=spec["attention_id"])

            conn.send(_run_cell(attn, executor(), rec, cmd))
        if rec is not None:
            rec.close()
        code = 0
    except BaseException as exc:  # report, then hard-exit
        try:
            conn.send({"error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()})
        except OSError:  # the parent is gone: the error goes to this child's stderr
            traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _run_cell(attn: Any, ex: Any, rec: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from dataclasses import asdict

    from workers.engines.afd.engine import AfdEngine
    from workers.engines.afd.kv_cache import KvCache
    from workers.engines.afd.sampling import SamplingParams

    ps = cmd["prompts"]
    total = 1 + cmd["warmup"] + cmd["steps"]
    eng = AfdEngine(attn, KvCache(attn.config, len(ps) * (len(ps[0]) + total) + 8), ex,
                    microbatches=cmd["microbatches"], max_batch_tokens=4096)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=total, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    step_s: list[float] = []
    before: dict[str, Any] = {}
    t_start = 0.0
    for n in range(total):
        if n == 1 + cmd["warmup"]:
            before = asdict(ex.stats)
            t_start = clock()
        t0 = clock()
        outs = eng.step()
        step_s.append(clock() - t0)
        for o in outs:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id}: {o.error}")
            tokens[o.request_id].append(int(o.token or 0))
    t_end = clock()
    first = 2 + cmd["warmup"]  # engine step numbers start at 1 (the prefill)
    out: dict[str, Any] = {
        "t0": t_start, "t1": t_end, "step_s": step_s[1 + cmd["warmup"]:], "tokens": tokens,
        "stats": {k: v - before[k] for k, v in asdict(ex.stats).items()},
        "first_step": first}
    if rec is not None:
        out["sends"] = [s for s in rec.sends if s[1] >= first]
        out["recvs"] = [r for r in rec.recvs if r[1] >= first]
        rec.sends.clear()
        rec.recvs.clear()
    return out


def _ffn_main(conn: Connection, spec: dict[str, Any]) -> None:
    """The FFN worker: serve while told to (``serve`` .. ``drain``); os._exit at the end."""
    code = 1
    try:
        _child_setup()
        from workers.engines.afd.connector import AfdTimeout, AfdTransportConfig
        from workers.engines.afd.ffn_server import FfnServer
        from workers.engines.afd.model import load_ffn_side

        _, FfnRec, TimedFfn = _make_recorders()
        ffn = TimedFfn(load_ffn_side(spec["model"]))
        cfg = AfdTransportConfig(*spec["tcfg"])
        if spec["transport"] == "shm":
            from workers.engines.afd.transport_local import ShmFfnConnector

            inner: Any = ShmFfnConnector(spec["name"], cfg)
        else:
            from workers.engines.afd.transport_nixl import NixlAfdConnector

            inner = NixlAfdConnector("ffn", cfg)
            conn.send(inner.info())
            for _ in range(cfg.attention_workers):
                inner.connect(conn.recv())
        rec = FfnRec(inner, ffn)
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            rec.reset()
            server = FfnServer(ffn, rec, max_batch_messages=8, gather_s=spec["gather_s"])
            while not conn.poll():
                try:
                    server.serve_once(0.01)
                except AfdTimeout:
                    pass
            assert conn.recv() == "drain"
            st = server.stats
            conn.send({"msgs": rec.msgs, "waits": rec.waits, "messages": st.messages,
                       "batches": st.batches, "batch_sizes": dict(st.batch_sizes),
                       "compute_s": st.compute_s, "dropped": st.dropped})
        rec.close()
        code = 0
    except BaseException as exc:
        try:
            conn.send({"error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()})
        except OSError:  # the parent is gone: the error goes to this child's stderr
            traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


# ------------------------------------------------------------------ the driver

def _expect(conn: Connection, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"{what}: no answer within {timeout:.0f}s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"{what}: {msg['error']}\n{msg.get('traceback', '')}")
    return msg


@dataclass
class Group:
    """One topology on one transport: its processes and their pipes."""

    topology: str
    transport: str
    attn: list[tuple[Any, Connection]] = field(default_factory=list)
    ffn: tuple[Any, Connection] | None = None
    setup_s: float = 0.0
    shm_name: str = ""

    @property
    def label(self) -> str:
        return self.topology if self.topology == "unsplit" else f"{self.topology}/{self.transport}"

    def procs(self) -> list[Any]:
        return [p for p, _ in self.attn] + ([self.ffn[0]] if self.ffn else [])


def spawn_group(topology: str, transport: str, model: Path, hidden: int, max_tokens: int,
                gather_s: float) -> Group:
    """Spawn the group's processes (they load while other groups spawn); then
    :func:`pair_group`."""
    ctx = mp.get_context("spawn")
    g = Group(topology, transport)
    g.setup_s = clock()
    workers = {"unsplit": 1, "1A1F": 1, "2A1F": 2}[topology]
    spec: dict[str, Any] = {"model": str(model), "topology": topology, "transport": transport,
                            "tcfg": (hidden, max_tokens, 2, workers), "gather_s": gather_s}
    if transport == "shm" and topology != "unsplit":
        from workers.engines.afd.transport_local import make_shm_connector_pair_name

        spec["name"] = g.shm_name = f"bench-{make_shm_connector_pair_name()}-{topology}"

    def spawn(target: Any, **extra: Any) -> tuple[Any, Connection]:
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=target, args=(theirs, {**spec, **extra}), daemon=True)
        p.start()
        return p, ours

    if topology != "unsplit":
        g.ffn = spawn(_ffn_main)
    g.attn = [spawn(_attn_main, attention_id=i) for i in range(workers)]
    return g


def pair_group(g: Group) -> None:
    """Relay NIXL endpoint infos, wait until every process is ready (stopped on failure)."""
    try:
        if g.ffn is not None and g.transport == "nixl":
            ffn_info = _expect(g.ffn[1], START_S, f"{g.label} FFN info")
            for _, c in g.attn:
                c.send(ffn_info)
            for _, c in g.attn:
                g.ffn[1].send(_expect(c, START_S, f"{g.label} attention info"))
        if g.ffn is not None:
            assert _expect(g.ffn[1], START_S, f"{g.label} FFN ready") == "ready"
        for _, c in g.attn:
            assert _expect(c, START_S, f"{g.label} attention ready") == "ready"
    except BaseException:
        stop_group(g)
        raise
    g.setup_s = clock() - g.setup_s


def stop_group(g: Group) -> None:
    for _, c in ([*g.attn, g.ffn] if g.ffn else g.attn):
        try:
            c.send("stop")
        except OSError:
            pass
    for p in g.procs():
        p.join(15)
        if p.is_alive():
            p.kill()
            p.join(5)
    g.attn, g.ffn = [], None
    if g.shm_name:  # the FFN connector unlinks it on close; not when it was killed
        from workers.engines.afd.transport_local import shm_path

        shm_path(g.shm_name).unlink(missing_ok=True)


def run_cell(g: Group, mb: int, batch: int, cfg: dict[str, Any], vocab: int) -> dict[str, Any]:
    """One cell on a started group: raw results of every worker (and the FFN)."""
    cmd = {"prompts": prompts(batch, cfg["prompt_len"], vocab), "microbatches": mb,
           "steps": cfg["steps"], "warmup": cfg["warmup"]}
    if g.ffn is not None:
        g.ffn[1].send("serve")
    for _, c in g.attn:
        c.send(cmd)
    workers = [_expect(c, CELL_S, f"{g.label} cell") for _, c in g.attn]
    ffn = None
    if g.ffn is not None:
        g.ffn[1].send("drain")
        ffn = _expect(g.ffn[1], CELL_S, f"{g.label} FFN drain")
    return {"workers": workers, "ffn": ffn}


# ------------------------------------------------------------------ compute fit

def measure_compute(hiddens: list[int], batches: list[int], ctx: int,
                    reps: int) -> list[dict[str, Any]]:
    """Median seconds of one attention / FFN layer call on synthetic SmolLM2-proportioned
    layers (random weights), one thread, decode at context ``ctx``."""
    import torch

    from workers.engines.afd.kv_cache import KvCache
    from workers.engines.afd.model import (
        AttentionLayer,
        FfnLayer,
        ModelConfig,
        Rope,
        SeqSlice,
    )

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    points = []
    for h in hiddens:
        s = llama_shape(h)

        def w(o: int, i: int) -> torch.Tensor:
            return torch.randn(o, i, generator=gen) * 0.02

        cfg = ModelConfig(1000, h, s.intermediate, 1, s.q // 64, s.kv // 64, 64, 1e-5, 1e4,
                          False, ctx + 8)
        al = AttentionLayer(0, torch.ones(h), w(s.q, h), w(s.kv, h), w(s.kv, h), w(h, s.q))
        fl = FfnLayer(0, torch.ones(h), w(s.intermediate, h), w(s.intermediate, h),
                      w(h, s.intermediate))
        rope = Rope(64, 1e4, ctx + 8)
        for b in batches:
            kv = KvCache(cfg, b * (ctx + 1))
            for i in range(b):
                kv.allocate(f"r{i}", ctx + 1)
                kvh = torch.randn(ctx, s.kv // 64, 64, generator=gen)
                kv.write(0, f"r{i}", 0, kvh, kvh)
            seqs = [SeqSlice(f"r{i}", i, ctx, 1) for i in range(b)]
            pos = torch.full((b,), ctx, dtype=torch.int64)
            x = torch.randn(b, h, generator=gen)
            for kind in ("attn", "ffn"):
                ts = []
                for i in range(reps + 1):  # the first call is a warm-up
                    a = clock()
                    if kind == "attn":
                        al.forward(x, seqs, pos, kv, cfg, rope)
                    else:
                        fl.forward(x, 1e-5)
                    if i:
                        ts.append(clock() - a)
                points.append({"kind": kind, "hidden": h, "batch": b, "ctx": ctx,
                               "seconds": float(np.median(ts))})
    return points


# ------------------------------------------------------------------ the run

def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole benchmark as a JSON-ready report (module docstring)."""
    os.environ.update(UCX_ENV)
    import torch

    from workers.engines.afd.model import load_config

    torch.set_num_threads(1)
    t_run = clock()
    load_before = os.getloadavg()
    mdir = model_dir(cfg["model"])
    mc = load_config(mdir)
    compute = (measure_compute(cfg["fit_hidden"], cfg["fit_batches"], cfg["prompt_len"] + 4,
                               cfg["fit_reps"]) if cfg["fit_hidden"] else [])
    errors: list[dict[str, Any]] = []
    pending = []
    for topo in cfg["topologies"]:
        for tr in (cfg["transports"] if topo != "unsplit" else ["none"]):
            pending.append(spawn_group(topo, tr, mdir, mc.hidden_size,
                                       max(cfg["batches"]) * cfg["prompt_len"], cfg["gather_s"]))
    groups = []
    for g in pending:
        try:
            pair_group(g)
            groups.append(g)
        except Exception as exc:
            errors.append({"group": g.label, "error": f"{type(exc).__name__}: {exc}"})
    plan = [(g, mb, b) for g in groups for mb in cfg["microbatches"] for b in cfg["batches"]
            if not (mb == 2 and b == 1)]  # one request makes one microbatch: a duplicate
    cells: list[dict[str, Any]] = []
    broken: set[str] = set()
    try:
        for rep in range(cfg["reps"]):
            shift = (rep * len(plan)) // max(cfg["reps"], 1)
            refs: dict[int, dict[str, list[int]]] = {}
            for g, mb, b in plan[shift:] + plan[:shift]:
                if g.label in broken:
                    continue
                try:
                    raw = run_cell(g, mb, b, cfg, mc.vocab_size)
                except Exception as exc:
                    broken.add(g.label)
                    errors.append({"group": g.label, "rep": rep, "microbatches": mb, "batch": b,
                                   "error": f"{type(exc).__name__}: {exc}"})
                    continue
                cell = analyse(raw, g.topology, g.transport, mb, b, mc.num_layers, mc.hidden_size)
                cell["rep"] = rep
                cell["_tokens"] = raw["workers"][0]["tokens"]
                cell["_all_tokens"] = [w["tokens"] for w in raw["workers"]]
                cells.append(cell)
                print(f"rep {rep} {cell['variant']:>18} B={b}: TPOT {cell['tpot_ms']:7.1f} ms "
                      f"{cell['tokens_per_s']:6.1f} tok/s overlap "
                      f"{cell.get('overlap_ratio') or 0:.2f}", file=sys.stderr, flush=True)
                if g.topology == "unsplit" and mb == 1:
                    refs[b] = cell["_tokens"]
            for c in cells:
                if c["rep"] == rep:
                    ref = refs.get(c["batch"])
                    c["tokens_match_unsplit"] = (None if ref is None else
                                                 all(t == ref for t in c["_all_tokens"]))
    finally:
        for g in groups:
            stop_group(g)
    for c in cells:
        c.pop("_tokens")
        c.pop("_all_tokens")
    summary = summarize(cells)
    tfit = transport_json_fit(REPO_ROOT / "bench" / "results" / "afd_transport.json")
    model = build_model(compute, cells, tfit, mc.hidden_size, mc.num_layers,
                        cfg["prompt_len"] + 4)
    mismatched = [c["variant"] + f"/B{c['batch']}/rep{c['rep']}" for c in cells
                  if c.get("tokens_match_unsplit") is False]
    return {
        "schema": "kvmesh.bench.afd/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": ("Measured on a shared 2-core machine (other jobs ran at the same time): every "
                 "variant ran in one run, cells interleaved and rotated per rep, so noise hits "
                 "all alike; absolute numbers are not capacity figures."),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "config": {**cfg, "model_dir": str(mdir), "hidden": mc.hidden_size,
                   "layers": mc.num_layers, "torch_threads": 1, "ucx_env": UCX_ENV,
                   "batch_meaning": "concurrent decode requests per attention worker"},
        "setup_s": {g.label: g.setup_s for g in groups},
        "cells": cells, "summary": summary, "break_even": model,
        "verdict": verdict(summary, model, os.cpu_count()),
        "token_mismatches": mismatched, "errors": errors,
        "ok": not errors and not mismatched and bool(cells),
        "wall_s": clock() - t_run,
    }


# ------------------------------------------------------------------ CLI

def _ints(p: argparse.ArgumentParser, name: str, raw: str) -> list[int]:
    try:
        vals = [int(x) for x in raw.split(",") if x]
    except ValueError:
        p.error(f"{name} must be comma-separated integers, got {raw!r}")
    if not vals or min(vals) < 1:
        p.error(f"{name} must list integers >= 1, got {raw!r}")
    return vals


def _names(p: argparse.ArgumentParser, name: str, raw: str, known: tuple[str, ...]) -> list[str]:
    vals = [x for x in raw.split(",") if x]
    bad = [v for v in vals if v not in known]
    if bad or not vals:
        p.error(f"{name}: unknown {bad or raw!r}; known {list(known)}")
    return vals


def main(argv: list[str] | None = None) -> int:
    """Run, write JSON (+PNG); 0 iff every cell ran and matched unsplit's tokens."""
    p = argparse.ArgumentParser(prog="python -m bench.afd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model folder")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per cell")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--topologies", default=",".join(TOPOLOGIES))
    p.add_argument("--microbatches", default="1,2")
    p.add_argument("--gather-us", type=float, default=0.0,
                   help="FFN server: wait this long for more messages to batch")
    p.add_argument("--fit-hidden", default="128,256,576,1024",
                   help="hidden sizes of the synthetic compute fit ('' to skip)")
    p.add_argument("--fit-batches", default="1,4,8,32")
    p.add_argument("--fit-reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if min(args.steps, args.reps, args.prompt_len, args.fit_reps) < 1 or args.warmup < 0 \
            or args.gather_us < 0:
        p.error("--steps, --reps, --prompt-len, --fit-reps must be >= 1; --warmup, "
                "--gather-us >= 0")
    mbs = _ints(p, "--microbatches", args.microbatches)
    if not set(mbs) <= {1, 2}:
        p.error(f"--microbatches: 1 and/or 2, got {args.microbatches!r}")
    fit_hidden = _ints(p, "--fit-hidden", args.fit_hidden) if args.fit_hidden else []
    if any(h % 64 for h in fit_hidden):
        p.error("--fit-hidden: multiples of 64")
    cfg = {"model": args.model, "batches": _ints(p, "--batches", args.batches),
           "steps": args.steps, "warmup": args.warmup, "reps": args.reps,
           "prompt_len": args.prompt_len, "microbatches": mbs,
           "transports": _names(p, "--transports", args.transports, TRANSPORTS),
           "topologies": _names(p, "--topologies", args.topologies, TOPOLOGIES),
           "gather_s": args.gather_us * 1e-6, "fit_hidden": fit_hidden,
           "fit_batches": _ints(p, "--fit-batches", args.fit_batches), "fit_reps": args.fit_reps}
    if not Path(model_dir(args.model), "config.json").is_file():
        p.error(f"--model: no model folder at {model_dir(args.model)} (run "
                "`python -m workers.model.prepare` for SmolLM2)")
    try:
        report = run(cfg)
    except Exception:
        traceback.print_exc()
        return 1
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report["png"] = "afd.png" if plot(report, out / "afd.png") else None
    (out / "afd.json").write_text(json.dumps(report, indent=2) + "\n")
    print(report["verdict"])
    failed = json.dumps(report["errors"] + report["token_mismatches"])
    print(f"wrote {out / 'afd.json'} in {report['wall_s']:.1f} s; "
          f"{'ok' if report['ok'] else 'FAILED: ' + failed}")
    return 0 if report["ok"] else 1


def entry() -> None:
    """Process entry: :func:`main` through :func:`bench.process.run_and_exit`."""
    run_and_exit(main)


if __name__ == "__main__":
    entry()
