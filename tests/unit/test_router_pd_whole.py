""""P serves whole": when every D's KV is full, a prefill worker that can decode alone
runs the request as an aggregated worker (router core, the pure rule, the policy hook,
the offline replay). Deterministic; no network."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.offline.config import SimConfig
from bench.offline.sim import simulate
from bench.offline.timeline import plot_timeline, run_timeline
from bench.replay.trace import TraceRequest
from services.router.core import RouterCore
from services.router.disagg import (
    DisaggConfig,
    PairInfo,
    can_decode_alone,
    kv_after,
    prefill_serves_whole,
)
from services.router.plan import WorkerRecord
from services.router.policies.base import Decision, RouteContext, WorkerState
from services.router.policy_setup import default_registry

BS = 32
BLOCKS = 1000  # KV capacity reported by every worker: 32,000 tokens
ON = DisaggConfig(prefill_whole=True)


def w(i: str, role: str, whole: bool = True, sglang: bool = False) -> WorkerRecord:
    mode, layout = ("sglang", "sglang|L") if sglang else ("pull", "L")
    return WorkerRecord(i, f"addr-{i}", "m", role, BS, 1 << 20, mode, layout,
                        can_decode_alone=whole)


def core(disagg: DisaggConfig = ON, policy: object = None) -> RouterCore:
    reg = default_registry()
    rng = random.Random(0)
    return RouterCore(policy=policy or reg.create("least_loaded", rng),  # type: ignore[arg-type]
                      prefill_policy=reg.create("round_robin", rng), disagg=disagg,
                      clock=lambda: 0.0)


def ctx(rid: str, n: int = 640, start: int = 0) -> RouteContext:
    return RouteContext(rid, "m", tuple(range(start, start + n)))


def loads(c: RouterCore, p_kv: float, *d_kv: float) -> None:
    c.update_load("p1", 0, 0, p_kv, BLOCKS)
    for k, kv in enumerate(d_kv, start=1):
        c.update_load(f"d{k}", 10, 0, kv, BLOCKS)


def test_capability_is_explicit_and_never_sglang_prefill() -> None:
    vllm = PairInfo("p", "pull", BS, "L")
    sglang = PairInfo("p", "sglang", BS, "sglang|L")
    assert can_decode_alone(vllm, True) and not can_decode_alone(vllm, False)
    assert not can_decode_alone(sglang, True)  # SGLang's P only hands KV to its D
    assert WorkerRecord("x", "a", "m", "prefill", BS, 0).can_decode_alone is False


def test_kv_after_and_the_default_rule() -> None:
    assert kv_after(0.5, 0, 10, 100, 100) == pytest.approx(0.6)
    assert kv_after(0.1, 80, 10, 100, 0) == pytest.approx(0.8)  # routed blocks count
    assert kv_after(0.5, 0, 10, 0, 100) is None  # capacity unknown
    assert prefill_serves_whole(0.1, [0.95, 0.99], ON)[0]
    assert "P serves whole" in prefill_serves_whole(0.1, [0.95], ON)[1]
    assert not prefill_serves_whole(0.1, [0.95, 0.5], ON)[0]  # one D has headroom
    assert not prefill_serves_whole(0.85, [0.95], ON)[0]  # P's KV is full too
    assert not prefill_serves_whole(0.1, [0.95, None], ON)[0]  # unknown D: not full
    assert not prefill_serves_whole(None, [0.95], ON)[0]  # unknown P: not used
    assert not prefill_serves_whole(0.1, [], ON)[0]
    assert not prefill_serves_whole(0.1, [0.99], DisaggConfig())[0]  # off by default
    assert DisaggConfig(whole_d_kv=0.0).problems() and DisaggConfig(whole_p_kv=1.5).problems()
    # decode-first never reaches the decision: the flag is refused there, not ignored
    (problem,) = DisaggConfig(prefill_whole=True, order="decode_first").problems()
    assert "prefill_whole needs disagg order prefill_first" in problem
    assert not DisaggConfig(prefill_whole=True).problems()
    bad = SimConfig(prefill_workers=1, decode_workers=1, disagg_order="decode_first",
                    prefill_whole=True).problems()
    assert any("prefill_whole needs disagg order prefill_first" in b for b in bad), bad


def test_off_by_default_the_request_waits_for_full_d() -> None:
    c = core(DisaggConfig())
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    loads(c, 0.0, 0.99)
    plan = c.route(ctx("a"))
    assert plan.worker.instance_id == "d1" and plan.prefill is not None


def test_p_serves_whole_when_every_d_is_full_and_is_accounted_as_agg() -> None:
    c = core()
    c.set_workers([w("p1", "prefill"), w("d1", "decode"), w("d2", "decode")])
    loads(c, 0.0, 0.95, 0.99)
    plan = c.route(ctx("a"))
    assert plan.worker.instance_id == "p1" and plan.prefill is None
    assert "P serves whole" in plan.reason and plan.prompt_blocks == 20
    assert c.in_flight() == {"p1": 1} and c.pending_prefill() == {"p1": 640}
    c.release_prefill("a")  # first token: P keeps it in flight (it decodes there)
    assert c.in_flight() == {"p1": 1} and c.pending_prefill() == {}
    assert c.release("a") and c.in_flight() == {}


def test_one_d_with_headroom_keeps_the_pd_path() -> None:
    c = core()
    c.set_workers([w("p1", "prefill"), w("d1", "decode"), w("d2", "decode")])
    loads(c, 0.0, 0.95, 0.5)
    plan = c.route(ctx("a"))
    assert plan.worker.role == "decode"


def test_routed_blocks_fill_d_before_its_load_report_does() -> None:
    c = core()
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    loads(c, 0.0, 0.0)
    roles = []
    for i in range(6):
        roles.append(c.route(ctx(f"r{i}", 6400, i * 100_000)).worker.role)
        c.release_prefill(f"r{i}")  # P's part of a P/D request is over; not of a whole one
    # 200 blocks each on 1000: the 5th request would take D past 0.9 of its KV; P serves
    # it whole, and then its own 200 blocks leave P (0.8 at most) room for the 6th
    assert roles == ["decode"] * 4 + ["prefill"] * 2


@pytest.mark.parametrize("p", [w("p1", "prefill", whole=False),
                               w("p1", "prefill", sglang=True)])
def test_a_p_that_cannot_decode_alone_never_serves_whole(p: WorkerRecord) -> None:
    c = core()
    sglang = p.handoff_mode == "sglang"
    c.set_workers([p, w("d1", "decode", sglang=sglang)])
    loads(c, 0.0, 0.99)
    plan = c.route(ctx("a"))
    assert plan.worker.instance_id == "d1"


def test_p_whose_kv_is_full_too_does_not_serve_whole() -> None:
    c = core()
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    loads(c, 0.85, 0.99)
    assert c.route(ctx("a")).worker.instance_id == "d1"


class Hooked:
    """least_loaded with a ``prefer_prefill_whole`` hook giving a fixed answer."""

    name = "hooked"

    def __init__(self, answer: tuple[bool, str] | None) -> None:
        self.answer = answer
        self.seen: list[tuple[str, list[str]]] = []
        self.inner = default_registry().create("least_loaded", random.Random(0))

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        return self.inner.select(ctx, candidates)

    def prefer_prefill_whole(self, ctx: RouteContext, p: WorkerState,
                             ds: Sequence[WorkerState]) -> tuple[bool, str] | None:
        self.seen.append((p.instance_id, [d.instance_id for d in ds]))
        return self.answer


def test_the_policy_hook_decides_and_none_falls_back_to_the_rule() -> None:
    yes = Hooked((True, "policy says whole"))
    c = core(policy=yes)
    c.set_workers([w("p1", "prefill"), w("d1", "decode"), w("d2", "decode")])
    loads(c, 0.0, 0.1, 0.1)  # the default rule would keep P/D
    plan = c.route(ctx("a"))
    assert plan.worker.instance_id == "p1" and "policy says whole" in plan.reason
    assert yes.seen == [("p1", ["d1", "d2"])]
    no_opinion = core(policy=Hooked(None))
    no_opinion.set_workers([w("p1", "prefill"), w("d1", "decode")])
    loads(no_opinion, 0.0, 0.99)
    assert "P serves whole" in no_opinion.route(ctx("a")).reason
    off = Hooked((True, "x"))
    c_off = core(DisaggConfig(), policy=off)
    c_off.set_workers([w("p1", "prefill"), w("d1", "decode")])
    assert c_off.route(ctx("a")).worker.instance_id == "d1" and off.seen == []


def test_decodes_served_whole_are_not_ps_prefill_queue() -> None:
    c = core(DisaggConfig(prefill_whole=True, prefill_max_queue=2))
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    loads(c, 0.0, 0.99)
    for i in range(3):
        assert c.route(ctx(f"w{i}", 640, i * 10_000)).worker.instance_id == "p1"
        c.release_prefill(f"w{i}")  # now decoding on P
    c.update_load("p1", 3, 0, 0.1, BLOCKS)
    c.update_load("d1", 1, 0, 0.1, BLOCKS)  # D drained
    plan = c.route(ctx("b", 640, 90_000))
    assert plan.prefill is not None and plan.prefill.instance_id == "p1"  # not "queue full"


def _trace() -> list[TraceRequest]:
    # 12 distinct long prompts 50 ms apart: more than the one D's small KV holds
    return [TraceRequest(float(i * 50), 1024, 64, tuple(range(i * 16, i * 16 + 16)))
            for i in range(12)]


def test_offline_replay_serves_whole_on_p_only_when_asked() -> None:
    cfg = SimConfig(trace_block_size=64, block_size=16, num_blocks=640,
                    max_num_batched_tokens=2048, prefill_workers=2, decode_workers=1,
                    policy="ttft_hit", conditional_disagg=False)
    off = simulate(_trace(), cfg)
    on = simulate(_trace(), cfg.replace(prefill_whole=True))
    assert all(r.status == "ok" for r in off.results + on.results)
    assert off.counters["served_whole_on_prefill"] == 0
    assert on.counters["served_whole_on_prefill"] > 0
    assert on.counters["routed_disaggregated"] + on.counters["served_whole_on_prefill"] == 12
    assert cfg.replace(prefill_whole=True).label().endswith("-whole")
    mean = sum(r.ttft_s or 0 for r in on.results) / 12
    assert mean < sum(r.ttft_s or 0 for r in off.results) / 12  # no wait for D's blocks


def test_timeline_counts_requests_served_whole(tmp_path: Path) -> None:
    cfg = SimConfig(trace_block_size=64, block_size=16, num_blocks=640,
                    max_num_batched_tokens=2048, prefill_workers=2, decode_workers=1,
                    policy="ttft_hit", conditional_disagg=False, prefill_whole=True)
    data = run_timeline(_trace(), cfg, interval_s=0.2)
    whole = sum(s["whole"] for s in data["samples"])
    assert whole == data["counters"]["served_whole_on_prefill"] > 0
    plot_timeline(tmp_path / "t.png", data)
    assert (tmp_path / "t.png").stat().st_size > 0
