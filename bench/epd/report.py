"""The EPD benchmark's pure report logic: percentiles, goodput, text TTFT under image load,
ratios against aggregated, the text table and the PNG.

Contracts (no I/O except :func:`plot`):

- A request's timings are a :class:`Timed`: ``kind`` ("text" or "image"), ``sent_s`` (on
  the run's clock), ``ttft_s`` (to the first chunk with text), ``chunk_s`` (the arrival
  of each chunk with text, relative to sending), ``completion_tokens`` and ``error``.
  ``itl_s()`` is the gaps between consecutive text chunks; ``tpot_s()`` the mean
  inter-token time ``(last chunk - first chunk) / (completion_tokens - 1)`` (None with
  fewer than 2 tokens): a chunk can carry more than one token, so the gaps are per chunk
  and TPOT per token.
- :func:`percentiles` gives p50/p90/p99/mean/n of a list (linear interpolation, as
  numpy's default; None when empty).
- :func:`goodput` counts the requests that met both SLOs: ``ttft_s <= ttft_slo_s`` and
  ``tpot_s() <= itl_slo_s`` (a request with one token meets the ITL SLO; a failed request
  meets neither). It returns ``{"met", "n", "fraction", "per_s"}`` (``per_s``: met /
  ``wall_s``; None without a wall time).
- :func:`text_under_images` splits the text requests by whether an image request was *in
  its pre-first-token phase* (sent, no first chunk yet: being encoded or prefilled) at the
  moment the text request was sent; TTFT percentiles of each part (``during_images``,
  ``alone``).
- :func:`summarize` is one deployment's summary (TTFT and ITL percentiles overall and by
  kind, TPOT, goodput, text-under-images, errors); :func:`ratios` divides each
  deployment's p50/p90/p99 (and goodput fraction) by the ``baseline``'s (None where
  either is missing or the baseline is 0).
- :func:`table` renders the summaries; :func:`plot` writes the PNG and returns False when
  matplotlib is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PCTS = (50, 90, 99)
KINDS = ("text", "image")


@dataclass
class Timed:
    """One request's timings (see the module docstring)."""

    kind: str
    sent_s: float
    ttft_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    total_s: float | None = None
    image: int | None = None  # which of the bench's images (image requests)
    error: str | None = None

    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    def itl_s(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        n = self.completion_tokens if self.completion_tokens is not None else len(self.chunk_s)
        if n < 2 or len(self.chunk_s) < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (n - 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """p50/p90/p99/mean/n of ``values`` (None when empty)."""
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    out = {f"p{p}": float(v) for p, v in zip(PCTS, np.percentile(arr, PCTS), strict=True)}
    out.update(mean=float(arr.mean()), n=int(arr.size))
    return out


def goodput(reqs: Sequence[Timed], ttft_slo_s: float, itl_slo_s: float,
            wall_s: float | None = None) -> dict[str, Any]:
    """Requests meeting both SLOs (see the module docstring)."""
    met = 0
    for r in reqs:
        if not r.ok():
            continue
        tpot = r.tpot_s()
        assert r.ttft_s is not None
        if r.ttft_s <= ttft_slo_s and (tpot is None or tpot <= itl_slo_s):
            met += 1
    n = len(reqs)
    return {"met": met, "n": n, "fraction": met / n if n else None,
            "per_s": met / wall_s if wall_s else None}


def _pre_first_token(r: Timed) -> tuple[float, float]:
    """[sent, first chunk) on the run's clock; a failed request's window ends at its end
    (or never, when unknown)."""
    end = r.ttft_s if r.ttft_s is not None else r.total_s
    return r.sent_s, r.sent_s + (end if end is not None else float("inf"))


def text_under_images(reqs: Sequence[Timed]) -> dict[str, Any]:
    """TTFT of text requests sent while an image request was before its first token,
    and of the others (see the module docstring)."""
    windows = [_pre_first_token(r) for r in reqs if r.kind == "image"]
    during: list[float] = []
    alone: list[float] = []
    for r in reqs:
        if r.kind != "text" or not r.ok():
            continue
        assert r.ttft_s is not None
        busy = any(a <= r.sent_s < b for a, b in windows)
        (during if busy else alone).append(r.ttft_s)
    return {"during_images": percentiles(during), "alone": percentiles(alone)}


def summarize(reqs: Sequence[Timed], ttft_slo_s: float, itl_slo_s: float,
              wall_s: float | None) -> dict[str, Any]:
    """One deployment's summary (see the module docstring)."""
    ok = [r for r in reqs if r.ok()]

    def ttfts(kind: str | None = None) -> list[float]:
        return [r.ttft_s for r in ok if r.ttft_s is not None and kind in (None, r.kind)]

    def itls(kind: str | None = None) -> list[float]:
        return [g for r in ok if kind in (None, r.kind) for g in r.itl_s()]

    def tpots(kind: str | None = None) -> list[float]:
        return [t for r in ok if kind in (None, r.kind) if (t := r.tpot_s()) is not None]

    return {
        "n": len(reqs), "ok": len(ok),
        "errors": [r.error for r in reqs if r.error],
        "ttft_s": percentiles(ttfts()),
        "itl_s": percentiles(itls()),
        "tpot_s": percentiles(tpots()),
        "by_kind": {k: {"n": sum(1 for r in reqs if r.kind == k),
                        "ttft_s": percentiles(ttfts(k)), "itl_s": percentiles(itls(k)),
                        "tpot_s": percentiles(tpots(k))} for k in KINDS},
        "goodput": goodput(reqs, ttft_slo_s, itl_slo_s, wall_s),
        "text_ttft_under_images": text_under_images(reqs),
        "wall_s": wall_s,
    }


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return float(a) / float(b)


RATIO_PATHS: dict[str, tuple[str, ...]] = {
    "ttft": ("ttft_s",), "itl": ("itl_s",), "tpot": ("tpot_s",),
    "text_ttft": ("by_kind", "text", "ttft_s"), "image_ttft": ("by_kind", "image", "ttft_s"),
    "text_ttft_during_images": ("text_ttft_under_images", "during_images"),
}


def ratios(summaries: dict[str, dict[str, Any]], baseline: str) -> dict[str, Any]:
    """Each deployment's percentiles over the baseline's (see the module docstring)."""
    base = summaries.get(baseline)
    out: dict[str, Any] = {}
    for name, s in summaries.items():
        if name == baseline:
            continue
        row: dict[str, Any] = {}
        for label, path in RATIO_PATHS.items():
            row[label] = {f"p{p}": _ratio(_get(s, *path, f"p{p}"), _get(base, *path, f"p{p}"))
                          for p in PCTS}
        row["goodput_fraction"] = _ratio(_get(s, "goodput", "fraction"),
                                         _get(base, "goodput", "fraction"))
        out[name] = row
    return out


def _ms(v: Any, width: int = 7) -> str:
    return f"{v * 1e3:{width}.1f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """Plain-text table, times in ms."""
    head = (f"{'deployment':<10} {'n':>3} {'ok':>3} {'TTFT p50':>8} {'p90':>7} {'p99':>7} "
            f"{'ITL p50':>7} {'p90':>7} {'p99':>7} {'img TTFT':>8} {'txt TTFT':>8} "
            f"{'txt|img':>7} {'txt alone':>9} {'goodput':>7}")
    lines = [head]
    for name, s in summaries.items():
        gp = _get(s, "goodput", "fraction")
        lines.append(
            f"{name:<10} {s['n']:>3} {s['ok']:>3} {_ms(_get(s, 'ttft_s', 'p50'), 8)} "
            f"{_ms(_get(s, 'ttft_s', 'p90'))} {_ms(_get(s, 'ttft_s', 'p99'))} "
            f"{_ms(_get(s, 'itl_s', 'p50'))} {_ms(_get(s, 'itl_s', 'p90'))} "
            f"{_ms(_get(s, 'itl_s', 'p99'))} "
            f"{_ms(_get(s, 'by_kind', 'image', 'ttft_s', 'p50'), 8)} "
            f"{_ms(_get(s, 'by_kind', 'text', 'ttft_s', 'p50'), 8)} "
            f"{_ms(_get(s, 'text_ttft_under_images', 'during_images', 'p50'))} "
            f"{_ms(_get(s, 'text_ttft_under_images', 'alone', 'p50'), 9)} "
            f"{f'{gp:7.2f}' if gp is not None else '-':>7}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write the PNG (TTFT, ITL and text-TTFT percentiles per deployment; goodput);
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summaries: dict[str, dict[str, Any]] = report["summary"]
    names = list(summaries)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.8))
    panels = [
        ("TTFT (ms), all requests", ("ttft_s",)),
        ("ITL (ms), gaps between chunks", ("itl_s",)),
        ("text-only TTFT (ms): while images\nare before their first token | alone", None),
    ]
    width = 0.8 / len(PCTS)
    for ax, (title, key) in zip(axes[:3], panels, strict=True):
        for j, p in enumerate(PCTS):
            if key is not None:
                vals = [_get(summaries[n], *key, f"p{p}") for n in names]
                xs = np.arange(len(names)) + (j - 1) * width
                ax.bar(xs, [v * 1e3 if v is not None else 0 for v in vals], width,
                       label=f"p{p}")
        if key is None:  # text TTFT p50/p90, during image work vs alone
            for j, (part, hatch) in enumerate((("during_images", ""), ("alone", "//"))):
                for k, p in enumerate((50, 90)):
                    vals = [_get(summaries[n], "text_ttft_under_images", part, f"p{p}")
                            for n in names]
                    xs = np.arange(len(names)) + (j * 2 + k - 1.5) * 0.2
                    ax.bar(xs, [v * 1e3 if v is not None else 0 for v in vals], 0.2,
                           hatch=hatch, color=f"C{k}", edgecolor="k",
                           label=f"{'with images' if part == 'during_images' else 'alone'} "
                                 f"p{p}")
        ax.set_xticks(np.arange(len(names)), names)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    gp = [_get(summaries[n], "goodput", "fraction") for n in names]
    axes[3].bar(names, [g if g is not None else 0 for g in gp], color="C2")
    axes[3].set_ylim(0, 1.05)
    slo = report["config"]
    axes[3].set_title(f"goodput: fraction with TTFT <= {slo['ttft_slo_ms']:g} ms and\n"
                      f"TPOT <= {slo['itl_slo_ms']:g} ms", fontsize=10)
    axes[3].grid(True, axis="y", alpha=0.3)
    host = report["host"]
    fig.suptitle(f"kvmesh EPD: aggregated vs E/PD vs E/P/D, {report['config']['model']}, "
                 f"{report['config']['requests']} requests each "
                 f"({report['config']['image_fraction']:.0%} with an image), "
                 f"{host['cpus']} CPUs (indicative)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
