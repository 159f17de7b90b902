"""The router core's resilience state: failure marks, per-request exclusion, the in-flight
TTL, duplicate ids and the context check. The clock is a manual one: no sleeps."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.common.perf_model import PolynomialPerfModel
from services.router.admission.core import AdmissionSettings
from services.router.admission.live import RouterAdmission
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.plan import AlreadyInFlight, InvalidRequest, NoWorkers, WorkerRecord
from services.router.policies.base import RouteContext
from services.router.policy_setup import default_registry
from tests.manual_clock import Clock

BS = 16


def w(i: str, role: str = "agg", pid: int = 100, max_len: int = 4096) -> WorkerRecord:
    mode = "" if role == "agg" else "pull"
    return WorkerRecord(i, f"addr-{i}", "m", role, BS, max_len, mode, "L", pid=pid)


def core(*workers: WorkerRecord, admission: RouterAdmission | None = None,
         failure_hold_s: float = 5.0, inflight_ttl_s: float = 600.0
         ) -> tuple[RouterCore, Clock]:
    reg = default_registry()
    clock = Clock()
    rng = random.Random(0)
    c = RouterCore(policy=reg.create("round_robin", rng),
                   prefill_policy=reg.create("round_robin", rng),
                   disagg=DisaggConfig(conditional=False), admission=admission,
                   clock=clock, failure_hold_s=failure_hold_s, inflight_ttl_s=inflight_ttl_s)
    c.set_workers(workers)
    return c, clock


def ctx(rid: str, n: int = 64, start: int = 0) -> RouteContext:
    return RouteContext(rid, "m", tuple(range(start, start + n)))


def picks(c: RouterCore, n: int, prefix: str = "r") -> set[str]:
    out = set()
    for i in range(n):
        out.add(c.route(ctx(f"{prefix}{i}")).worker.instance_id)
        c.release(f"{prefix}{i}")
    return out


def test_a_reported_worker_is_skipped_until_the_hold_passes() -> None:
    c, clock = core(w("w1"), w("w2"), failure_hold_s=5.0)
    assert c.report_failure("w1", "UNAVAILABLE: connection refused")
    assert not c.report_failure("nope")  # unknown: nothing marked
    assert c.unroutable() == {"w1": clock.t} and c.unroutable_count() == 1
    assert picks(c, 4) == {"w2"}
    clock.advance(4.9)
    assert picks(c, 4, "s") == {"w2"}
    clock.advance(0.2)
    assert c.unroutable() == {} and c.unroutable_count() == 0
    assert picks(c, 4, "t") == {"w1", "w2"}


def test_a_repeated_report_restarts_the_hold() -> None:
    c, clock = core(w("w1"), w("w2"), failure_hold_s=5.0)
    c.report_failure("w1")
    clock.advance(4.0)
    c.report_failure("w1")
    clock.advance(4.0)
    assert picks(c, 4) == {"w2"}


def test_re_registration_ends_the_mark_and_the_same_record_does_not() -> None:
    c, _ = core(w("w1"), w("w2"))
    c.report_failure("w1")
    c.set_workers([w("w1"), w("w2")])  # another worker's change: same record for w1
    assert picks(c, 4) == {"w2"}
    c.set_workers([w("w1", pid=101), w("w2")])  # restarted on the same address
    assert c.unroutable() == {}
    assert picks(c, 4, "s") == {"w1", "w2"}


def test_a_vanished_worker_loses_its_mark() -> None:
    c, _ = core(w("w1"), w("w2"))
    c.report_failure("w1")
    c.set_workers([w("w2")])
    c.set_workers([w("w1"), w("w2")])  # back (a new lease) with the same record
    assert c.unroutable() == {} and picks(c, 4) == {"w1", "w2"}


def test_all_marked_falls_back_to_the_least_recently_failed() -> None:
    c, clock = core(w("w1"), w("w2"), w("w3"))
    c.report_failure("w2")
    clock.advance(1.0)
    c.report_failure("w1")
    c.report_failure("w3")
    plan = c.route(ctx("a"))
    assert plan.worker.instance_id == "w2"
    assert "least recently failed" in plan.reason


def test_marked_prefill_workers_leave_d_to_prefill_locally() -> None:
    c, _ = core(w("p1", "prefill"), w("d1", "decode"))
    assert c.route(ctx("a", 300)).disaggregated
    c.report_failure("p1")
    plan = c.route(ctx("b", 300))
    assert not plan.disaggregated and plan.worker.instance_id == "d1"


def test_marked_decode_worker_is_skipped_for_another() -> None:
    c, _ = core(w("p1", "prefill"), w("d1", "decode"), w("d2", "decode"))
    c.report_failure("d1")
    for i in range(4):
        plan = c.route(ctx(f"r{i}", 300))
        assert plan.worker.instance_id == "d2" and plan.prefill is not None


def test_excluded_workers_are_never_picked_in_any_role() -> None:
    c, _ = core(w("p1", "prefill"), w("p2", "prefill"), w("d1", "decode"), w("d2", "decode"))
    for i in range(6):
        plan = c.route(ctx(f"r{i}", 300), exclude=["p1", "d2"])
        assert plan.worker.instance_id == "d1"
        assert plan.prefill is not None and plan.prefill.instance_id == "p2"
    plan = c.route(ctx("x", 300), exclude=["p1", "p2"])  # no P left: D prefills itself
    assert not plan.disaggregated
    with pytest.raises(NoWorkers, match=r"after excluding \['d1', 'd2'\]"):
        c.route(ctx("y", 300), exclude=["d1", "d2"])
    assert not c.release("y")  # a refused request is not in flight


def test_excluding_every_worker_is_unavailable_even_if_others_are_marked() -> None:
    c, _ = core(w("w1"), w("w2"))
    c.report_failure("w2")
    assert c.route(ctx("a"), exclude=["w1"]).worker.instance_id == "w2"  # last resort
    with pytest.raises(NoWorkers):
        c.route(ctx("b"), exclude=["w1", "w2"])


def test_in_flight_entries_expire_after_the_ttl() -> None:
    c, clock = core(w("p1", "prefill"), w("d1", "decode"), inflight_ttl_s=600.0)
    c.route(ctx("old", 300))
    clock.advance(300.0)
    c.route(ctx("new", 300, 10_000))
    assert c.in_flight_count() == 2 and c.pending_prefill() == {"p1": 600}
    clock.advance(300.0)
    assert c.expire_in_flight() == []  # exactly the TTL old: kept
    clock.advance(0.5)
    assert c.expire_in_flight() == ["old"]
    assert c.in_flight_count() == 1 and c.in_flight() == {"p1": 1, "d1": 1}
    assert c.pending_prefill() == {"p1": 300}
    assert not c.release("old")  # already dropped: a late Release finds nothing
    assert c.release("new") and not c.release("new")
    assert c.in_flight_count() == 0 and c.pending_prefill() == {}


def test_expiry_drops_the_admission_flight_too() -> None:
    adm = RouterAdmission("early", lambda cap: PolynomialPerfModel(cap or 10_000),
                          AdmissionSettings(itl_slo_ms=1000.0, ttft_slo_ms=100_000.0),
                          kv_capacity_tokens=10_000)
    c, clock = core(w("w1"), admission=adm, inflight_ttl_s=10.0)
    c.route(ctx("a"), max_tokens=10)
    assert [f.request_id for f in c.flights()] == ["a"]
    clock.advance(11.0)
    assert c.expire_in_flight() == ["a"]
    assert c.flights() == [] and c.in_flight_count() == 0


def test_a_request_id_in_flight_is_refused_until_released() -> None:
    c, _ = core(w("w1"))
    c.route(ctx("a"))
    with pytest.raises(AlreadyInFlight, match="request_id a is already in flight"):
        c.route(ctx("a"))
    assert c.in_flight_count() == 1
    assert c.release("a")
    c.route(ctx("a"))


def test_the_context_limit_is_the_largest_worker_and_smaller_ones_are_skipped() -> None:
    c, _ = core(w("w1", max_len=1024), w("w2", max_len=2048))
    assert c.context_limit("m") == 2048 and c.context_limit("other") == 0
    with pytest.raises(InvalidRequest, match=r"token_ids has 2049 tokens.*2048"):
        c.route(ctx("a", 2049))
    with pytest.raises(InvalidRequest, match=r"token_ids \(2000\) \+ max_tokens \(100\)"):
        c.route(ctx("b", 2000), max_tokens=100)
    assert c.in_flight_count() == 0
    for i in range(3):  # only w2 holds 1500 tokens
        assert c.route(ctx(f"r{i}", 1500)).worker.instance_id == "w2"
    c.check_request("m", 2048)  # the limit itself fits


def test_unknown_context_length_means_no_limit() -> None:
    c, _ = core(dataclasses.replace(w("w1"), max_model_len=0))
    assert c.route(ctx("a", 10_000)).worker.instance_id == "w1"


def test_per_worker_totals_follow_every_route_and_release() -> None:
    """in_flight() and active_blocks() are kept as entries come and go; after any mix of
    routes (agg and P/D), prefill ends, releases, expiries and repeated releases they
    equal the totals summed over the requests still in flight."""
    c, clock = core(w("a1"), w("a2"), w("p1", "prefill"), w("d1", "decode"),
                    w("d2", "decode"), inflight_ttl_s=50.0)
    rng = random.Random(7)
    live: dict[str, dict[str, int]] = {}  # request id -> worker id -> blocks
    for i in range(400):
        clock.t += 1.0
        op = rng.random()
        if op < 0.5 or not live:
            rid = f"r{i}"
            n = rng.randint(1, 200)
            plan = c.route(ctx(rid, n, start=rng.randint(0, 3) * 1000))
            live[rid] = {plan.worker.instance_id: -(-n // BS)}
            if plan.prefill is not None:
                live[rid][plan.prefill.instance_id] = -(-n // BS)
        elif op < 0.7:
            rid = rng.choice(sorted(live))
            c.release_prefill(rid)
            c.release_prefill(rid)  # a second end of the prefill changes nothing
            keep = next(iter(live[rid]))  # D (or the agg worker) stays
            live[rid] = {keep: live[rid][keep]}
        else:
            rid = rng.choice(sorted(live))
            assert c.release(rid) and not c.release(rid)
            del live[rid]
        if i % 97 == 96:  # entries older than the TTL go
            for rid in c.expire_in_flight():
                del live[rid]
        counts: dict[str, int] = {}
        blocks: dict[str, int] = {}
        for workers in live.values():
            for wid, nb in workers.items():
                counts[wid] = counts.get(wid, 0) + 1
                blocks[wid] = blocks.get(wid, 0) + nb
        assert dict(c.in_flight()) == counts and dict(c.active_blocks()) == blocks
