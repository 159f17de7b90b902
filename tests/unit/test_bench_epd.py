"""bench.epd's pure parts: percentiles, TPOT/ITL, goodput at an SLO, text TTFT while images
are before their first token, ratios against aggregated, and the seeded load plan."""

from __future__ import annotations

import pytest

from bench.epd.report import Timed, goodput, percentiles, ratios, summarize, text_under_images
from bench.epd.run import make_plan


def test_percentiles_interpolate_and_empty_is_none() -> None:
    p = percentiles([float(i) for i in range(1, 101)])
    assert p is not None
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01) and p["mean"] == pytest.approx(50.5)
    assert p["n"] == 100
    assert percentiles([]) is None


def test_itl_is_per_chunk_and_tpot_per_token() -> None:
    r = Timed("text", 0.0, ttft_s=0.1, chunk_s=[0.1, 0.2, 0.5], completion_tokens=4)
    assert r.itl_s() == pytest.approx([0.1, 0.3])
    assert r.tpot_s() == pytest.approx(0.4 / 3)  # a chunk carried two tokens
    assert Timed("text", 0.0, ttft_s=0.1, chunk_s=[0.1], completion_tokens=1).tpot_s() is None


def test_goodput_needs_both_slos_and_counts_failures_as_missed() -> None:
    reqs = [
        Timed("text", 0.0, ttft_s=0.2, chunk_s=[0.2, 0.25], completion_tokens=2),  # met
        Timed("image", 0.0, ttft_s=0.9, chunk_s=[0.9, 0.95], completion_tokens=2),  # TTFT
        Timed("text", 0.0, ttft_s=0.1, chunk_s=[0.1, 0.4], completion_tokens=2),  # ITL
        Timed("text", 0.0, ttft_s=0.1, chunk_s=[0.1], completion_tokens=1),  # met: 1 token
        Timed("image", 0.0, error="HTTP 503: busy"),
    ]
    g = goodput(reqs, ttft_slo_s=0.5, itl_slo_s=0.1, wall_s=4.0)
    assert g == {"met": 2, "n": 5, "fraction": 0.4, "per_s": 0.5}
    assert goodput([], 1.0, 1.0)["fraction"] is None


def test_text_ttft_is_split_by_images_before_their_first_token() -> None:
    reqs = [
        Timed("image", 1.0, ttft_s=0.5, chunk_s=[0.5]),  # before its first token: [1.0, 1.5)
        Timed("text", 1.2, ttft_s=0.3, chunk_s=[0.3]),  # during
        Timed("text", 1.5, ttft_s=0.1, chunk_s=[0.1]),  # the image has its first token
        Timed("text", 0.5, ttft_s=0.2, chunk_s=[0.2]),  # before the image was sent
        Timed("image", 3.0, error="reset"),  # failed, never answered: busy from 3.0 on
        Timed("text", 4.0, ttft_s=0.4, chunk_s=[0.4]),
    ]
    split = text_under_images(reqs)
    assert split["during_images"]["n"] == 2 and split["alone"]["n"] == 2
    assert split["during_images"]["p50"] == pytest.approx(0.35)
    assert split["alone"]["p50"] == pytest.approx(0.15)


def test_ratios_divide_by_the_baseline_and_leave_gaps_empty() -> None:
    fast = [Timed("text", 0.0, ttft_s=0.1, chunk_s=[0.1, 0.11], completion_tokens=2)]
    slow = [Timed("text", 0.0, ttft_s=0.3, chunk_s=[0.3, 0.32], completion_tokens=2)]
    s = {"agg": summarize(fast, 0.2, 0.05, 1.0), "E/PD": summarize(slow, 0.2, 0.05, 1.0)}
    r = ratios(s, "agg")
    assert set(r) == {"E/PD"}
    assert r["E/PD"]["ttft"]["p50"] == pytest.approx(3.0)
    assert r["E/PD"]["itl"]["p99"] == pytest.approx(2.0)
    assert r["E/PD"]["image_ttft"]["p50"] is None  # no image requests in either
    assert r["E/PD"]["goodput_fraction"] == 0.0  # agg met its SLO, E/PD did not


def test_the_plan_is_seeded_and_uses_every_image_first_once() -> None:
    plan = make_plan(30, 0.5, 6, 2.0, seed=3)
    assert plan == make_plan(30, 0.5, 6, 2.0, seed=3)
    assert plan != make_plan(30, 0.5, 6, 2.0, seed=4)
    assert plan[0].offset_s == 0.0
    for prev, p in zip(plan, plan[1:], strict=False):
        if p.kind == "text" and prev.kind == "image":  # interleaved: just after the image
            assert p.offset_s == pytest.approx(prev.offset_s + 0.02)
        else:
            assert p.offset_s > prev.offset_s
    images = [p.image for p in plan if p.image is not None]
    assert len(images) == 15 and sum(p.kind == "text" for p in plan) == 15
    assert sorted(images[:6]) == list(range(6))  # misses first, then hits
    assert all(p.image is None for p in plan if p.kind == "text")
