"""Router replica sync in the pure core: peers' in-flight shares count as load, snapshots
replace each other by sequence number, and a peer that leaves or goes silent stops
counting. The clock is a manual one: no sleeps."""

from __future__ import annotations

import random

import pytest

from protos import router_pb2
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.peers import PeerLoads, Share
from services.router.plan import WorkerRecord
from services.router.policies.base import RouteContext
from services.router.policy_setup import default_registry
from services.router.replica_sync import decode_shares, encode_load
from tests.manual_clock import Clock

BS = 16


def w(i: str, role: str = "agg") -> WorkerRecord:
    return WorkerRecord(i, f"addr-{i}", "m", role, BS, 4096, "" if role == "agg" else "pull",
                        "L")


def core(*workers: WorkerRecord, policy: str = "least_loaded") -> tuple[RouterCore, Clock]:
    clock = Clock()
    reg = default_registry()
    c = RouterCore(policy=reg.create(policy, random.Random(0)),
                   prefill_policy=reg.create("least_loaded", random.Random(0)),
                   disagg=DisaggConfig(conditional=False), clock=clock)
    c.set_workers(workers)
    return c, clock


def ctx(rid: str, n: int = 64, start: int = 0) -> RouteContext:
    return RouteContext(rid, "m", tuple(range(start, start + n)))


def test_two_replicas_in_sync_spread_requests_that_one_alone_would_pile_up() -> None:
    a, _ = core(w("w0"), w("w1"))
    b, _ = core(w("w0"), w("w1"))
    # without sync both pick the same idle worker for their first request
    first_a = a.route(ctx("a1")).worker.instance_id
    assert b.route(ctx("b1")).worker.instance_id == first_a
    b.release("b1")
    # with A's shares applied, B sees A's request and takes the other worker
    assert b.set_peer("A", 1, a.local_shares())
    assert b.in_flight() == {first_a: 1}
    assert b.route(ctx("b2")).worker.instance_id != first_a


def test_local_shares_count_requests_blocks_pending_prefill_and_decoding_alone() -> None:
    c, _ = core(w("p", "prefill"), w("d", "decode"))
    c.route(ctx("r1", n=64))
    assert c.local_shares() == {"d": Share(1, 4, 0, 0), "p": Share(1, 4, 64, 0)}
    c.release_prefill("r1")  # P's part is over; D decodes alone
    assert c.local_shares() == {"d": Share(1, 4, 0, 1)}
    c.release("r1")
    assert c.local_shares() == {}


def test_peer_shares_add_to_in_flight_blocks_and_pending_prefill() -> None:
    c, _ = core(w("w0"), w("w1"))
    assert {c.route(ctx(r, n=32)).worker.instance_id for r in ("r1", "r2")} == {"w0", "w1"}
    c.set_peer("A", 1, {"w0": Share(2, 10, 100, 0)})
    c.set_peer("B", 1, {"w0": Share(1, 1, 0, 0)})
    assert c.in_flight() == {"w0": 4, "w1": 1}
    assert c.active_blocks() == {"w0": 2 + 11, "w1": 2}
    assert c.pending_prefill() == {"w0": 32 + 100, "w1": 32}
    assert c.in_flight_count() == 2  # this router's own requests only
    assert c.peers.replicas() == ["A", "B"]


def test_an_older_snapshot_is_ignored_and_a_newer_one_replaces() -> None:
    c, _ = core(w("w0"))
    assert c.set_peer("A", 5, {"w0": Share(3, 3, 0, 0)})
    assert not c.set_peer("A", 4, {"w0": Share(9, 9, 0, 0)})
    assert not c.set_peer("A", 5, {"w0": Share(9, 9, 0, 0)})
    assert c.in_flight() == {"w0": 3}
    assert c.set_peer("A", 6, {})
    assert c.in_flight() == {}


def test_a_silent_peer_expires_and_a_leaving_one_is_dropped() -> None:
    c, clock = core(w("w0"))
    c.set_peer("A", 1, {"w0": Share(1, 1, 0, 0)})
    c.set_peer("B", 1, {"w0": Share(2, 2, 0, 0)})
    clock.advance(2.0)
    c.set_peer("B", 2, {"w0": Share(2, 2, 0, 0)})  # B keeps talking
    clock.advance(1.5)
    assert c.expire_peers(3.0) == ["A"]
    assert c.in_flight() == {"w0": 2}
    assert c.drop_peer("B") and not c.drop_peer("B")
    assert c.in_flight() == {}


def test_a_peer_release_makes_the_workers_load_report_stale() -> None:
    c, _ = core(w("w0"))
    c.update_load("w0", 1, 0, 0.5, 100)
    c.set_peer("A", 1, {"w0": Share(1, 1, 0, 0)})
    assert "w0" not in c._stale
    c.set_peer("A", 2, {})
    assert "w0" in c._stale  # the report may still count A's released request


def test_workers_leaving_discovery_drop_their_peer_shares() -> None:
    c, _ = core(w("w0"), w("w1"))
    c.set_peer("A", 1, {"w0": Share(1, 1, 0, 0), "w1": Share(1, 1, 0, 0)})
    c.set_workers([w("w1")])
    assert c.in_flight() == {"w1": 1}


def test_a_peers_share_of_a_worker_not_yet_discovered_counts_once_it_is() -> None:
    c, _ = core(w("w0"))
    c.set_peer("A", 1, {"w0": Share(1, 1, 0, 0), "w1": Share(2, 2, 0, 0)})
    c.set_workers([w("w0"), w("w1")])  # w1 registers here after A routed to it
    assert c.route(ctx("r1")).worker.instance_id == "w0"  # w0: 1 in flight, w1: 2


def test_on_change_is_called_for_each_own_change() -> None:
    c, _ = core(w("w0"))
    calls: list[int] = []
    c.on_change = lambda: calls.append(1)
    c.route(ctx("r1"))
    n = len(calls)
    assert n >= 1
    c.release("r1")
    assert len(calls) > n
    before = len(calls)
    c.set_peer("A", 1, {"w0": Share(1, 1, 0, 0)})  # a peer's change is not this router's
    assert len(calls) == before


def test_peer_loads_table_sums_replicas_per_worker() -> None:
    t = PeerLoads()
    t.update("A", 1, {"w0": Share(1, 2, 3, 4)}, 0.0)
    t.update("B", 1, {"w0": Share(1, 1, 1, 1), "w1": Share(2, 0, 0, 0)}, 0.0)
    assert t.totals() == {"w0": Share(2, 3, 4, 5), "w1": Share(2, 0, 0, 0)}
    assert t.count() == 2


def test_the_wire_message_round_trips() -> None:
    shares = {"w0": Share(1, 2, 3, 4), "w1": Share(5, 6, 7, 8)}
    msg = router_pb2.ReplicaLoad.FromString(
        encode_load("A", 7, shares).SerializeToString())
    assert (msg.replica_id, msg.seq, msg.leaving) == ("A", 7, False)
    assert decode_shares(msg) == shares
    assert encode_load("A", 8, {}, leaving=True).leaving


def test_a_late_snapshot_of_a_replica_that_left_or_expired_does_not_bring_it_back() -> None:
    c, clock = core(w("w0"))
    c.set_peer("A", 3, {"w0": Share(1, 1, 0, 0)})
    assert c.drop_peer("A", 5)  # its leaving message, seq 5
    assert not c.set_peer("A", 4, {"w0": Share(1, 1, 0, 0)})  # sent before it left
    assert c.in_flight() == {} and c.peers.count() == 0
    c.set_peer("B", 7, {"w0": Share(1, 1, 0, 0)})
    clock.advance(10)
    assert c.expire_peers(3.0) == ["B"]
    assert not c.set_peer("B", 7, {"w0": Share(1, 1, 0, 0)})  # a replayed old one
    assert c.set_peer("B", 8, {"w0": Share(2, 2, 0, 0)})  # it is alive after all
    assert c.in_flight() == {"w0": 2}


def test_replica_sync_with_admission_control_is_refused_by_name() -> None:
    from services.common.config import ConfigError, load_config
    from services.router.main import RouterConfig

    with pytest.raises(ConfigError, match="--replica-sync with --admission early is not "
                                          "supported"):
        load_config(RouterConfig, ["--replica-sync", "--redis-url", "redis://x:1",
                                   "--admission", "early"], {})
    with pytest.raises(ConfigError, match="--replica-sync needs --redis-url"):
        load_config(RouterConfig, ["--replica-sync"], {})
    assert load_config(RouterConfig, ["--replica-sync", "--redis-url", "redis://x:1"],
                       {}).replica_sync
