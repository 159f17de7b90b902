"""P/D selection in the router core: both orders, conditional disaggregation, pairing."""

import random

import pytest

from services.router.core import RouterCore
from services.router.disagg import DisaggConfig, bypass_prefill, decode_first_needs_prefill
from services.router.plan import Incompatible, WorkerRecord
from services.router.policies.base import RouteContext
from services.router.policy_setup import default_registry

BS = 32


def w(i: str, role: str, mode: str = "pull", bs: int = BS, layout: str = "L") -> WorkerRecord:
    return WorkerRecord(i, f"addr-{i}", "m", role, bs, 4096, mode, layout)


def core(order: str = "prefill_first", **kw: object) -> RouterCore:
    reg = default_registry()
    rng = random.Random(0)
    return RouterCore(policy=reg.create("least_loaded", rng),
                      prefill_policy=reg.create("round_robin", rng),
                      disagg=DisaggConfig(order=order, **kw),  # type: ignore[arg-type]
                      clock=lambda: 0.0)


def ctx(rid: str, n: int, start: int = 0) -> RouteContext:
    return RouteContext(rid, "m", tuple(range(start, start + n)))


def test_prefill_first_disaggregates_a_fresh_prompt() -> None:
    c = core()
    c.set_workers([w("p1", "prefill"), w("p2", "prefill"), w("d1", "decode")])
    plan = c.route(ctx("a", 300))
    assert plan.disaggregated and plan.prefill is not None
    assert plan.prefill.instance_id == "p1" and plan.worker.instance_id == "d1"
    assert c.route(ctx("b", 300, 10_000)).prefill.instance_id == "p2"  # type: ignore[union-attr]
    assert c.in_flight() == {"d1": 2, "p1": 1, "p2": 1}
    c.release("a")
    assert c.in_flight() == {"d1": 1, "p2": 1}


def test_conditional_bypass_when_d_already_holds_most_of_the_prompt() -> None:
    c = core()
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    first = c.route(ctx("a", 320))
    assert first.disaggregated and first.overlap_blocks == 0
    c.release("a")
    again = c.route(ctx("b", 330))  # same 10 blocks + 10 new tokens
    assert not again.disaggregated and again.overlap_blocks == 10
    assert "local prefill on D" in again.reason


def test_conditional_off_always_disaggregates() -> None:
    c = core(conditional=False)
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    c.route(ctx("a", 320))
    assert c.route(ctx("b", 330)).disaggregated


def test_overloaded_prefill_pool_is_bypassed() -> None:
    c = core(prefill_max_queue=2)
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    c.update_load("p1", num_running=1, num_waiting=1, kv_usage=0.5)
    plan = c.route(ctx("a", 500))
    assert not plan.disaggregated and "queue" in plan.reason


def test_decode_first_decider_uses_uncached_tokens_on_d() -> None:
    c = core(order="decode_first", decode_first_threshold=16)
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    assert c.route(ctx("a", 100)).disaggregated
    c.release("a")
    # 96 of 110 tokens cached on d1 → 14 uncached < 16 → D alone
    plan = c.route(ctx("b", 110))
    assert not plan.disaggregated and plan.overlap_blocks == 3
    short = c.route(ctx("c", 10, 50_000))
    assert not short.disaggregated  # 10 tokens < 16


def test_incompatible_pairs_are_refused_at_routing_time() -> None:
    c = core()
    c.set_workers([w("p1", "prefill", bs=64), w("d1", "decode", bs=32)])
    with pytest.raises(Incompatible, match="block sizes differ"):
        c.route(ctx("a", 300))
    c.set_workers([w("p1", "prefill", layout="f32"), w("d1", "decode", layout="bf16")])
    with pytest.raises(Incompatible, match="layouts differ"):
        c.route(ctx("b", 300))
    c.set_workers([w("p1", "prefill", mode="push"), w("d1", "decode", mode="pull")])
    with pytest.raises(Incompatible, match="modes differ"):
        c.route(ctx("c", 300))


def test_only_compatible_partners_are_chosen() -> None:
    c = core()
    c.set_workers([w("p1", "prefill", bs=64), w("p2", "prefill"), w("d1", "decode")])
    for i in range(3):
        plan = c.route(ctx(f"r{i}", 300, i * 1000))
        assert plan.prefill is not None and plan.prefill.instance_id == "p2"


def test_decode_without_prefill_pool_serves_alone() -> None:
    c = core()
    c.set_workers([w("d1", "decode")])
    plan = c.route(ctx("a", 300))
    assert not plan.disaggregated and "no prefill worker" in plan.reason


def test_an_sglang_decode_worker_is_never_planned_without_its_prefill() -> None:
    # SGLang's decode server only receives KV through its bootstrap: no local prefill
    sg = {"mode": "sglang", "layout": "sglang|L"}
    c = core()
    c.set_workers([w("p1", "prefill", **sg), w("d1", "decode", **sg)])
    c.route(ctx("a", 320))
    c.release("a")
    again = c.route(ctx("b", 330))  # D holds 10 of 11 blocks: vLLM's D would go alone
    assert again.disaggregated and "cannot prefill alone" in again.reason
    c.update_load("p1", num_running=9, num_waiting=9, kv_usage=0.5)
    assert c.route(ctx("c", 500, 9000)).disaggregated  # an overloaded P pool is no bypass
    first = core(order="decode_first", decode_first_threshold=16)
    first.set_workers([w("p1", "prefill", **sg), w("d1", "decode", **sg)])
    short = first.route(ctx("d", 10))
    assert short.disaggregated and "cannot prefill alone" in short.reason
    alone = core()
    alone.set_workers([w("d1", "decode", **sg)])
    with pytest.raises(Incompatible, match="d1 cannot prefill alone"):
        alone.route(ctx("e", 300))


def test_decision_functions() -> None:
    cfg = DisaggConfig()
    assert bypass_prefill(1000, 0, 32, 0, cfg)[0] is False
    assert bypass_prefill(1000, 30, 32, 0, cfg)[0] is True  # 40 uncached, ratio 0.04
    assert bypass_prefill(10000, 100, 32, 0, cfg)[0] is False  # 6800 uncached >= 2048
    assert decode_first_needs_prefill(40, 1, 32, 16) == (False, "local prefill on D: 8 tokens "
                                                         "not cached on D < 16")
    assert DisaggConfig(order="sideways").problems()


def test_prefill_done_ends_ps_share_so_its_queue_empties() -> None:
    """P's part of a disaggregated request ends at ``release_prefill``: counting it until
    the decode ended made a busy P look full, and conditional disaggregation then sent
    every prompt to D (the P/D collapse of issue 18)."""
    c = core(prefill_max_queue=2)
    c.set_workers([w("p1", "prefill"), w("d1", "decode")])
    for i in range(2):
        assert c.route(ctx(f"r{i}", 300, 10_000 * (i + 1))).disaggregated
        assert c.release_prefill(f"r{i}")  # P is done; both still decode on D
    assert c.in_flight() == {"d1": 2}
    assert c.active_blocks() == {"d1": 2 * 10}
    plan = c.route(ctx("r2", 300, 50_000))
    assert plan.disaggregated, plan.reason  # P's queue is empty: no bypass
    assert c.in_flight() == {"d1": 3, "p1": 1}
    c.route(ctx("r3", 300, 60_000))  # two in P's prefill now: P is full
    assert not c.route(ctx("r4", 300, 70_000)).disaggregated
    assert c.release("r0") and not c.release_prefill("r0")
    assert c.in_flight() == {"d1": 4, "p1": 2}
