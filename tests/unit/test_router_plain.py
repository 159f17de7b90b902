"""The router's compact decision (:mod:`services.router.plain`, taken by
``RouterServicer.route_now`` for the plain ``kv`` profile) against the general path: the
same answers, the same recorded state and the same random draws, over randomized fleets,
loads, indexes (tiers included), peers' shares, ties and releases; and where it does not
apply, the general path answers."""

from __future__ import annotations

import random
from typing import Any

import pytest

from protos import discovery_pb2, router_pb2
from services.common.block_hash import block_hashes
from services.indexer.core import TIERS, KvEvent, KvIndex
from services.router import plain
from services.router import service as service_mod
from services.router.core import RouterCore
from services.router.overlaps import EmbeddedSource, HistorySource
from services.router.peers import Share
from services.router.policy_setup import default_registry
from services.router.service import RouterServicer


@pytest.fixture(autouse=True)
def _unsampled(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process without a trace exporter: no span could record."""
    monkeypatch.setattr(service_mod, "may_record", lambda: False)


def _record(wid: str, block_size: int, role: Any = discovery_pb2.WORKER_ROLE_AGG,
            max_model_len: int = 4096) -> discovery_pb2.InstanceRecord:
    return discovery_pb2.InstanceRecord(
        instance_id=wid, component="worker", address=f"127.0.0.1:{9000 + int(wid[1:])}",
        model="m", role=role, block_size=block_size, max_model_len=max_model_len)


class _Pair:
    """Two routers fed alike: ``fast`` as shipped, ``slow`` with the compact decision off."""

    def __init__(self, seed: int, indexed: bool) -> None:
        self.sides: list[tuple[RouterServicer, KvIndex | None]] = []
        for _ in range(2):
            core = RouterCore(policy=default_registry().create("kv", random.Random(seed)),
                              clock=lambda: 100.0)
            index = KvIndex() if indexed else None
            source = EmbeddedSource(index) if index is not None else HistorySource()
            self.sides.append((RouterServicer(core, {}, source), index))
        self.slow.core.policy.plain_kv = None  # type: ignore[attr-defined]
        self.plain_calls = 0
        fast_core = self.fast.core

        def counted(core: RouterCore, *a: Any, **kw: Any) -> Any:
            plan = plain.route_plain(core, *a, **kw)
            if core is fast_core:
                self.plain_calls += plan is not None
            return plan
        self.counted = counted

    @property
    def fast(self) -> RouterServicer:
        return self.sides[0][0]

    @property
    def slow(self) -> RouterServicer:
        return self.sides[1][0]

    def each(self, fn: Any, *args: Any) -> list[Any]:
        """``fn(servicer, index, *args)`` on both sides (``args``: bound per call)."""
        return [fn(s, idx, *args) for s, idx in self.sides]

    def state(self, s: RouterServicer) -> tuple[Any, ...]:
        core = s.core
        return (dict(core._in_flight), dict(core._flight_counts), dict(core._flight_blocks),
                dict(core._pending), dict(core._prefills), set(core._stale),
                {w: list(lru) for w, lru in core.history._blocks.items()},
                core.policy.scorers[0][0].last_costs,  # type: ignore[attr-defined]
                core.policy.picker._rng.getstate())  # type: ignore[attr-defined]


def _route(s: RouterServicer, rid: str, tokens: list[int], max_tokens: int, salt: str
           ) -> tuple[str, Any]:
    try:
        resp = s.route_now(router_pb2.RouteRequest(request_id=rid, model="m",
                                                   max_tokens=max_tokens, cache_salt=salt),
                           tokens)
    except service_mod.Refused as exc:
        return "refused", (exc.code, exc.message)
    assert resp is not None
    return "ok", resp.SerializeToString(deterministic=True)


@pytest.mark.parametrize("seed", range(12))
def test_the_compact_decision_is_the_general_one(seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    pair = _Pair(seed, indexed=seed % 3 != 0)
    monkeypatch.setattr(service_mod, "route_plain", pair.counted)
    block_size = rng.choice([4, 16])
    n_workers = rng.randint(1, 4)
    records = {f"w{i}": _record(f"w{i}", block_size) for i in range(n_workers)}
    pair.each(lambda s, _: s.set_records(dict(records)))
    heads = [[rng.randrange(1, 500) for _ in range(block_size * rng.randint(1, 4))]
             for _ in range(3)]
    in_flight: list[str] = []
    event_ids = {w: 0 for w in records}
    for step in range(150):
        action = rng.random()
        wid = rng.choice(list(records))
        if action < 0.1:  # a load report
            args = (wid, rng.randint(0, 5), rng.randint(0, 3),
                    rng.choice([0.0, rng.random(), 1.0]), rng.choice([0, 64, 512]))
            pair.each(lambda s, _, a: s.core.update_load(*a), args)
        elif action < 0.2:  # the worker's index changes (a tier, or a removal)
            prompt = rng.choice(heads) + [rng.randrange(1, 500) for _ in range(block_size)]
            hashes = block_hashes(prompt, block_size)[:rng.randint(1, 3)]
            kind = "removed" if rng.random() < 0.2 else "stored"
            event = KvEvent(wid, event_ids[wid], kind, tuple(hashes), rng.choice(TIERS))
            event_ids[wid] += 1
            pair.each(lambda s, idx, e: idx.apply(e) if idx is not None else None, event)
        elif action < 0.25:  # a peer replica's shares
            shares = {w: Share(rng.randint(0, 3), rng.randint(0, 40)) for w in records
                      if rng.random() < 0.5}
            pair.each(lambda s, _, k, sh: s.core.set_peer("peer", k, sh), step, shares)
        elif action < 0.45 and in_flight:  # a release (marks the load report stale)
            rid = in_flight.pop(rng.randrange(len(in_flight)))
            pair.each(lambda s, _, r: s.release_now(r), rid)
        else:  # a request: a shared head or not, sometimes a repeated id or a long ask
            tokens = (rng.choice(heads) if rng.random() < 0.7 else []) + \
                [rng.randrange(1, 500) for _ in range(rng.randint(1, 2 * block_size))]
            rid = rng.choice(in_flight) if in_flight and rng.random() < 0.05 else f"r{step}"
            max_tokens = rng.choice([0, 1, 16, 5000])
            salt = rng.choice(["", "", "tenant"])
            fast, slow = pair.each(lambda s, _, *a: _route(s, *a), rid, tokens, max_tokens, salt)
            assert fast == slow, (step, fast, slow)
            if fast[0] == "ok":
                in_flight.append(rid)
        assert pair.state(pair.fast) == pair.state(pair.slow), step
    assert pair.plain_calls > 20  # the compact decision did decide


def test_ties_break_alike_by_tree_then_at_random(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = _Pair(7, indexed=True)
    monkeypatch.setattr(service_mod, "route_plain", pair.counted)
    records = {f"w{i}": _record(f"w{i}", 4) for i in range(4)}
    pair.each(lambda s, _: s.set_records(dict(records)))
    prompt = list(range(1, 17))
    event = KvEvent("w1", 0, "stored", tuple(block_hashes(prompt, 4)[:2]), "device")
    pair.each(lambda s, idx: idx.apply(event))
    answers = []
    for i in range(12):  # w1's tree is larger: ties among the others go at random
        fast, slow = pair.each(lambda s, _, k: _route(s, f"t{k}", [900 + k] * 8, 0, ""), i)
        assert fast == slow
        answers.append(router_pb2.RouteResponse.FromString(fast[1]).reason)
        pair.each(lambda s, _, k: s.release_now(f"t{k}"), i)
    assert any("broken at random" in r for r in answers)
    assert pair.plain_calls == 12


@pytest.mark.parametrize("case", ["pd", "mixed_block_sizes", "marked", "sampled", "excluded",
                                  "traced", "context"])
def test_where_the_compact_decision_does_not_apply_the_general_path_answers(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = "kv_sampled" if case == "sampled" else "kv"
    core = RouterCore(policy=default_registry().create(policy, random.Random(0)),
                      clock=lambda: 0.0)
    s = RouterServicer(core, {}, EmbeddedSource(KvIndex()))
    records = {"w0": _record("w0", 4), "w1": _record("w1", 4)}
    if case == "pd":
        records = {"w0": _record("w0", 4, discovery_pb2.WORKER_ROLE_DECODE),
                   "w1": _record("w1", 4, discovery_pb2.WORKER_ROLE_DECODE)}
    elif case == "mixed_block_sizes":
        records["w1"] = _record("w1", 8)
    elif case == "context":
        records["w1"] = _record("w1", 4, max_model_len=20)
    s.set_records(records)
    if case == "marked":
        core.report_failure("w0")
    if case == "traced":
        monkeypatch.setattr(service_mod, "may_record", lambda: True)
    called: list[Any] = []

    def spy(*a: Any, **k: Any) -> Any:
        called.append(a)
        return plain.route_plain(*a, **k)
    monkeypatch.setattr(service_mod, "route_plain", spy)
    req = router_pb2.RouteRequest(request_id="r", model="m", max_tokens=8)
    if case == "excluded":
        req.exclude_instance_ids.append("w0")
    resp = s.route_now(req, list(range(1, 17)))
    assert resp is not None and resp.worker.instance_id
    assert called == []
    if case in ("marked", "excluded"):
        assert resp.worker.instance_id == "w1"
    if case == "context":  # w1's context is too short for 16 + 8 tokens
        assert resp.worker.instance_id == "w0"


def test_a_request_already_in_flight_is_refused_as_before() -> None:
    core = RouterCore(policy=default_registry().create("kv", random.Random(0)),
                      clock=lambda: 0.0)
    s = RouterServicer(core, {}, EmbeddedSource(KvIndex()))
    s.set_records({"w0": _record("w0", 4)})
    assert _route(s, "r", [1, 2, 3, 4, 5], 0, "")[0] == "ok"
    kind, (code, message) = _route(s, "r", [1, 2, 3, 4, 5], 0, "")
    assert kind == "refused" and code.name == "ALREADY_EXISTS" and "already in flight" in message


def test_only_the_exact_plain_profile_takes_the_compact_decision() -> None:
    """A subclass may override what it computes: its profile keeps the policies' view."""
    from services.router.policies.plugins import KvCostScorer, SoftmaxPicker
    from services.router.policies.profile import Profile

    class Mine(KvCostScorer):
        pass

    rng = random.Random(0)
    assert Profile("a", [], [(KvCostScorer(), 1.0)], SoftmaxPicker(rng=rng)).plain_kv
    assert Profile("b", [], [(Mine(), 1.0)], SoftmaxPicker(rng=rng)).plain_kv is None
    assert Profile("c", [], [(KvCostScorer(), 2.0)], SoftmaxPicker(rng=rng)).plain_kv is None
    assert Profile("d", [], [(KvCostScorer(), 1.0)],
                   SoftmaxPicker(0.5, rng=rng)).plain_kv is None


@pytest.mark.parametrize("usage", [float("nan"), float("inf")])
def test_a_load_that_is_no_number_is_answered_alike(usage: float,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN drops out of the cost (the larger of it and the router's count is the count)
    on both paths; an infinite cost makes the compact decision give up, recording
    nothing, and the general path answer."""
    pair = _Pair(1, indexed=True)
    monkeypatch.setattr(service_mod, "route_plain", pair.counted)
    records = {f"w{i}": _record(f"w{i}", 4) for i in range(2)}
    pair.each(lambda s, _, r: s.set_records(dict(r)), records)
    pair.each(lambda s, _, u: s.core.update_load("w0", 1, 0, u, 64), usage)
    fast, slow = pair.each(lambda s, _: _route(s, "r", list(range(1, 17)), 0, ""))
    assert fast == slow
    assert pair.plain_calls == (0 if usage == float("inf") else 1)
    assert pair.state(pair.fast) == pair.state(pair.slow)
