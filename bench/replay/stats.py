"""Latency statistics, SLO attainment and goodput of a replay (pure).

Contract:

- :class:`Result` is one request as the client saw it: TTFT, mean inter-token latency
  (TPOT: (E2E − TTFT) / (completion tokens − 1), the per-request mean ITL Dynamo and
  DistServe use), E2E, prompt/cached/completion tokens, and ``status`` ("ok",
  "rejected" for HTTP 503/429, "error").
- :func:`summarize` gives, for one run at one arrival rate: counts, p50/p90/p99 of TTFT,
  TPOT and E2E over completed requests, cache-hit tokens and ratio, output throughput,
  and the SLO attainment: the share of *all* requests (rejected and failed ones count as
  misses) with TTFT ≤ ``slo_ttft_s`` and TPOT ≤ ``slo_tpot_s``.
- :func:`goodput` (DistServe): the highest request rate among the runs whose attainment is
  ≥ ``target`` (0.9); 0 when none meets it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass
class Result:
    """One replayed request."""

    index: int
    send_s: float
    status: str = "ok"
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None:
            return None
        if self.completion_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def meets(self, slo_ttft_s: float, slo_tpot_s: float) -> bool:
        tpot = self.tpot_s
        return (self.status == "ok" and self.ttft_s is not None and tpot is not None
                and self.ttft_s <= slo_ttft_s and tpot <= slo_tpot_s)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def summarize(results: list[Result], duration_s: float, rate_rps: float,
              slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """One run's summary (see the module docstring)."""
    ok = [r for r in results if r.status == "ok"]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    met = sum(1 for r in results if r.meets(slo_ttft_s, slo_tpot_s))
    return {
        "rate_rps": rate_rps,
        "requests": len(results),
        "ok": len(ok),
        "rejected": sum(1 for r in results if r.status == "rejected"),
        "errors": sum(1 for r in results if r.status == "error"),
        "duration_s": duration_s,
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _pcts([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else 0.0,
        "output_tok_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "slo_attainment": met / len(results) if results else 0.0,
    }


def goodput(runs: list[dict[str, Any]], target: float = 0.9) -> float:
    """The highest ``rate_rps`` among runs with ``slo_attainment >= target``."""
    good = [r["rate_rps"] for r in runs if r["slo_attainment"] >= target]
    return max(good) if good else 0.0
