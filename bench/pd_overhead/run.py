"""What P/D disaggregation costs in TTFT, against the raw NIXL time of moving the KV.

``python -m bench.pd_overhead [--model smollm2] [--lengths 128,256,512,1024,2048] [--reps 3]
[--modes agg,pull,push,toy] [--out bench/results]``

Contracts:

- Transfer anchor (first, while no mesh runs): the KV of ``L`` tokens is ``L ·
  num_hidden_layers · num_key_value_heads · head_dim · 2 (K, V) · 4 B`` (float32; from the
  model folder's ``config.json``, ``head_dim`` defaulting to hidden_size /
  num_attention_heads). ``bench.transfer.run.run_benchmark`` measures NIXL READ GB/s at
  exactly those sizes in a child process (NIXL may crash at exit, so it is isolated and
  ends with ``os._exit``); ``raw_transfer_s = kv_bytes / median READ B/s``.
- Modes, one whole ``services.launcher.up.LocalMesh`` at a time, on free loopback ports
  (``--max-model-len``, default 4096, 1 GiB KV cache per worker): ``agg`` (one aggregated worker),
  ``pull`` and ``push`` (one prefill + one decode worker with that NIXL handoff; in
  ``pull`` P's sampled token is the first token and D continues after it),
  ``pull_recompute`` (``pull`` with ``--first-token-from-prefill false``: D recomputes the
  last prompt token and generates every token, as behind vLLM's proxy); ``toy``
  is the anchor with no kvmesh in the path: two plain vLLM OpenAI servers with the same
  engine and pull-mode KV config and a minimal proxy in this process, as vLLM's own
  NIXL P/D toy proxy drives them (:mod:`bench.pd_overhead.toy`).
- Stages: the engines run with ``KVMESH_PD_STAMPS`` = a folder of the mode's, so
  :mod:`workers.kv.nixl_quiet` stamps each handoff's stages in P's and D's EngineCore and
  every kvmesh vLLM worker its engine's TTFT (agg included); every sample (warm-up
  included) gets its ``stages`` (points after the send and segments,
  :mod:`bench.pd_overhead.stages`) and each length ``stages_median_s``, ``engine_ttft_s``
  (vLLM's own TTFT in the engine whose token goes out first: P's, or agg's) and
  ``mesh_share_s`` (client TTFT minus that, per request): the second is what the mesh
  adds, so ``mesh_share(pull) − mesh_share(agg)`` is disaggregation's cost in TTFT with
  each engine's prefill time taken out (P's and agg's prefill of the same prompt differ
  by ±10 % between two fresh engines, more than that cost).
- Per length: one warm-up request, then ``--reps`` timed ones (see
  :mod:`bench.pd_overhead.client`): streaming ``/v1/completions`` with a prompt of exactly
  ``L`` random token ids, fresh for every request so no prefix cache can hit, and the same
  sequence of prompts in every mode (one seed; each mode starts fresh engines) (checked per
  length in ``cache_check``: agg's ``usage.prompt_tokens_details.cached_tokens`` must be 0;
  in pull and toy, P's hit counter must not move, because D's usage counts the KV it
  received),
  ``max_tokens`` 8, ``temperature`` 0, ``ignore_eos``. TTFT is client-side, to the first
  chunk with text. The frontend's ``/metrics`` is read before and after the timed
  requests; the deltas give the mean ``kvmesh_kv_transfer_seconds`` and
  ``kvmesh_prefill_seconds`` per request and the number of requests that took the
  disaggregated path.
- A failing mode (mesh does not start, a request errors or times out) gets its error text,
  with the tails of the mesh's logs, in the JSON; the benchmark goes on with the other
  modes. Nothing is filled in for what was not measured. Every mesh is stopped by PID.
- Writes ``<out>/pd_overhead.json`` and ``<out>/pd_overhead.png``; prints the table.
  Exit code 0 iff every requested mode and the anchor produced results without errors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from bench.pd_overhead.client import (
    Sample,
    fetch_metrics,
    metric_delta,
    served_model,
    stream_completion,
)
from bench.pd_overhead.report import (
    engine_free_table,
    plot,
    second_token_table,
    stage_table,
    stats,
    summary_rows,
    table,
)
from bench.pd_overhead.stages import (
    load_stamps,
    mesh_share,
    request_points,
    segment_medians,
    segments,
)
from bench.pd_overhead.toy import ToyPD
from services.launcher.up import LocalMesh, MeshSpec
from workers.kv.stamps import STAMPS_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = ("agg", "pull", "pull_recompute", "push", "toy")
# Frontend settings per mode, inherited by the mesh's processes at their spawn: in
# pull_recompute D generates every token (P's sampled token is dropped, as vLLM's proxy does)
MODE_ENV = {"pull_recompute": {"KVMESH_FIRST_TOKEN_FROM_PREFILL": "false"}}
METRIC_PREFIXES = ("kvmesh_kv_transfer_seconds", "kvmesh_prefill_seconds",
                   "kvmesh_ttft_seconds", "kvmesh_requests_total",
                   "kvmesh_kv_transfer_blocks_total", "kvmesh_prefill_hit_tokens_total",
                   "kvmesh_decode_hit_tokens_total", "kvmesh_actual_cached_tokens_total")
FLOAT32_BYTES = 4
_ANCHOR_CHILD = """
import json, os, sys, traceback
code = 1
try:
    from bench.transfer.run import run_benchmark
    rep = run_benchmark(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                        "tcp,self,sm", "none")
    with open(sys.argv[4], "w") as f:
        json.dump(rep, f)
    code = 0
except BaseException:
    traceback.print_exc()
finally:
    sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
"""


def model_geometry(model_dir: Path) -> dict[str, Any]:
    """KV geometry from ``config.json``: layers, KV heads, head_dim, bytes per token."""
    cfg = json.loads((model_dir / "config.json").read_text())
    layers, kv_heads = int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return {"name": model_dir.name, "path": str(model_dir), "num_hidden_layers": layers,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "config_head_dim": cfg.get("head_dim"), "vocab_size": int(cfg["vocab_size"]),
            "dtype_bytes": FLOAT32_BYTES,
            "kv_bytes_per_token": layers * kv_heads * head_dim * 2 * FLOAT32_BYTES}


def measure_anchor(lengths: list[int], bytes_per_token: int, iters: int,
                   timeout_s: float = 300.0) -> dict[str, Any]:
    """NIXL READ GB/s at each length's KV size (child process); see the module docstring."""
    sizes = sorted({n * bytes_per_token for n in lengths})
    out: dict[str, Any] = {"method": "bench.transfer.run.run_benchmark in a child process",
                           "ucx_tls": "tcp,self,sm", "ucx_error_handling_mode": "none",
                           "iters": iters, "warmup": 3, "error": None, "by_length": {}}
    with tempfile.TemporaryDirectory(prefix="pd-anchor-") as tmp:
        dest = Path(tmp) / "transfer.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", _ANCHOR_CHILD, json.dumps(sizes), str(iters), "3",
             str(dest)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own group: it and its peer
            log, _ = proc.communicate()
        text = log.decode(errors="replace")
        if proc.returncode != 0 or not dest.exists():
            out["error"] = f"anchor child exited {proc.returncode}:\n{text[-3000:]}"
            return out
        rep = json.loads(dest.read_text())
    by_size = {r["size_bytes"]: r for r in rep["results"]}
    out.update(all_verified=rep["all_verified"], setup_s=rep["setup_s"], wall_s=rep["wall_s"],
               versions=rep["versions"], loadavg=rep["host"]["loadavg_before"])
    for n in lengths:
        r = by_size[n * bytes_per_token]
        bw = r["read_gbps"]
        out["by_length"][str(n)] = {
            "kv_bytes": r["size_bytes"], "read_gbps": bw, "memcpy_gbps": r["memcpy_gbps"],
            "verified": r["verified"],
            "raw_transfer_s": r["size_bytes"] / (bw["median"] * 1e9)}
    return out


def _log_tails(mesh: LocalMesh | ToyPD, lines: int = 25) -> dict[str, str]:
    return {c.name: (("" if c.alive() else f"[exited {c.proc.returncode}]\n")
                     + c.log_tail(lines))
            for c in mesh.children if c.name not in ("etcd", "redis")}


def _dead(mesh: LocalMesh | ToyPD) -> list[str]:
    return [f"{c.name} ({c.proc.returncode})" for c in mesh.children if not c.alive()]


def _cache_check(mode: str, length: int, ok: list[Sample],
                 delta: dict[str, float]) -> dict[str, Any]:
    """Did any prompt hit a prefix cache? ``usage.cached_tokens`` answers it for agg. In
    P/D modes usage comes from D, whose vLLM counts the tokens it received over NIXL as
    cached (so it is ``length`` there); P's hits are the frontend's P-hit counter (pull;
    push does not report P's usage)."""
    cached = [s.cached_tokens for s in ok]
    p_hits = delta.get("kvmesh_prefill_hit_tokens_total{}", 0.0)
    if mode == "agg":
        passed: bool | None = all(c == 0 for c in cached)
        how = "usage.prompt_tokens_details.cached_tokens == 0"
    elif mode in ("pull", "pull_recompute", "toy"):
        passed = p_hits == 0 and all(c is not None and c <= length for c in cached)
        how = ("toy proxy's" if mode == "toy" else "frontend") + \
            " kvmesh_prefill_hit_tokens_total delta == 0 (P); D's usage counts " \
            "NIXL-received tokens as cached"
    else:
        passed = None
        how = "not observable (P's usage is not reported in push); prompts are random"
    return {"usage_cached_tokens": cached, "p_hit_tokens": p_hits, "no_prefix_hits": passed,
            "how": how}


def _with_stages(samples: list[Sample], stamps_dir: Path | None) -> list[dict[str, Any]]:
    """Each sample's dict, with its ``stages`` when the engines stamp them."""
    out = [s.as_dict() for s in samples]
    if stamps_dir is None:
        return out
    stamps = load_stamps(stamps_dir)
    for s, d in zip(samples, out, strict=True):
        if s.sent_wall is None or s.error:
            continue
        first = s.sent_wall + s.ttft_s if s.ttft_s is not None else None
        done = s.sent_wall + (s.total_s if s.total_s is not None else 1e9)
        points = request_points(stamps, s.sent_wall, first, done)
        d["stages"] = {"points_s": points, "segments_s": segments(points)}
    return out


def run_length(url: str, model: str, length: int, mode: str, args: argparse.Namespace,
               rng: np.random.Generator, vocab: int,
               stamps_dir: Path | None = None) -> dict[str, Any]:
    """Warm-up + ``args.reps`` timed requests of ``length`` tokens; stats, metric deltas
    and (``stamps_dir``) each request's stages."""

    def one(timeout_s: float) -> Sample:
        ids = rng.integers(args.min_token_id, vocab, size=length).tolist()
        return stream_completion(url, model, ids, args.max_tokens, timeout_s)

    res: dict[str, Any] = {"error": None}
    warm = one(args.warmup_timeout)  # the first handoff of a mesh also wires NIXL up
    res["warmup"] = _with_stages([warm], stamps_dir)[0]
    if warm.error:
        res["error"] = f"warm-up request failed: {warm.error}"
        return res
    before = fetch_metrics(url)
    samples: list[Sample] = []
    for _ in range(args.reps):
        s = one(args.request_timeout)
        samples.append(s)
        if s.error:
            res["error"] = f"request {len(samples)} of {args.reps} failed: {s.error}"
            break
    after = fetch_metrics(url)
    ok = [s for s in samples if not s.error]
    res["samples"] = _with_stages(samples, stamps_dir)
    if stamps_dir is not None:
        res["stages_median_s"] = segment_medians(
            [d["stages"]["segments_s"] for d in res["samples"] if "stages" in d])
        points = [d["stages"]["points_s"] for d in res["samples"] if "stages" in d]
        res["engine_ttft_s"] = stats([p["engine_ttft_s"] for p in points
                                      if p.get("engine_ttft_s") is not None])
        shares = [mesh_share(p) for p in points]
        res["mesh_share_s"] = stats([v for v in shares if v is not None])
    res["ttft_s"] = stats([s.ttft_s for s in ok if s.ttft_s is not None])
    res["second_s"] = stats([s.second_s for s in ok if s.second_s is not None])
    res["first_chunk_s"] = stats([s.first_chunk_s for s in ok if s.first_chunk_s is not None])
    res["total_s"] = stats([s.total_s for s in ok if s.total_s is not None])
    res["no_text_chunks"] = sum(1 for s in ok if s.ttft_s is None)
    res["prompt_tokens_ok"] = all(s.prompt_tokens == length for s in ok)
    delta = metric_delta(before, after, METRIC_PREFIXES)
    res["metrics_delta"] = delta
    res["cache_check"] = _cache_check(mode, length, ok, delta)

    def mean(name: str, label: str) -> float | None:
        n = delta.get(f"{name}_count{{{label}}}")
        return delta[f"{name}_sum{{{label}}}"] / n if n else None

    res["server"] = {
        "kv_transfer_mean_s": mean("kvmesh_kv_transfer_seconds", f"mode={mode}"),
        "prefill_mean_s": mean("kvmesh_prefill_seconds", f"mode={mode}"),
        "disaggregated_requests": sum(v for k, v in delta.items()
                                      if k.startswith("kvmesh_requests_total")
                                      and "path=disagg" in k),
        "frontend_ttft_mean_s": {path: mean("kvmesh_ttft_seconds", f"path={path}")
                                 for path in ("agg", "disagg")},
    }
    return res


def run_mode(mode: str, lengths: list[int], args: argparse.Namespace, vocab: int,
             seed: int) -> dict[str, Any]:
    """One mesh in ``mode``; every length; always stopped. Errors are recorded, not raised."""
    work = Path(tempfile.mkdtemp(prefix=f"pd-overhead-{mode}-"))
    spec = MeshSpec(model=args.model, http_port=0, mode="agg" if mode == "agg" else "disagg",
                    handoff=mode if mode == "push" else "pull",
                    max_model_len=args.max_model_len,
                    kv_cache_gib=1.0, log_dir=work / "logs",
                    start_timeout_s=args.start_timeout)
    out: dict[str, Any] = {"mode": mode, "error": None, "log_dir": str(spec.log_dir),
                           "mesh": {"mode": spec.mode, "handoff": spec.handoff
                                    if spec.mode == "disagg" else None,
                                    "max_model_len": spec.max_model_len,
                                    "kv_cache_gib": spec.kv_cache_gib,
                                    "block_size": spec.block_size}, "lengths": {}}
    mesh: LocalMesh | ToyPD
    if mode == "toy":
        from workers.main import resolve_model_path

        path = resolve_model_path(args.model)
        mesh = ToyPD(path, Path(path).name, spec.log_dir, max_model_len=spec.max_model_len,
                     kv_cache_gib=spec.kv_cache_gib, block_size=spec.block_size,
                     start_timeout_s=args.start_timeout,
                     request_timeout_s=args.request_timeout)
        out["mesh"] = {"mode": "toy: two vLLM OpenAI servers + proxy (bench.pd_overhead.toy)",
                       "handoff": "pull", "max_model_len": spec.max_model_len,
                       "kv_cache_gib": spec.kv_cache_gib, "block_size": spec.block_size}
    else:
        mesh = LocalMesh(spec)
    stamps_dir = work / "stamps"
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    try:
        try:
            env = dict(MODE_ENV.get(mode, {}))
            if stamps_dir is not None:
                env[STAMPS_ENV] = str(stamps_dir)
            previous = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # inherited by the mesh's processes at their spawn
            try:
                url = mesh.start()
            finally:
                for k, v in previous.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            if mode == "toy":
                out["mesh"]["kv_transfer_config"] = mesh.kv_configs  # type: ignore[union-attr]
                out["mesh"]["pids"] = [c.pid for c in mesh.children]
        except Exception as exc:
            out["error"] = f"mesh failed to start: {type(exc).__name__}: {exc}"
            out["log_tails"] = _log_tails(mesh)
            return out
        out["start_s"] = time.perf_counter() - t0
        out["url"] = url
        print(f"[{mode}] mesh up at {url} in {out['start_s']:.1f} s", file=sys.stderr,
              flush=True)
        model = served_model(url)
        out["served_model"] = model
        for n in lengths:
            t1 = time.perf_counter()
            res = run_length(url, model, n, mode, args, rng, vocab, stamps_dir)
            res["wall_s"] = time.perf_counter() - t1
            out["lengths"][str(n)] = res
            med = (res.get("ttft_s") or {}).get("median")
            print(f"[{mode}] L={n}: ttft median "
                  f"{'-' if med is None else f'{med * 1e3:.1f} ms'}"
                  f"{'; ERROR ' + res['error'] if res['error'] else ''}",
                  file=sys.stderr, flush=True)
            if res["error"]:
                dead = _dead(mesh)
                out["error"] = (f"L={n}: {res['error']}"
                                + (f"; dead children: {', '.join(dead)}" if dead else ""))
                out["log_tails"] = _log_tails(mesh)
                break  # a hung or broken handoff would only burn the time budget
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        out["log_tails"] = _log_tails(mesh)
    finally:
        mesh.stop()
        out["wall_s"] = time.perf_counter() - t0
        if out["error"] is None:
            shutil.rmtree(work, ignore_errors=True)
            out["log_dir"] = None
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.pd_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny or a model folder")
    p.add_argument("--lengths", default="128,256,512,1024,2048", help="prompt lengths")
    p.add_argument("--reps", type=int, default=3, help="timed requests per length and mode")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ",".join(MODES))
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="every engine's max_model_len (the tiny model's limit is 2048)")
    p.add_argument("--anchor-iters", type=int, default=10, help="NIXL READs per size")
    p.add_argument("--request-timeout", type=float, default=150.0,
                   help="seconds per timed request (above the frontend's 120 s push timeout)")
    p.add_argument("--warmup-timeout", type=float, default=240.0,
                   help="seconds for each length's warm-up request")
    p.add_argument("--start-timeout", type=float, default=420.0, help="seconds per mesh start")
    p.add_argument("--min-token-id", type=int, default=100,
                   help="random prompt ids are drawn from [this, vocab_size)")
    p.add_argument("--seed", type=int, default=20240601)
    args = p.parse_args(argv)
    args.length_list = _ints(args.lengths)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    limit = args.max_model_len - args.max_tokens
    if not args.length_list or min(args.length_list) < 1 or max(args.length_list) > limit:
        p.error(f"--lengths must be in [1, {limit}] (--max-model-len - --max-tokens)")
    if unknown := set(args.mode_list) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; known: {MODES}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run everything, print the table, write the JSON and PNG."""
    args = parse_args(argv)
    from workers.main import resolve_model_path

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    geo = model_geometry(Path(resolve_model_path(args.model)))
    print(f"model {geo['name']}: {geo['kv_bytes_per_token']} B of KV per token; "
          "measuring NIXL READ at each length's KV size...", file=sys.stderr, flush=True)
    anchor = measure_anchor(args.length_list, geo["kv_bytes_per_token"], args.anchor_iters)
    if anchor["error"]:
        print(f"anchor FAILED: {anchor['error']}", file=sys.stderr, flush=True)
    modes: dict[str, dict[str, Any]] = {}
    for mode in args.mode_list:  # the same prompts in every mode (fresh engines each)
        modes[mode] = run_mode(mode, args.length_list, args, geo["vocab_size"], args.seed)
        if modes[mode]["error"]:
            print(f"[{mode}] FAILED: {modes[mode]['error'][:1500]}", file=sys.stderr,
                  flush=True)
    rows = summary_rows(args.length_list, modes, anchor)
    report: dict[str, Any] = {
        "schema": "kvmesh.bench.pd_overhead/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "config": {"model": args.model, "lengths": args.length_list, "reps": args.reps,
                   "warmup_per_length": 1, "modes": args.mode_list,
                   "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                   "prompt": f"random token ids in [{args.min_token_id}, vocab), fresh per "
                             "request", "seed": args.seed,
                   "ttft": "client: request sent -> first SSE chunk with non-empty text",
                   "second_s": "client: request sent -> second SSE chunk with text",
                   "overhead": "median TTFT(mode) - median TTFT(agg)",
                   "raw_transfer": "L * kv_bytes_per_token / median NIXL READ B/s"},
        "model": geo, "transfer_anchor": anchor, "modes": modes, "summary": rows,
        "errors": {k: v["error"] for k, v in modes.items() if v["error"]}
                  | ({"anchor": anchor["error"]} if anchor["error"] else {}),
        "wall_s": time.perf_counter() - t0,
    }
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report["png"] = "pd_overhead.png" if plot(report, out / "pd_overhead.png") else None
    (out / "pd_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows, args.mode_list))
    print(engine_free_table(rows, args.mode_list))
    print(stage_table(args.length_list, modes))
    print(second_token_table(args.length_list, modes))
    for name, err in report["errors"].items():
        print(f"{name} FAILED: {err.splitlines()[0] if err else err}")
    print(f"wrote {out / 'pd_overhead.json'} in {report['wall_s']:.0f} s")
    return 0 if not report["errors"] else 1


def entry() -> None:
    """Process entry: :func:`main`; meshes are stopped on the way out, even on Ctrl-C or
    SIGTERM."""
    def _interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)  # so every mesh is still stopped by PID
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
