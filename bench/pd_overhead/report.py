"""Statistics, the summary rows, the text table and the PNG of the P/D overhead benchmark.

Contracts:

- :func:`stats` gives median/p10/p90/mean/n of a list of seconds (None when empty).
- :func:`summary_rows` joins the per-mode results and the transfer anchor into one row per
  prompt length: TTFT median and p90 per mode, ``overhead_s[mode] = median TTFT(mode) −
  median TTFT(agg)``, the raw transfer time of that length's KV at the measured NIXL READ
  bandwidth, ``ratio[mode] = overhead / raw``, and the frontend's own mean
  ``kvmesh_kv_transfer_seconds`` / ``kvmesh_prefill_seconds`` per request; and with
  engine stamps, ``mesh_share_s[mode]`` (median of client TTFT minus the first engine's
  own TTFT, :func:`bench.pd_overhead.stages.mesh_share`), ``engine_free_overhead_s[mode]
  = mesh_share(mode) − mesh_share(agg)`` (disaggregation's cost with each engine's own
  prefill time taken out), ``goal_s`` = 1.2 × raw + 5 ms (issue 18's bound) and
  ``meets_goal[mode]``. A value that could not be measured (failed mode, missing anchor)
  is None, never a guess.
- :func:`table` renders the rows as plain text, :func:`engine_free_table` the
  engine-free columns; :func:`stage_table` the per-length stage
  medians of each disaggregated mode (``stages_median_s``, :mod:`bench.pd_overhead.stages`);
  :func:`plot` writes the PNG (TTFT vs length per mode; overhead vs raw transfer time;
  the stage medians as one stacked bar per length and mode, P's prefill left out and
  written on top; with P's prefill it sums to that mode's median TTFT only as far as
  the medians do) and returns False when matplotlib is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.pd_overhead.stages import SEGMENTS

DISAGG = ("pull", "pull_recompute", "push", "toy")


def stats(values: list[float]) -> dict[str, float] | None:
    """median/p10/p90/mean/n of ``values`` (None when empty)."""
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    p10, med, p90 = np.percentile(arr, [10, 50, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90),
            "mean": float(arr.mean()), "n": int(arr.size)}


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def summary_rows(lengths: list[int], modes: dict[str, dict[str, Any]],
                 anchor: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per length (see the module docstring)."""
    rows = []
    for length in lengths:
        key = str(length)
        med = {m: _get(r, "lengths", key, "ttft_s", "median") for m, r in modes.items()}
        p90 = {m: _get(r, "lengths", key, "ttft_s", "p90") for m, r in modes.items()}
        raw = _get(anchor, "by_length", key, "raw_transfer_s")
        overhead: dict[str, float | None] = {}
        ratio: dict[str, float | None] = {}
        for m in modes:
            if m == "agg":
                continue
            o = med[m] - med["agg"] if med.get(m) is not None and med.get("agg") is not None \
                else None
            overhead[m] = o
            ratio[m] = o / raw if o is not None and raw else None
        share = {m: _get(r, "lengths", key, "mesh_share_s", "median")
                 for m, r in modes.items()}
        free: dict[str, float | None] = {
            m: share[m] - share["agg"] if share.get(m) is not None
            and share.get("agg") is not None else None for m in modes if m != "agg"}
        goal = 1.2 * raw + 0.005 if raw else None
        rows.append({
            "mesh_share_s": share, "engine_free_overhead_s": free, "goal_s": goal,
            "meets_goal": {m: (v <= goal if v is not None and goal is not None else None)
                           for m, v in free.items()},
            "length": length,
            "kv_bytes": _get(anchor, "by_length", key, "kv_bytes"),
            "read_gbps": _get(anchor, "by_length", key, "read_gbps", "median"),
            "raw_transfer_s": raw,
            "ttft_median_s": med, "ttft_p90_s": p90,
            "overhead_s": overhead, "overhead_over_raw": ratio,
            "server_kv_transfer_mean_s": {
                m: _get(modes[m], "lengths", key, "server", "kv_transfer_mean_s")
                for m in modes if m != "agg"},
            "server_prefill_mean_s": {
                m: _get(modes[m], "lengths", key, "server", "prefill_mean_s")
                for m in modes if m != "agg"},
        })
    return rows


def _ms(v: float | None, width: int = 8) -> str:
    return f"{v * 1e3:{width}.1f}" if v is not None else f"{'-':>{width}}"


def table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    """Plain-text table, times in ms."""
    dis = [m for m in modes if m != "agg"]
    head = f"{'L':>5} {'KV MiB':>7} {'raw ms':>7}"
    for m in modes:
        head += f" {m + ' med':>9} {m + ' p90':>9}"
    for m in dis:
        head += f" {'ovh ' + m:>9} {'ovh/raw':>8} {'srv xfer':>8}"
    lines = [head]
    for r in rows:
        kv = f"{r['kv_bytes'] / 2**20:7.2f}" if r["kv_bytes"] else f"{'-':>7}"
        line = f"{r['length']:>5} {kv} {_ms(r['raw_transfer_s'], 7)}"
        for m in modes:
            line += f" {_ms(r['ttft_median_s'].get(m), 9)} {_ms(r['ttft_p90_s'].get(m), 9)}"
        for m in dis:
            ratio = r["overhead_over_raw"].get(m)
            rs = f"{ratio:8.1f}" if ratio is not None else f"{'-':>8}"
            line += (f" {_ms(r['overhead_s'].get(m), 9)} {rs}"
                     f" {_ms(r['server_kv_transfer_mean_s'].get(m), 8)}")
        lines.append(line)
    return "\n".join(lines)


def engine_free_table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    """Per length: each mode's median mesh share of TTFT (TTFT − the engine's own TTFT),
    disaggregation's engine-free overhead against agg, and the goal (ms)."""
    dis = [m for m in modes if m != "agg"]
    head = (f"{'L':>5} {'raw ms':>7} {'goal ms':>8} "
            + " ".join(f"{'mesh ' + m:>14}" for m in modes)
            + " " + " ".join(f"{'ovh ' + m:>14}" for m in dis))
    lines = [head]
    for r in rows:
        share, free = r.get("mesh_share_s") or {}, r.get("engine_free_overhead_s") or {}
        lines.append(f"{r['length']:>5} {_ms(r['raw_transfer_s'], 7)} {_ms(r.get('goal_s'))} "
                     + " ".join(_ms(share.get(m), 14) for m in modes) + " "
                     + " ".join(_ms(free.get(m), 14) for m in dis))
    return ("TTFT minus the first engine's own TTFT (median ms), and its excess over agg:\n"
            + "\n".join(lines))


def stage_table(lengths: list[int], modes: dict[str, dict[str, Any]]) -> str:
    """Stage medians (ms) per length and disaggregated mode; '' when none were stamped."""
    names = [s[0] for s in SEGMENTS]
    lines = [f"{'L':>5} {'mode':>5} " + " ".join(f"{n:>11}" for n in names)]
    for n in lengths:
        for m, res in modes.items():
            med = _get(res, "lengths", str(n), "stages_median_s")
            if not med:
                continue
            lines.append(f"{n:>5} {m:>5} " + " ".join(_ms(med.get(k), 11) for k in names))
    return "stages (median ms):\n" + "\n".join(lines) if len(lines) > 1 else ""


def second_token_table(lengths: list[int], modes: dict[str, dict[str, Any]]) -> str:
    """Median client time to the first and the second chunk with text (ms), per length
    and mode: what P's token first moves from TTFT to the second token."""
    names = list(modes)
    lines = [f"{'L':>5} " + " ".join(f"{m + ' t1':>17} {m + ' t2':>17}" for m in names)]
    for n in lengths:
        cells = []
        for m in names:
            cells.append(_ms(_get(modes[m], "lengths", str(n), "ttft_s", "median"), 17))
            cells.append(_ms(_get(modes[m], "lengths", str(n), "second_s", "median"), 17))
        lines.append(f"{n:>5} " + " ".join(cells))
    return "time to the 1st (t1) and 2nd (t2) text chunk (median ms):\n" + "\n".join(lines)


P_FIRST = ("p_to_client", "token 1 from P: P's answer to the client (D's stages follow it)")


def ttft_stages(med: dict[str, Any], ttft: float | None) -> dict[str, Any]:
    """The stages of the client's TTFT. When the first token reached the client before
    D's first step (``to_client`` < 0: P's token went out first), TTFT is ``to_p``, P's
    prefill and ``p_to_client`` (TTFT − both; None without a TTFT), and D's stages come
    after it, so they are left out; otherwise ``med`` as it is."""
    if (med.get("to_client") or 0.0) >= 0:
        return med
    to_p, prefill = med.get("to_p") or 0.0, med.get("p_prefill") or 0.0
    return {"to_p": med.get("to_p"), "p_prefill": med.get("p_prefill"),
            P_FIRST[0]: None if ttft is None else ttft - to_p - prefill}


def _stage_bars(ax: Any, report: dict[str, Any]) -> None:
    """Stacked bars of the stages of TTFT (:func:`ttft_stages`), one per (length,
    disaggregated mode)."""
    modes = report["modes"]
    bars: list[tuple[str, dict[str, Any]]] = []
    for r in report["summary"]:
        for m, res in modes.items():
            med = _get(res, "lengths", str(r["length"]), "stages_median_s")
            if med:
                ttft = _get(res, "lengths", str(r["length"]), "ttft_s", "median")
                bars.append((f"{r['length']}\n{m}", ttft_stages(med, ttft)))
    if not bars:
        ax.text(0.5, 0.5, "no stage stamps", ha="center", transform=ax.transAxes)
        return
    x = np.arange(len(bars))
    bottom = np.zeros(len(bars))
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    for i, (name, what) in enumerate([(s[0], s[3]) for s in SEGMENTS] + [P_FIRST]):
        if name == "p_prefill":  # P's compute: it would dwarf the rest; written on top
            continue
        vals = np.array([(med.get(name) or 0.0) * 1e3 for _, med in bars])
        color = "0.25" if name == P_FIRST[0] else cmap(i % 10)
        ax.bar(x, vals, bottom=bottom, color=color, label=f"{name}: {what}")
        bottom += vals
    for xi, top, (_, med) in zip(x, bottom, bars, strict=True):
        ax.annotate(f"+ P prefill {_ms(med.get('p_prefill'), 0).strip()}", (xi, top),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("ms (median of each stage)")
    ax.set_title("TTFT by stage, P's prefill left out (engine stamps)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(0, float(bottom.max()) * 1.9 or 1.0)
    ax.legend(fontsize=6, loc="upper left")


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write the PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        return False
    rows = report["summary"]
    modes: dict[str, dict[str, Any]] = report["modes"]
    lengths = [r["length"] for r in rows]
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(20, 6.5))
    styles = {"agg": "o-", "pull": "s-", "pull_recompute": "v-", "push": "^-", "toy": "d-"}
    colors = {"agg": "C0", "pull": "C1", "pull_recompute": "C4", "push": "C2", "toy": "C3"}
    for m, res in modes.items():
        pts = [(r["length"], r["ttft_median_s"].get(m), r["ttft_p90_s"].get(m)) for r in rows
               if r["ttft_median_s"].get(m) is not None]
        label = m if not res.get("error") else f"{m} (failed: see JSON)"
        if not pts:
            ax.plot([], [], styles.get(m, "o-"), label=f"{m}: no data")
            continue
        x = [p[0] for p in pts]
        medv = [p[1] * 1e3 for p in pts]
        ax.plot(x, medv, styles.get(m, "o-"), color=colors.get(m), label=f"{label} median")
        ax.plot(x, [p[2] * 1e3 for p in pts], ":", color=colors.get(m), alpha=0.7,
                label=f"{m} p90")
    ax.set_xscale("log", base=2)
    if ax.has_data():  # a log axis without positive data fails at layout
        ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("client TTFT (ms)")
    ax.set_title("TTFT per mode (max_tokens 8, no prefix hits)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    raw = [(r["length"], r["raw_transfer_s"]) for r in rows if r["raw_transfer_s"]]
    if raw:
        ax2.plot([p[0] for p in raw], [p[1] * 1e3 for p in raw], "k--",
                 label="raw KV bytes / NIXL READ GB/s")
        ax2.plot([p[0] for p in raw], [(1.2 * p[1] + 0.005) * 1e3 for p in raw], "k:",
                 label="goal: 1.2 × raw + 5 ms")
    for m in (m for m in modes if m != "agg"):
        ovh = [(r["length"], r["overhead_s"].get(m)) for r in rows]
        pos = [(x, y) for x, y in ovh if y is not None and y > 0]
        if pos:
            ax2.plot([p[0] for p in pos], [p[1] * 1e3 for p in pos], styles.get(m, "o-"),
                     color=colors.get(m), label=f"overhead {m} = TTFT({m}) − TTFT(agg)")
        neg = [x for x, y in ovh if y is not None and y <= 0]
        if neg:
            ax2.plot(neg, [0.01] * len(neg), "x", color=colors.get(m),
                     label=f"overhead {m} ≤ 0 (drawn at 0.01)")
        free = [(r["length"], (r.get("engine_free_overhead_s") or {}).get(m)) for r in rows]
        free_pos = [(x, y) for x, y in free if y is not None and y > 0]
        if free_pos:
            ax2.plot([p[0] for p in free_pos], [p[1] * 1e3 for p in free_pos], "--",
                     marker=styles.get(m, "o-")[0], color=colors.get(m), alpha=0.6,
                     label=f"engine-free overhead {m} (each engine's TTFT taken out)")
        srv = [(r["length"], r["server_kv_transfer_mean_s"][m]) for r in rows
               if r["server_kv_transfer_mean_s"].get(m) is not None]
        if srv:
            ax2.plot([p[0] for p in srv], [p[1] * 1e3 for p in srv], ":", alpha=0.8,
                     color=colors.get(m), label=f"frontend kv_transfer_seconds mean ({m})"
                     + (": D call, spans P's prefill" if m == "push" else ""))
    ax2.set_xscale("log", base=2)
    if ax2.has_data():
        ax2.set_yscale("log")
    ax2.set_xticks(lengths, [str(n) for n in lengths])
    ax2.set_xlabel("prompt length (tokens)")
    for a in (ax, ax2):
        a.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        a.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        a.yaxis.set_minor_formatter(NullFormatter())
    ax2.set_ylabel("ms")
    anchor = report.get("transfer_anchor") or {}
    ax2.set_title(f"P/D overhead vs raw transfer (KV {report['model']['kv_bytes_per_token']} "
                  f"B/token; anchor: {'ok' if not anchor.get('error') else 'failed'})",
                  fontsize=10)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    _stage_bars(ax3, report)
    host = report["host"]
    fig.suptitle(f"kvmesh P/D overhead, {report['model']['name']}, {host['cpus']} CPUs, "
                 f"load avg {host['loadavg_before'][0]:.1f} at start, "
                 f"{report['config']['reps']} reps", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
