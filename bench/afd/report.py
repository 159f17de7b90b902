"""The AFD bench's analysis and report: per-cell metrics from raw timestamps, summaries,
the break-even section, the verdict and the PNG (see :mod:`bench.afd.run` for the
definitions; the model itself is :mod:`bench.afd.breakeven`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.afd import breakeven as be

REPO_ROOT = Path(__file__).resolve().parents[2]
TRANSPORTS = ("shm", "nixl")


def compute_cover(sends: list[Any], recvs: list[Any], t0: float) -> be.Cover:
    """The attention worker's compute intervals: its timeline is one thread, so the gap
    before each send call (since the previous send or recv ended) is that layer's attention
    compute (with the embedding, logits and sampling before a step's first layer)."""
    events = sorted([(s[1], s[2], True) for s in sends] + [(r[0], r[1], False) for r in recvs])
    out, prev = [], t0
    for a, b, is_send in events:
        if is_send:
            out.append((prev, a))
        prev = max(prev, b)
    return be.Cover(out)


def analyse(raw: dict[str, Any], topology: str, transport: str, mb: int, batch: int,
            layers: int, hidden: int) -> dict[str, Any]:
    """Per-cell metrics from raw timestamps (module docstring)."""
    ws = raw["workers"]
    steps = len(ws[0]["step_s"])
    t0 = min(w["t0"] for w in ws)
    t1 = max(w["t1"] for w in ws)
    window = t1 - t0
    step_s = np.concatenate([w["step_s"] for w in ws])
    layer_steps = steps * layers
    mean = lambda key: float(np.mean([w["stats"][key] for w in ws]))  # noqa: E731
    out: dict[str, Any] = {
        "variant": (topology if topology == "unsplit" else f"{topology}/{transport}")
        + f"/mb{mb}", "topology": topology,
        "transport": None if topology == "unsplit" else transport, "microbatches": mb,
        "batch": batch,
        "concurrent_requests": batch * len(ws), "steps": steps,
        "tpot_ms": float(step_s.mean() * 1e3), "tpot_p50_ms": float(np.median(step_s) * 1e3),
        "tokens_per_s": batch * len(ws) * steps / window, "window_s": window,
        "per_layer_step_us": {"attention_compute": mean("attn_compute_s") / layer_steps * 1e6,
                              "attention_send": mean("send_s") / layer_steps * 1e6,
                              "attention_recv_wait": mean("recv_wait_s") / layer_steps * 1e6}}
    if raw["ffn"] is None:
        out["per_layer_step_us"]["ffn_compute"] = mean("ffn_compute_s") / layer_steps * 1e6
        out["idle_frac"] = {"attention": 0.0, "ffn": 0.0}
        return out
    f = raw["ffn"]
    fmsg = {tuple(m[:4]): m[4:] for m in f["msgs"]}
    transfer, exposed, queue, nbytes = [], [], [], []
    batches = {}
    for w in ws:
        sends = {tuple(s[:4]): s[4:] for s in w["sends"]}
        recvs = {tuple(r[:4]): r[4:] for r in w["recvs"]}
        cover = compute_cover(list(sends.values()), list(recvs.values()), w["t0"])
        keys = [k for k in sends if k in recvs and k in fmsg]
        waited = [recvs[k][1] - fmsg[k][5] for k in keys if recvs[k][0] <= fmsg[k][5]]
        down = float(np.median(waited)) if waited else 0.0
        for k in keys:
            ntok, s0, s1 = sends[k]
            w0, r1 = recvs[k]
            rc0, r, c0, c1, fs0, fs1 = fmsg[k]
            batches[(c0, c1)] = c1 - c0
            ext_q = max(0.0, rc0 - s1)
            # a send call may return long after the peer already has the message (the
            # woken peer preempted the sender): a send ends at the latest at delivery
            s1, fs1 = min(s1, r), min(fs1, r1)
            ivs = [(s0, s1), (max(s1, rc0), r), (fs0, fs1)]
            # the attention side busy as the answer landed: the delivery took about the
            # cell's median, some time before its recv call
            ivs += [(fs1, r1)] if w0 <= fs1 else [(fs1, min(fs1 + down, w0)), (w0, r1)]
            # a peer may stamp its end before the sender stamps its own (2 cores): clamp
            ivs = [(a, max(a, b)) for a, b in ivs]
            transfer.append(sum(b - a for a, b in ivs))
            exposed.append(sum(b - a for a, b in ivs) - be.covered_time(ivs, cover))
            queue.append(ext_q + max(0.0, c0 - r) + max(0.0, fs0 - c1))
            nbytes.append(ntok * hidden * 4)
    fcover = be.Cover([(max(a, t0), min(b, t1)) for a, b in f["waits"]])
    att_idle = [sum(r[5] - r[4] for r in w["recvs"]) / (w["t1"] - w["t0"]) for w in ws]
    out["per_layer_step_us"]["ffn_compute"] = sum(batches.values()) / layer_steps * 1e6
    tr = float(np.sum(transfer))
    out.update({
        "messages": len(transfer),
        "per_message_us": {"transfer": float(np.mean(transfer) * 1e6),
                           "transfer_p50": float(np.median(transfer) * 1e6),
                           "exposed_transfer": float(np.mean(exposed) * 1e6),
                           "ffn_queue": float(np.mean(queue) * 1e6),
                           "bytes": float(np.mean(nbytes))},
        "overlap_ratio": 1.0 - float(np.sum(exposed)) / tr if tr > 0 else None,
        "idle_frac": {"attention": float(np.mean(att_idle)), "ffn": fcover.total / window},
        "ffn_batches": {"messages": f["messages"], "batches": f["batches"],
                        "batch_sizes": {str(k): v for k, v in sorted(f["batch_sizes"].items())},
                        "dropped": f["dropped"]}})
    return out


def transport_json_fit(path: Path) -> dict[str, Any]:
    """Fit ``fixed + per_byte`` to the echo microbench's p50 round trips, per transport."""
    if not path.is_file():
        return {"status": "missing", "path": str(path)}
    d = json.loads(path.read_text())
    out: dict[str, Any] = {"path": str(path.relative_to(REPO_ROOT)) if path.is_relative_to(
        REPO_ROOT) else str(path), "created": d.get("created")}
    for name, t in d.get("transports", {}).items():
        rows = t.get("results", [])
        if rows:
            fit = be.fit_linear([r["bytes"] for r in rows],
                                [r["round_trip"]["p50_us"] * 1e-6 for r in rows])
            out[name] = {"fixed_us": fit["fixed"] * 1e6, "per_kib_us": fit["per_unit"] * 1024e6}
    return out


def _median(rows: list[dict[str, Any]], *path: str) -> float | None:
    vals = []
    for r in rows:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            vals.append(float(v))
    return float(np.median(vals)) if vals else None


SUMMARY_FIELDS = {
    "tpot_ms": ("tpot_ms",), "tokens_per_s": ("tokens_per_s",),
    "overlap_ratio": ("overlap_ratio",),
    "transfer_us_per_message": ("per_message_us", "transfer"),
    "exposed_transfer_us_per_message": ("per_message_us", "exposed_transfer"),
    "ffn_queue_us_per_message": ("per_message_us", "ffn_queue"),
    "attention_compute_us_per_layer_step": ("per_layer_step_us", "attention_compute"),
    "ffn_compute_us_per_layer_step": ("per_layer_step_us", "ffn_compute"),
    "attention_idle_frac": ("idle_frac", "attention"), "ffn_idle_frac": ("idle_frac", "ffn"),
}


def summarize(cells: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Medians over reps, by variant then batch, with TPOT relative to unsplit (1 mb)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for c in cells:
        out.setdefault(c["variant"], {}).setdefault(str(c["batch"]), {"_rows": []})
        out[c["variant"]][str(c["batch"])]["_rows"].append(c)
    for by_batch in out.values():
        for b, cell in by_batch.items():
            rows = cell.pop("_rows")
            cell.update({k: _median(rows, *p) for k, p in SUMMARY_FIELDS.items()})
            cell["reps"] = len(rows)
            ref = out.get("unsplit/mb1", {}).get(b, {}).get("tpot_ms")
            cell["tpot_vs_unsplit"] = (cell["tpot_ms"] / ref) if ref and cell["tpot_ms"] \
                else None
    return out


def build_model(compute: list[dict[str, Any]], cells: list[dict[str, Any]],
                transport_fit: dict[str, Any], hidden: int, layers: int,
                ctx: int) -> dict[str, Any]:
    """The break-even section of the JSON (module docstring)."""
    out: dict[str, Any] = {"doc": be.__doc__, "transport_microbench_fit": transport_fit}
    if not compute:
        return {**out, "status": "skipped (no compute points)"}
    consts = {k: be.fit_compute(k, [(p["batch"], p["hidden"], p["ctx"], p["seconds"])
                                    for p in compute if p["kind"] == k]) for k in ("attn", "ffn")}
    fit_err = [be.compute_time(p["kind"], consts[p["kind"]], p["batch"], p["hidden"], p["ctx"])
               / p["seconds"] - 1 for p in compute]
    out.update({"compute_points": compute,
                "compute_constants": {k: {**v, "units": "s per call, per sequence, per weight "
                                          "byte, per FLOP"} for k, v in consts.items()},
                "compute_fit_max_rel_error": float(np.max(np.abs(fit_err)))})
    per_transport: dict[str, Any] = {}
    for tr in TRANSPORTS:
        pts = [(c["per_message_us"]["bytes"], c["per_message_us"]["transfer_p50"] * 1e-6)
               for c in cells if c["topology"] == "1A1F" and c["transport"] == tr
               and c["microbatches"] == 1 and "per_message_us" in c]
        if pts:
            fit, source = be.fit_linear(*zip(*pts, strict=True)), "this run (1A1F, 1 microbatch)"
        elif tr in transport_fit:
            t = transport_fit[tr]
            fit = {"fixed": t["fixed_us"] * 1e-6, "per_unit": t["per_kib_us"] * 1e-6 / 1024}
            source = "bench/results/afd_transport.json"
        else:
            continue
        m = be.Model(consts["attn"], consts["ffn"], fit, float(ctx))
        batches = [1, 8, 32, 128, 512]
        tab = be.table(m, batches, [hidden, 1024, 2048, 4096, 8192],
                       list(range(128, 16384 + 1, 64)))
        checks = []
        for variant, key in (("unsplit/mb1", "unsplit"), (f"1A1F/{tr}/mb1", "split_1mb"),
                             (f"1A1F/{tr}/mb2", "split_2mb")):
            for c in cells:
                if c["variant"] == variant and c["rep"] == 0:
                    pred = be.predict(m, c["batch"], hidden)[key] * layers * 1e3
                    checks.append({"variant": variant, "batch": c["batch"],
                                   "predicted_layers_ms": pred, "measured_tpot_ms": c["tpot_ms"]})
        per_transport[tr] = {"round_trip_fit": {"fixed_us": fit["fixed"] * 1e6,
                                                "per_kib_us": fit["per_unit"] * 1024e6,
                                                "source": source},
                             "table": tab, "measured_vs_predicted": checks}
    out["per_transport"] = per_transport
    return out


def verdict(summary: dict[str, Any], model: dict[str, Any], cpus: int | None) -> str:
    """A plain statement of who won, from the numbers (no adjectives added)."""
    ratios = [c["tpot_vs_unsplit"] for v, bb in summary.items() if not v.startswith("unsplit")
              for c in bb.values() if c.get("tpot_vs_unsplit")]
    parts = []
    if ratios:
        won = sum(r < 1 for r in ratios)
        parts.append(f"Split TPOT / unsplit TPOT over all split cells: {min(ratios):.2f}-"
                     f"{max(ratios):.2f} ({won} of {len(ratios)} cells faster than unsplit).")
    parts.append(f"This machine has {cpus} CPUs shared with other jobs: the attention and FFN "
                 "processes do not get a core each, so the split's parallelism is not real here, "
                 "while it pays a round trip per layer (60 messages per token for SmolLM2) and, "
                 "with 2 microbatches, streams every layer's weights twice per step (decode at "
                 "these batches is weight-bandwidth bound: layer time barely grows with batch).")
    for tr, t in model.get("per_transport", {}).items():
        be_h = t["table"]["break_even_hidden"]
        parts.append(f"Model ({tr}, each role on its own core): two-microbatch AFD beats unsplit "
                     f"from hidden size {be_h} (by batch; null: not up to 16384).")
    return " ".join(parts)


def plot(report: dict[str, Any], path: Path) -> bool:
    """TPOT, tokens/s, where the time goes (largest batch) and the model's speedup;
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNG", file=sys.stderr)
        return False
    summary = report["summary"]
    variants = list(summary)
    batches = report["config"]["batches"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    width = 0.8 / max(len(variants), 1)
    for ax, key, label in ((axes[0][0], "tpot_ms", "TPOT, ms"),
                           (axes[0][1], "tokens_per_s", "tokens/s (all workers)")):
        for j, v in enumerate(variants):
            ys = [summary[v].get(str(b), {}).get(key) or 0 for b in batches]
            ax.bar([i + j * width for i in range(len(batches))], ys, width, label=v)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    bmax = str(max(batches))
    ax = axes[1][0]
    parts = (("attention_compute_us_per_layer_step", "attention compute"),
             ("ffn_compute_us_per_layer_step", "FFN compute"))
    labelled = False
    for j, v in enumerate(variants):
        c = summary[v].get(bmax, {})
        bottom = 0.0
        for k, (key, lab) in enumerate(parts):
            val = c.get(key) or 0.0
            ax.bar(j, val, color=f"C{k}", bottom=bottom, label=lab if j == 0 else None)
            bottom += val
        if c.get("transfer_us_per_message") is not None:
            mbs = 2 if v.endswith("mb2") else 1
            exp = (c["exposed_transfer_us_per_message"] or 0) * mbs
            hid = (c["transfer_us_per_message"] - (c["exposed_transfer_us_per_message"] or 0)) \
                * mbs
            ax.bar(j, exp, color="C3", bottom=bottom,
                   label=None if labelled else "exposed transfer")
            ax.bar(j, hid, color="C3", alpha=0.35, bottom=bottom + exp,
                   label=None if labelled else "hidden transfer")
            labelled = True
    ax.set_xticks(range(len(variants)), variants, rotation=40, ha="right", fontsize=7)
    ax.set_ylabel(f"µs per layer per step, batch {bmax}")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    ax = axes[1][1]
    for tr, t in report["break_even"].get("per_transport", {}).items():
        rows = t["table"]["rows"]
        for b in sorted({r["batch"] for r in rows}):
            pts = sorted((r["hidden"], r["speedup_2mb"]) for r in rows if r["batch"] == b)
            ax.plot(*zip(*pts, strict=True), marker="o",
                    linestyle="-" if tr == "shm" else "--", label=f"{tr} B={b}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hidden size")
    ax.set_ylabel("model: unsplit / AFD-2mb time per layer")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(True, alpha=0.3)
    h = report["host"]
    fig.suptitle(f"AFD on {report['config']['model']} (float32, 1 thread per process), "
                 f"{report['config']['steps']} decode steps x {report['config']['reps']} reps, "
                 f"interleaved; load {h['loadavg_before'][0]:.1f} on {h['cpus']} CPUs",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


