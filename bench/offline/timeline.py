"""Per-interval timeline of one offline replay (``python -m bench.offline --timeline X``).

What a capacity number hides: where the queues build up, which worker's KV fills, when
preemptions start and how the router splits requests between remote and local prefill,
over virtual time, per worker and role.

Contract:

- :class:`TimelineRecorder` is a :class:`bench.offline.sim.Simulation` ``on_tick`` hook.
  Every ``interval_s`` virtual seconds it samples, per worker (id, role): waiting
  requests (queued, not yet running), running requests, requests receiving KV, KV usage
  (used / total blocks), the router's pending prefill tokens, and the preemptions,
  prefill tokens and steps since the previous sample; and, for the whole system, the
  requests routed since then, how many were disaggregated (remote prefill on P), how many
  a P served whole (``--prefill-whole``), and how many were rejected. Samples only read
  the simulation.
- :func:`run_timeline(trace, cfg, interval_s)` runs one simulation with the recorder and
  returns a JSON-able dict: ``config`` (the label), ``speedup``, ``interval_s``,
  ``workers`` ({id: role}), ``samples`` (one per tick: ``t``, ``routed``,
  ``disaggregated``, ``whole``, ``rejected`` and ``workers``: {id: {``waiting``, ``running``,
  ``receiving``, ``kv_usage``, ``pending_prefill``, ``preemptions``,
  ``prefill_tokens``, ``steps``}}), ``slo_by_arrival`` (per interval of arrival time:
  requests, share meeting both SLOs, share missing the TTFT SLO, share missing the ITL
  SLO) and ``counters`` (the run's totals).
- :func:`plot_timeline(path, data)` draws it as a PNG: waiting queue per worker, KV usage
  per worker, preemptions per interval per worker, remote vs local prefills (and requests
  served whole on P) per interval, SLO shares by arrival interval (P workers dashed, D
  solid, agg dotted).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.offline.config import SimConfig
from bench.offline.sim import Simulation
from bench.replay.trace import TraceRequest

ROLE_STYLE = {"prefill": "--", "decode": "-", "agg": ":"}


class TimelineRecorder:
    """See the module docstring."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self._last: dict[str, tuple[int, int, int]] = {}
        self._last_routed = (0, 0, 0, 0)

    def __call__(self, sim: Simulation) -> None:
        pending = sim.router.pending_prefill()
        workers: dict[str, dict[str, Any]] = {}
        for wid, w in sim.workers.items():
            s = w.sched
            c = s.counters
            now = (c["preemptions"], c["prefill_tokens"], c["steps"])
            before = self._last.get(wid, (0, 0, 0))
            self._last[wid] = now
            workers[wid] = {
                "waiting": len(s.waiting), "running": len(s.running),
                "receiving": len(s.receiving), "kv_usage": round(s.blocks.usage, 4),
                "pending_prefill": pending.get(wid, 0),
                "preemptions": now[0] - before[0], "prefill_tokens": now[1] - before[1],
                "steps": now[2] - before[2],
            }
        routed = sum(1 for tr in sim.tracks if tr.arrival <= sim.now)
        cnt = sim.counters
        totals = (routed, cnt["routed_disaggregated"], cnt["rejected"],
                  cnt["served_whole_on_prefill"])
        prev = self._last_routed
        self._last_routed = totals
        self.samples.append({"t": round(sim.now, 3), "routed": totals[0] - prev[0],
                             "disaggregated": totals[1] - prev[1],
                             "rejected": totals[2] - prev[2],
                             "whole": totals[3] - prev[3], "workers": workers})


def slo_by_arrival(sim: Simulation, interval_s: float) -> list[dict[str, Any]]:
    """Per arrival interval: requests and the shares meeting / missing the SLOs."""
    cfg = sim.cfg
    bins: dict[int, list[int]] = {}
    for tr in sim.tracks:
        k = int(tr.arrival // interval_s)
        b = bins.setdefault(k, [0, 0, 0, 0])  # requests, good, ttft miss, itl miss
        b[0] += 1
        if tr.status != "ok" or tr.first_token is None or tr.last_token is None:
            continue
        ttft = tr.first_token - tr.arrival
        itl = ((tr.last_token - tr.first_token) / (tr.n_out - 1)) if tr.n_out > 1 else 0.0
        bad_t, bad_i = ttft > cfg.slo_ttft_s, itl > cfg.slo_itl_s
        b[1] += int(tr.done and not bad_t and not bad_i)
        b[2] += int(bad_t)
        b[3] += int(bad_i)
    return [{"t": k * interval_s, "requests": b[0], "slo_share": b[1] / b[0],
             "ttft_miss_share": b[2] / b[0], "itl_miss_share": b[3] / b[0]}
            for k, b in sorted(bins.items())]


def run_timeline(trace: Sequence[TraceRequest], cfg: SimConfig,
                 interval_s: float = 5.0) -> dict[str, Any]:
    """One simulation with a :class:`TimelineRecorder`; see the module docstring."""
    if not interval_s > 0:
        raise ValueError("interval_s must be > 0")
    rec = TimelineRecorder()
    sim = Simulation(trace, cfg, on_tick=rec, tick_s=interval_s)
    run = sim.run()
    return {
        "config": cfg.label(), "speedup": cfg.speedup, "interval_s": interval_s,
        "workers": {wid: w.record.role for wid, w in sim.workers.items()},
        "samples": rec.samples, "slo_by_arrival": slo_by_arrival(sim, interval_s),
        "counters": {k: v for k, v in run.counters.items() if k != "worker_busy_s"},
    }


def plot_timeline(path: Path, data: dict[str, Any]) -> None:
    """See the module docstring."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = data["samples"]
    ts = [s["t"] for s in samples]
    fig, axes = plt.subplots(5, 1, figsize=(12, 15), sharex=True)
    qa, ka, pa, ra, sa = axes
    for wid, role in sorted(data["workers"].items()):
        style = ROLE_STYLE.get(role, "-")
        col = [s["workers"][wid] for s in samples]
        qa.plot(ts, [c["waiting"] + c["receiving"] for c in col], style, lw=1, label=wid)
        ka.plot(ts, [c["kv_usage"] for c in col], style, lw=1, label=wid)
        pa.plot(ts, [c["preemptions"] for c in col], style, lw=1, label=wid)
    qa.set_ylabel("waiting + receiving requests")
    ka.set_ylabel("KV usage (used / total blocks)")
    ka.set_ylim(0, 1.02)
    pa.set_ylabel(f"preemptions per {data['interval_s']:g} s")
    for ax in (qa, ka, pa):
        ax.legend(fontsize=6, ncol=4, loc="upper left")
    routed = [s["routed"] for s in samples]
    remote = [s["disaggregated"] for s in samples]
    ra.plot(ts, routed, label="routed")
    ra.plot(ts, remote, label="remote prefill (P then D)")
    whole = [s.get("whole", 0) for s in samples]  # older timelines lack it
    ra.plot(ts, [r - d - w - s["rejected"] for r, d, w, s in zip(routed, remote, whole,
                                                                 samples, strict=True)],
            label="local prefill (D or agg alone)")
    if any(whole):
        ra.plot(ts, whole, label="served whole on P (--prefill-whole)")
    ra.set_ylabel(f"requests per {data['interval_s']:g} s")
    ra.legend(fontsize=7)
    slo = data["slo_by_arrival"]
    st = [b["t"] for b in slo]
    sa.plot(st, [b["slo_share"] for b in slo], label="meet both SLOs")
    sa.plot(st, [b["ttft_miss_share"] for b in slo], label="miss TTFT")
    sa.plot(st, [b["itl_miss_share"] for b in slo], label="miss ITL")
    sa.set_ylim(0, 1.02)
    sa.set_ylabel("share (by arrival interval)")
    sa.set_xlabel("virtual time (s)")
    sa.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Offline replay timeline: {data['config']} at x{data['speedup']:g} "
                 "(P dashed, D solid, agg dotted)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
