"""Dynamo's offline replay (``dynamo.replay.run_trace_replay``) on the same trace, side by
side with ours. Optional: Dynamo is not a requirement of kvmesh.

Contract:

- :func:`dynamo_python()` is the interpreter that runs Dynamo: ``$KVMESH_DYNAMO_PYTHON``,
  else ``.dynvenv/bin/python`` when it exists (the venv
  :func:`bench.frontend_vs_dynamo.dynamo_side.ensure_dynvenv` installs: Dynamo 1.6.1
  with its own pydantic pin), else this interpreter.
- :func:`dynamo_status()` returns None when ``dynamo.replay`` can be imported by
  :func:`dynamo_python` (in a subprocess, so a broken install cannot take the bench
  down), else a one-line reason.
- :func:`run_dynamo(trace_path, router_mode, speedup, cfg, ...)` runs one replay in a
  subprocess of :func:`dynamo_python` (:data:`RUNNER`, which imports nothing of
  kvmesh) with a timeout, with every
  ``DYN_*_HOST`` set to 127.0.0.1, and returns ``(results, info)``: one
  :class:`bench.replay.stats.Result` per request rebuilt from Dynamo's per-request
  records (TTFT, E2E, output and reused tokens; ``completion_tokens`` = generated
  tokens, so :attr:`Result.tpot_s` is Dynamo's per-request mean ITL), and ``info`` with
  Dynamo's own summary numbers (``goodput_completed_requests``, prefix reuse, wall time).
  Raises :class:`DynamoError` (with stderr's tail) when the subprocess fails or times out.
  ``cfg`` supplies the engine (block size, blocks, batch limits, speedup ratio), SLOs,
  trace block size and the worker count (aggregated: ``num_workers`` and
  ``extra_engine_args``; P/D: ``num_prefill_workers``/``num_decode_workers`` and
  ``prefill_engine_args``/``decode_engine_args`` with ``worker_type`` prefill/decode and
  the P→D link of ``cfg``: ``kv_transfer_bandwidth`` in GB/s and
  ``kv_transfer_bytes_per_token``), built by :func:`replay_kwargs`.
- :data:`RUNNER` (also what running this module does) reads one JSON object of keyword
  arguments for ``run_trace_replay`` on stdin and prints ``{"summary", "per_request"}``
  on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.offline.config import SimConfig
from bench.replay.stats import Result

HOST_VARS = ("DYN_HTTP_HOST", "DYN_SYSTEM_HOST", "DYN_TCP_RPC_HOST", "DYN_METRICS_HOST",
             "DYN_HEALTH_CHECK_HOST", "DYN_NATS_HOST", "DYN_ETCD_HOST", "DYN_KVBM_HOST")
_KEEP = ("ttft_ms", "e2e_latency_ms", "itl_ms", "input_length", "output_length",
         "reused_input_tokens", "arrival_time_ms", "terminal_status")


ROOT = Path(__file__).resolve().parents[2]
RUNNER = f"""
import json, sys
from dynamo.replay import run_trace_replay
kw = json.loads(sys.stdin.read())
files = kw.pop("trace_files")
report = run_trace_replay(files, **kw)
keep = {_KEEP!r}
per = [{{k: r.get(k) for k in keep}} for r in (report.per_request or [])]
sys.stdout.write("\\n" + json.dumps({{"summary": dict(report.summary),
                                    "per_request": per}}, default=str) + "\\n")
"""


class DynamoError(RuntimeError):
    """Dynamo's replay could not run."""


def dynamo_python() -> str:
    """See the module docstring."""
    env = os.environ.get("KVMESH_DYNAMO_PYTHON")
    if env:
        return env
    venv = ROOT / ".dynvenv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("DYN_") and k.endswith("_HOST"):
            env[k] = "127.0.0.1"
    for k in HOST_VARS:
        env[k] = "127.0.0.1"
    env.pop("PYTHONPATH", None)  # the Dynamo interpreter's own packages only
    return env


def dynamo_status(timeout_s: float = 60.0) -> str | None:
    """None when ``dynamo.replay`` imports; else why not."""
    try:
        p = subprocess.run([dynamo_python(), "-c", "import dynamo.replay"], env=_env(),
                           capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run the Dynamo import check: {exc}"
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["unknown error"])[-1]
        return f"dynamo.replay is not importable: {tail}"
    return None


def replay_kwargs(trace_path: str, router_mode: str, speedup: float,
                  cfg: SimConfig) -> dict[str, Any]:
    """The ``run_trace_replay`` keyword arguments for our config."""
    engine = {"block_size": cfg.block_size, "num_gpu_blocks": cfg.num_blocks,
              "speedup_ratio": cfg.engine_speedup, "max_num_seqs": cfg.max_num_seqs,
              "max_num_batched_tokens": cfg.max_num_batched_tokens}
    kw: dict[str, Any] = {
        "trace_files": [trace_path], "trace_format": "mooncake",
        "trace_block_size": cfg.trace_block_size, "router_mode": router_mode,
        "arrival_speedup_ratio": speedup, "sla_ttft_ms": cfg.slo_ttft_s * 1000.0,
        "sla_itl_ms": cfg.slo_itl_s * 1000.0, "capture_per_request": True,
        "extra_engine_args": {"engine": engine},
    }
    if cfg.disaggregated:  # Dynamo's disagg replay: one engine config per role
        del kw["extra_engine_args"]
        link = {"kv_transfer_bandwidth": cfg.transfer_bandwidth / 1e9,  # GB/s
                "kv_transfer_bytes_per_token": cfg.kv_bytes_per_token}
        kw["prefill_engine_args"] = {"engine": {**engine, **link, "worker_type": "prefill"}}
        kw["decode_engine_args"] = {"engine": {**engine, **link, "worker_type": "decode"}}
        kw["num_prefill_workers"] = cfg.prefill_workers
        kw["num_decode_workers"] = cfg.decode_workers
    else:
        kw["num_workers"] = cfg.workers
    if cfg.event_delay_s > 0:
        kw["kv_event_lag_ms"] = cfg.event_delay_s * 1000.0
    return kw


def run_dynamo(trace_path: str, router_mode: str, speedup: float, cfg: SimConfig,
               timeout_s: float = 600.0) -> tuple[list[Result], dict[str, Any]]:
    """One Dynamo replay in a subprocess; see the module docstring."""
    kw = replay_kwargs(trace_path, router_mode, speedup, cfg)
    try:
        p = subprocess.run([dynamo_python(), "-c", RUNNER], env=_env(),
                           input=json.dumps(kw), capture_output=True, text=True,
                           timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DynamoError(f"Dynamo replay timed out after {timeout_s:g} s") from exc
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-5:])
        raise DynamoError(f"Dynamo replay failed (exit {p.returncode}): {tail}")
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DynamoError(f"Dynamo replay printed no result: {exc}") from exc
    results = []
    for i, r in enumerate(out["per_request"]):
        ok = r.get("terminal_status") == "completed" and r.get("ttft_ms") is not None
        res = Result(i, float(r.get("arrival_time_ms") or 0.0) / 1000.0,
                     status="ok" if ok else "error",
                     prompt_tokens=int(r.get("input_length") or 0),
                     cached_tokens=int(r.get("reused_input_tokens") or 0),
                     completion_tokens=int(r.get("output_length") or 0))
        if ok:
            res.ttft_s = float(r["ttft_ms"]) / 1000.0
            res.e2e_s = float(r["e2e_latency_ms"]) / 1000.0
        results.append(res)
    s = out["summary"]
    info = {k: s.get(k) for k in ("goodput_completed_requests", "completed_requests",
                                  "num_requests", "prefix_cache_reused_ratio",
                                  "wall_time_ms", "duration_ms", "mean_ttft_ms",
                                  "mean_itl_ms")}
    return results, info


if __name__ == "__main__":  # pragma: no cover
    exec(RUNNER)
