"""Store master pure core with an injected clock: states, leases, pins, eviction, zombies,
client liveness, placement and persistence. No sleeps, no network."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

import services.store_master.core
from services.store_master.core import (
    AlreadyExists,
    Changes,
    ErrorKind,
    Forbidden,
    IllegalTransition,
    InvalidInput,
    Leased,
    LruPolicy,
    MasterParams,
    NoSpace,
    NotFound,
    NotReady,
    Pin,
    Replica,
    ReplicaState,
    StoreError,
    StoreMaster,
    WrongState,
    decode,
    encode,
    make_strategy,
)
from tests.manual_clock import Clock


def make(clock: Clock, segments: int = 1, size: int = 1000, strategy: str = "random",
         **params: float) -> StoreMaster:
    """A master with ``segments`` segments of ``size`` bytes; clients never time out unless
    ``client_ttl_s`` is given (tests that advance the clock do not want to ping)."""
    params.setdefault("client_ttl_s", 1e9)
    m = StoreMaster(clock, random.Random(0), MasterParams(**params),  # type: ignore[arg-type]
                    strategy=make_strategy(strategy, random.Random(0)), eviction=LruPolicy())
    for i in range(segments):
        m.mount_segment(f"c{i}", f"s{i}", base=(i + 1) << 20, size=size,
                        endpoint=f"agent-{i}")
    return m


def put(m: StoreMaster, key: str, size: int = 10, replicas: int = 1,
        pin: Pin = Pin.NONE) -> None:
    m.put_start(key, size, replicas=replicas, pin=pin)
    m.put_end(key)


# -- states ------------------------------------------------------------------------------


def test_never_served_before_complete() -> None:
    clock = Clock()
    m = make(clock)
    descs = m.put_start("k", 100)
    assert [d.state for d in descs] == [ReplicaState.PROCESSING]
    assert descs[0].client_id == "c0" and descs[0].endpoint == "agent-0"
    assert descs[0].address == (1 << 20) + descs[0].offset and descs[0].size == 100
    assert not m.exist_key("k")
    with pytest.raises(NotReady):
        m.get_replica_list("k")
    with pytest.raises(NotReady):
        m.remove("k")
    done = m.put_end("k")
    assert [d.state for d in done] == [ReplicaState.COMPLETE]
    assert m.exist_key("k")
    assert m.get_replica_list("k") == done
    assert m.put_end("k") == done  # idempotent


def test_replica_transitions_follow_the_table() -> None:
    r = Replica("s", 0, 1)
    r.move(ReplicaState.PROCESSING)
    with pytest.raises(IllegalTransition):
        r.move(ReplicaState.INITIALIZED)
    r.move(ReplicaState.COMPLETE)
    r.move(ReplicaState.REMOVED)
    for s in ReplicaState:
        with pytest.raises(IllegalTransition):
            r.move(s)
    r2 = Replica("s", 0, 1)
    with pytest.raises(IllegalTransition):
        r2.move(ReplicaState.COMPLETE)  # INITIALIZED cannot skip PROCESSING


def test_put_errors() -> None:
    clock = Clock()
    m = make(clock, segments=2, size=100, max_replicas=4)
    with pytest.raises(InvalidInput):
        m.put_start("", 10)
    with pytest.raises(InvalidInput):
        m.put_start("k", 0)
    with pytest.raises(InvalidInput):
        m.put_start("k", 10, replicas=0)
    with pytest.raises(InvalidInput):
        m.put_start("k", 10, replicas=5)
    with pytest.raises(InvalidInput):
        m.put_start("x" * 5000, 10)
    with pytest.raises(NoSpace):
        m.put_start("big", 101)
    m.put_start("k", 10)
    with pytest.raises(AlreadyExists, match="being written"):
        m.put_start("k", 10)
    m.put_end("k")
    with pytest.raises(AlreadyExists, match="complete"):
        m.put_start("k", 10)
    for op in (m.put_end, m.put_revoke, m.remove, m.get_replica_list):
        with pytest.raises(NotFound):
            op("nope")
    assert m.stats().counters.allocation_failures == 1


def test_revoke_frees_space_and_refuses_complete_objects() -> None:
    clock = Clock()
    m = make(clock)
    m.put_start("k", 600)
    m.put_revoke("k")
    assert m.used() == 0 and m.get_object("k") is None
    with pytest.raises(NotFound):
        m.put_end("k")
    put(m, "k", 600)
    with pytest.raises(WrongState):
        m.put_revoke("k")


# -- placement ---------------------------------------------------------------------------


def test_replicas_go_to_distinct_segments_best_effort() -> None:
    clock = Clock()
    m = make(clock, segments=3, size=100)
    descs = m.put_start("k", 60, replicas=3)
    assert sorted(d.segment_id for d in descs) == ["s0", "s1", "s2"]
    # Only two segments can hold another 60 bytes? None can: each has 40 left.
    with pytest.raises(NoSpace):
        m.put_start("k2", 60, replicas=2)
    descs = m.put_start("k3", 30, replicas=5)  # best effort: 3 segments → 3 replicas
    assert len({d.segment_id for d in descs}) == 3
    assert m.get_object("k3").replicas_wanted == 5  # type: ignore[union-attr]
    m.put_end("k3")
    assert len(m.get_replica_list("k3")) == 3


def test_best_effort_uses_only_segments_with_room() -> None:
    clock = Clock()
    m = make(clock, segments=3, size=100)
    m.put_start("fill", 90, preferred_segment="s1")
    descs = m.put_start("k", 50, replicas=3)
    assert sorted(d.segment_id for d in descs) == ["s0", "s2"]


def test_free_ratio_first_spreads_over_segments() -> None:
    clock = Clock()
    m = make(clock, segments=3, size=1000, strategy="free_ratio_first")
    for i in range(9):
        m.put_start(f"k{i}", 100)
    assert [m.segment(f"s{i}").space.used for i in range(3)] == [300, 300, 300]  # type: ignore[union-attr]


def test_preferred_segment_goes_first() -> None:
    clock = Clock()
    m = make(clock, segments=4, size=1000)
    for i in range(10):
        (d,) = m.put_start(f"k{i}", 10, preferred_segment="s2")
        assert d.segment_id == "s2"
    descs = m.put_start("multi", 10, replicas=2, preferred_segment="s3")
    assert descs[0].segment_id == "s3" and descs[1].segment_id != "s3"


def test_random_strategy_spreads_roughly_evenly() -> None:
    clock = Clock()
    m = make(clock, segments=4, size=100_000)
    for i in range(400):
        m.put_start(f"k{i}", 10)
    used = [m.segment(f"s{i}").space.used for i in range(4)]  # type: ignore[union-attr]
    assert sum(used) == 4000 and min(used) > 600


# -- leases ------------------------------------------------------------------------------


def test_lease_blocks_removal_until_it_expires() -> None:
    clock = Clock()
    m = make(clock)
    put(m, "k")
    m.remove("k")  # no lease yet: put_end grants none
    put(m, "k")
    m.get_replica_list("k")
    clock.advance(9.9)
    with pytest.raises(Leased, match="leased"):
        m.remove("k")
    clock.advance(0.1)  # exactly 10 s after the read
    m.remove("k")
    assert not m.exist_key("k")


def test_exist_key_leases_and_each_read_extends() -> None:
    clock = Clock()
    m = make(clock)
    put(m, "k")
    assert m.exist_key("k")
    clock.advance(8)
    assert m.batch_exist_key(["k", "nope"]) == [True, False]  # extends to t+18
    clock.advance(8)
    with pytest.raises(Leased):
        m.remove("k")
    assert m.remove_all() == 0
    clock.advance(2)
    assert m.remove_all() == 1


def test_lease_blocks_eviction_and_then_expires() -> None:
    clock = Clock()
    m = make(clock, size=100)
    for i in range(9):
        put(m, f"k{i}")
        clock.advance(1)
    for i in range(9):
        m.get_replica_list(f"k{i}")
    assert m.tick().objects_evicted == 0  # 90 % used, all leased
    assert m.used() == 90
    clock.advance(10)
    rep = m.tick()
    assert rep.objects_evicted == 1 and m.used() == 80


# -- pins --------------------------------------------------------------------------------


def test_soft_pin_expires_after_its_ttl_and_reads_refresh_it() -> None:
    clock = Clock()
    m = make(clock)
    put(m, "k", pin=Pin.SOFT)
    obj = m.get_object("k")
    assert obj is not None and obj.pin is Pin.SOFT and obj.soft_pin_until == clock.t + 1800
    clock.advance(1000)
    m.exist_key("k")  # refresh to now + 30 min
    clock.advance(1799)
    assert m.tick().soft_pins_expired == 0
    clock.advance(1)
    assert m.tick().soft_pins_expired == 1
    assert m.get_object("k").pin is Pin.NONE  # type: ignore[union-attr]


def test_set_pin_and_pins_do_not_block_remove() -> None:
    clock = Clock()
    m = make(clock)
    put(m, "k")
    m.set_pin("k", Pin.HARD)
    assert m.get_object("k").pin is Pin.HARD  # type: ignore[union-attr]
    m.remove("k")
    with pytest.raises(NotFound):
        m.set_pin("k", Pin.SOFT)


# -- eviction ----------------------------------------------------------------------------


def fill(m: StoreMaster, clock: Clock, n: int, size: int = 10, prefix: str = "k",
         pin: Pin = Pin.NONE) -> None:
    for i in range(n):
        put(m, f"{prefix}{i}", size, pin=pin)
        clock.advance(1)


def test_no_eviction_below_the_watermark() -> None:
    clock = Clock()
    m = make(clock, size=1000)
    fill(m, clock, 89)
    assert m.tick().objects_evicted == 0 and m.used() == 890


def test_watermark_eviction_frees_the_ratio_oldest_first() -> None:
    clock = Clock()
    m = make(clock, size=1000)
    fill(m, clock, 90)  # 900 of 1000 = the 0.90 watermark
    m.exist_key("k0")  # leased
    clock.advance(1)
    m.get_replica_list("k1")  # leased
    clock.advance(11)  # leases over, but k0 and k1 are now the most recently used
    rep = m.tick()
    # 5 % of 1000 = 50 bytes = the 5 least recently used objects: k2..k6.
    assert rep.objects_evicted == 5 and rep.bytes_evicted == 50
    assert m.keys() == sorted([f"k{i}" for i in range(90) if not 2 <= i <= 6])
    assert m.used() == 850
    assert m.tick().objects_evicted == 0


def test_eviction_skips_leased_hard_pinned_and_incomplete() -> None:
    clock = Clock()
    m = make(clock, size=100)
    m.put_start("w0", 10)
    m.put_start("w1", 10)  # incomplete (oldest)
    fill(m, clock, 3, prefix="h", pin=Pin.HARD)
    fill(m, clock, 3, prefix="l")
    fill(m, clock, 1, prefix="x")
    for i in range(3):
        m.exist_key(f"l{i}")
    rep = m.tick()  # 90 % used; need 5 bytes: only x0 is eligible
    assert rep.objects_evicted == 1 and m.get_object("x0") is None
    assert m.tick().objects_evicted == 0  # 80 %


def test_eviction_takes_soft_pinned_only_after_unpinned() -> None:
    clock = Clock()
    m = make(clock, size=100)
    fill(m, clock, 5, prefix="s", pin=Pin.SOFT)  # the oldest are soft-pinned
    fill(m, clock, 4, prefix="u")
    rep = m.tick(clock.t)
    assert rep.objects_evicted == 1 and m.get_object("u0") is None
    fill(m, clock, 1, prefix="n")  # 90 % again; unpinned u1..u3 and n0 remain
    m.exist_key("u1"), m.exist_key("u2"), m.exist_key("u3"), m.exist_key("n0")
    rep = m.tick()  # every unpinned object is leased: a soft-pinned one goes
    assert rep.objects_evicted == 1 and m.get_object("s0") is None


def test_eviction_above_the_watermark_goes_back_below_it() -> None:
    clock = Clock()
    m = make(clock, size=100, eviction_ratio=0.01)
    fill(m, clock, 10, size=10)  # 100 % used
    rep = m.tick()
    assert rep.bytes_evicted == 10 and m.used() == 90  # max(1, 100 - 90) bytes → 1 object


def test_put_start_evicts_when_nothing_fits() -> None:
    clock = Clock()
    m = make(clock, size=100)
    fill(m, clock, 10, size=10)
    m.exist_key("k0")
    descs = m.put_start("new", 10)
    assert descs and m.get_object("k1") is None and m.get_object("k0") is not None
    assert m.stats().counters.objects_evicted == 1
    for i in range(2, 10):
        m.exist_key(f"k{i}")
    with pytest.raises(NoSpace):  # everything leased or incomplete
        m.put_start("new2", 10)


def test_sampled_lru_master_evicts_about_the_oldest() -> None:
    clock = Clock()
    m = StoreMaster(clock, random.Random(5), MasterParams(client_ttl_s=1e9))  # defaults
    m.mount_segment("c", "s", 0, 10_000)
    fill(m, clock, 900, size=10)
    rep = m.tick()
    assert rep.bytes_evicted == 500
    evicted = [i for i in range(900) if m.get_object(f"k{i}") is None]
    assert len(evicted) == 50 and sum(evicted) / 50 < 300


# -- zombies and clients -----------------------------------------------------------------


def test_zombie_puts_are_reclaimed_after_the_timeout() -> None:
    clock = Clock()
    m = make(clock)
    m.put_start("z", 100)
    clock.advance(10)
    m.put_start("y", 100)
    put(m, "done", 100)
    clock.advance(19.9)
    assert m.tick().zombies_reclaimed == 0
    clock.advance(0.1)
    assert m.tick().zombies_reclaimed == 1
    assert m.keys() == ["done", "y"] and m.used() == 200
    with pytest.raises(NotFound):
        m.put_end("z")
    clock.advance(10)
    assert m.tick().zombies_reclaimed == 1 and m.keys() == ["done"]
    assert m.stats().counters.zombies_reclaimed == 2


def test_client_that_stops_pinging_loses_segments_and_replicas() -> None:
    clock = Clock()
    m = make(clock, segments=2, size=100, client_ttl_s=10)
    put(m, "both", replicas=2)
    m.put_start("only0", 10, preferred_segment="s0")
    m.put_end("only0")
    m.put_start("pending0", 10, preferred_segment="s0")
    m.exist_key("only0")  # leased: lost anyway, the bytes are gone
    clock.advance(6)
    assert m.ping("c1")
    clock.advance(4)
    rep = m.tick()
    assert rep.clients_lost == ("c0",)
    assert m.keys() == ["both"]
    assert [d.segment_id for d in m.get_replica_list("both")] == ["s1"]
    with pytest.raises(NotFound):
        m.put_end("pending0")
    assert not m.ping("c0")  # unknown now: the client must remount
    s = m.stats()
    assert (s.segments, s.clients, s.capacity, s.used) == (1, 1, 100, 10)
    assert (s.counters.replicas_lost, s.counters.objects_lost) == (3, 2)
    clock.advance(5.9)  # c1 pinged 10 s before its deadline ...
    assert m.tick().clients_lost == ()
    clock.advance(0.1)
    assert m.tick().clients_lost == ("c1",) and m.keys() == []


def test_mount_and_unmount() -> None:
    clock = Clock()
    m = make(clock, segments=0)
    assert m.mount_segment("c", "s", 0, 100)
    assert not m.mount_segment("c", "s", 0, 100)  # remount: no-op
    with pytest.raises(AlreadyExists):
        m.mount_segment("other", "s", 0, 100)
    with pytest.raises(AlreadyExists):
        m.mount_segment("c", "s", 0, 200)
    for bad in (("", "s2", 0, 1), ("c", "", 0, 1), ("c", "s2", -1, 1), ("c", "s2", 0, 0)):
        with pytest.raises(InvalidInput):
            m.mount_segment(*bad)
    m.mount_segment("c", "t", 0, 100)
    put(m, "k", replicas=2)
    with pytest.raises(NotFound):
        m.unmount_segment("other", "s")
    rep = m.unmount_segment("c", "s")
    assert rep.replicas_lost == 1 and rep.objects_lost == ()
    assert m.ping("c")
    rep = m.unmount_segment("c", "t")
    assert rep.objects_lost == ("k",)
    assert not m.ping("c") and m.stats().clients == 0


def test_mount_keeps_client_alive() -> None:
    clock = Clock()
    m = make(clock, segments=1, client_ttl_s=10)
    clock.advance(9)
    m.mount_segment("c0", "s0", 1 << 20, 1000)  # remount counts as a sign of life
    clock.advance(9)
    assert m.tick().clients_lost == ()


# -- persistence -------------------------------------------------------------------------


class FakeKv:
    """Stands in for the Redis hashes: applies drained changes."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.segments: dict[str, bytes] = {}

    def apply(self, ch: Changes) -> None:
        for table, updates in ((self.objects, ch.objects), (self.segments, ch.segments)):
            for k, rec in updates.items():
                if rec is None:
                    table.pop(k, None)
                else:
                    table[k] = encode(rec)

    def restore_into(self, m: StoreMaster):  # type: ignore[no-untyped-def]
        return m.restore([decode(v) for v in self.segments.values()],
                         [decode(v) for v in self.objects.values()])


def test_drained_changes_keep_a_store_equal_to_the_snapshot() -> None:
    clock = Clock()
    m = make(clock, segments=3, size=200)
    kv = FakeKv()
    rng = random.Random(11)
    for step in range(400):
        op = rng.random()
        key = f"k{rng.randrange(30)}"
        try:
            if op < 0.35:
                m.put_start(key, rng.randint(1, 40), replicas=rng.randint(1, 3))
            elif op < 0.6:
                m.put_end(key)
            elif op < 0.7:
                m.put_revoke(key)
            elif op < 0.8:
                m.remove(key)
            elif op < 0.85:
                m.set_pin(key, rng.choice(list(Pin)))
            elif op < 0.9:
                m.exist_key(key)
            else:
                clock.advance(rng.uniform(0, 5))
                m.tick()
                m.ping("c0"), m.ping("c1"), m.ping("c2")
        except Exception as exc:  # noqa: BLE001 - refusals are part of the model
            assert exc.__class__.__name__ in {"NotFound", "AlreadyExists", "WrongState",
                                              "NotReady", "Leased", "NoSpace"}, exc
        if step % 7 == 0:
            kv.apply(m.drain_changes())
    kv.apply(m.drain_changes())
    snap = m.snapshot()

    def durable(rec: dict) -> dict:  # type: ignore[type-arg]
        # Read-refreshed fields are not journaled (restore re-derives them).
        return {k: v for k, v in rec.items() if k not in ("last_access", "soft_pin_until")}

    assert {k: durable(decode(v)) for k, v in kv.objects.items()} == \
        {k: durable(v) for k, v in snap.objects.items() if v is not None}
    assert {k: decode(v) for k, v in kv.segments.items()} == snap.segments
    assert not m.drain_changes()


def test_restart_restores_metadata_allocations_and_conservative_leases() -> None:
    clock = Clock()
    m = make(clock, segments=2, size=1000)
    kv = FakeKv()
    put(m, "a", 100, replicas=2)
    put(m, "soft", 50, pin=Pin.SOFT)
    m.put_start("hard", 50, pin=Pin.HARD, preferred_segment="s0")
    m.put_end("hard")
    m.put_start("pending", 30)
    kv.apply(m.drain_changes())
    before = {k: m.get_object(k) for k in m.keys()}
    used = [m.segment(s).space.free_runs() for s in ("s0", "s1")]  # type: ignore[union-attr]

    clock.advance(100)  # master down for a while; clients keep their segments
    m2 = make(clock, segments=0, client_ttl_s=10)
    rep = kv.restore_into(m2)
    assert (rep.segments, rep.objects, rep.replicas_dropped, rep.objects_dropped) == \
        (2, 4, 0, 0)
    assert m2.keys() == sorted(before)
    for k, old in before.items():
        new = m2.get_object(k)
        assert new is not None and old is not None
        assert (new.size, new.replicas, new.pin, new.completed_at, new.put_started_at) == \
            (old.size, old.replicas, old.pin, old.completed_at, old.put_started_at)
    assert [m2.segment(s).space.free_runs() for s in ("s0", "s1")] == used  # type: ignore[union-attr]
    assert m2.get_replica_list("a") == m.get_replica_list("a")
    # Reads before the crash were not persisted: every complete object gets a lease.
    with pytest.raises(Leased):
        m2.remove("hard")
    assert m2.get_object("soft").soft_pin_until == clock.t + 1800  # type: ignore[union-attr]
    # The pending put already ran 100 s: reclaimed as a zombie on the first tick.
    assert m2.tick().zombies_reclaimed == 1
    # Clients have a full TTL to ping again; a silent one is lost.
    clock.advance(5)
    assert m2.ping("c0")
    clock.advance(5)
    assert m2.tick().clients_lost == ("c1",)
    clock.advance(10)
    m2.remove("hard")
    assert "a" in m2.keys() and set(m2.keys()) <= {"a", "soft"}


def test_a_segment_belongs_to_its_principal_across_a_restart() -> None:
    clock = Clock()
    m = make(clock, segments=0)
    m.mount_segment("ca", "sa", base=1 << 20, size=100, principal="worker/a")
    with pytest.raises(Forbidden, match="segment_id: 'sa' belongs to worker/a, not worker/b"):
        m.unmount_segment("ca", "sa", principal="worker/b")
    with pytest.raises(Forbidden):  # nor a remount of it, even with its geometry
        m.mount_segment("ca", "sa", base=1 << 20, size=100, principal="worker/b")
    with pytest.raises(Forbidden, match="not an unauthenticated caller"):
        m.unmount_segment("ca", "sa")
    kv = FakeKv()
    kv.apply(m.drain_changes())
    m2 = make(clock, segments=0)
    kv.restore_into(m2)  # the principal is durable
    with pytest.raises(Forbidden):
        m2.unmount_segment("ca", "sa", principal="worker/b")
    assert m2.mount_segment("ca", "sa", base=1 << 20, size=100, principal="worker/a") is False
    assert m2.unmount_segment("ca", "sa", principal="worker/a").replicas_lost == 0
    # a segment recorded without one (mounted without mTLS) is claimed by the first remount
    m2.mount_segment("cb", "sb", base=1 << 21, size=100)
    with pytest.raises(AlreadyExists):  # a remount that does not match claims nothing
        m2.mount_segment("cx", "sb", base=1 << 21, size=100, principal="worker/x")
    m2.mount_segment("cb", "sb", base=1 << 21, size=100, principal="worker/c")
    with pytest.raises(Forbidden):
        m2.unmount_segment("cb", "sb", principal="worker/a")
    assert ErrorKind.FORBIDDEN is Forbidden.kind


def test_one_client_mounts_at_most_max_client_bytes() -> None:
    m = make(Clock(), segments=0, max_client_bytes=1000)
    m.mount_segment("ca", "s1", base=1 << 20, size=600, principal="worker/a")
    with pytest.raises(InvalidInput, match="size: worker/a would mount 1600 bytes"):
        m.mount_segment("ca2", "s2", base=1 << 30, size=1000, principal="worker/a")
    m.mount_segment("cb", "s3", base=1 << 31, size=1000, principal="worker/b")  # its own
    m.mount_segment("cc", "s4", base=1 << 32, size=400)  # no mTLS: counted per client id
    with pytest.raises(InvalidInput, match="cc would mount"):
        m.mount_segment("cc", "s5", base=1 << 33, size=601)
    assert m.mount_segment("ca", "s1", base=1 << 20, size=600, principal="worker/a") is False
    few = make(Clock(), segments=0, max_client_segments=2)
    for i in range(2):
        few.mount_segment("c", f"t{i}", base=(i + 1) << 20, size=10, principal="store/x")
    with pytest.raises(InvalidInput, match="segment_id: store/x has 2 segments mounted"):
        few.mount_segment("c", "t2", base=3 << 20, size=10, principal="store/x")


def test_restore_drops_what_no_longer_fits() -> None:
    clock = Clock()
    m = make(clock, segments=2, size=100)
    kv = FakeKv()
    put(m, "a", 40, replicas=2)
    m.put_start("b", 40, preferred_segment="s1")
    kv.apply(m.drain_changes())
    del kv.segments["s1"]  # that segment's record is gone
    kv.objects["junk"] = b'{"key": "junk"}'
    kv.segments["bad"] = b'{"segment_id": "bad", "client_id": "c9", "base": 0, "size": -1}'
    m2 = make(clock, segments=0)
    rep = kv.restore_into(m2)
    assert (rep.objects, rep.replicas_dropped, rep.objects_dropped) == (1, 2, 2)
    assert (rep.segments, rep.segments_dropped) == (1, 1)
    assert [d.segment_id for d in m2.get_replica_list("a")] == ["s0"]
    ch = m2.drain_changes()
    assert set(ch.objects) == {"a", "b", "junk"} and ch.objects["b"] is None
    assert ch.segments == {"bad": None}
    with pytest.raises(WrongState):
        m2.restore([], [])


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="high_watermark"):
        StoreMaster(Clock(), random.Random(0), MasterParams(high_watermark=1.5))
    with pytest.raises(ValueError, match="lease_ttl_s"):
        StoreMaster(Clock(), random.Random(0), MasterParams(lease_ttl_s=0))


# -- purity and the service's error mapping ----------------------------------------------


def test_core_modules_import_no_clock_rng_or_io_library() -> None:
    core = Path(services.store_master.core.__file__).parent
    banned = {"time", "random", "asyncio", "grpc", "redis"}
    found = {}
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            hits = {n.split(".")[0] for n in names} & banned
            if hits:
                found[path.name] = sorted(hits)
    assert found == {}


def test_each_error_kind_answers_the_status_it_always_had() -> None:
    import grpc

    from services.store_master.service import STATUS, status_of

    assert set(STATUS) == set(ErrorKind)
    want = {StoreError: grpc.StatusCode.INTERNAL,
            InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
            NotFound: grpc.StatusCode.NOT_FOUND,
            AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
            Leased: grpc.StatusCode.FAILED_PRECONDITION,
            NotReady: grpc.StatusCode.FAILED_PRECONDITION,
            WrongState: grpc.StatusCode.FAILED_PRECONDITION,
            NoSpace: grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert {cls: status_of(cls("why")) for cls in want} == want
    assert len({cls.kind for cls in want}) == len(want)  # one kind per refusal class
