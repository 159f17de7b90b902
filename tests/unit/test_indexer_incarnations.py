"""Which process of a worker id the index follows (:class:`services.indexer.core.Incarnations`):
a restarted worker keeps its id and numbers its events from 0 again, so event ids alone
cannot tell its new events from redeliveries of its old ones."""

from __future__ import annotations

from services.indexer.core import Admission, Incarnations, KvEvent, KvIndex

A, B, C = 1_000, 2_000, 3_000  # started_at_ms of three processes of one worker id


def test_first_incarnation_then_the_same_one_is_current() -> None:
    inc = Incarnations()
    assert inc.current("w") == 0
    assert inc.admit("w", A) is Admission.FIRST
    assert inc.current("w") == A
    assert inc.admit("w", A) is Admission.CURRENT
    assert inc.admit("other", A) is Admission.FIRST  # per worker id


def test_a_later_process_restarts_and_an_older_one_is_stale() -> None:
    inc = Incarnations()
    inc.admit("w", A)
    assert inc.admit("w", B) is Admission.NEWER
    assert inc.current("w") == B
    assert inc.admit("w", A) is Admission.STALE  # A's late entries after B's
    assert inc.current("w") == B
    assert inc.admit("w", B) is Admission.CURRENT
    assert inc.admit("w", C) is Admission.NEWER


def test_entries_without_an_incarnation_are_always_current() -> None:
    inc = Incarnations()
    assert inc.admit("w", 0) is Admission.CURRENT
    assert inc.current("w") == 0
    inc.admit("w", B)
    assert inc.admit("w", 0) is Admission.CURRENT  # old producers: event ids only
    inc.record_seen("w", C, restarted=False)
    assert inc.admit("w", 0) is Admission.CURRENT


def test_the_live_record_makes_older_incarnations_stale() -> None:
    inc = Incarnations()
    assert not inc.record_seen("w", B, restarted=False)  # nothing followed: nothing to drop
    assert inc.live("w") == B
    assert inc.admit("w", A) is Admission.STALE  # a replay of A's entries: not applied
    assert inc.current("w") == 0
    assert inc.admit("w", B) is Admission.FIRST
    assert inc.admit("w", C) is Admission.NEWER  # published before its record reached etcd


def test_a_record_of_a_later_process_drops_the_followed_one() -> None:
    inc = Incarnations()
    inc.admit("w", A)
    assert inc.record_seen("w", B, restarted=False)  # e.g. first seen after a replay of A
    assert inc.current("w") == 0
    assert inc.admit("w", A) is Admission.STALE
    assert inc.admit("w", B) is Admission.FIRST


def test_a_restarted_record_of_the_process_already_followed_drops_nothing() -> None:
    inc = Incarnations()
    inc.record_seen("w", A, restarted=False)
    inc.admit("w", A)
    assert inc.admit("w", B) is Admission.NEWER  # B's relay publishes before it registers
    assert not inc.record_seen("w", B, restarted=True)
    assert inc.current("w") == B
    assert not inc.record_seen("w", A, restarted=True)  # an older record: nothing to drop
    assert inc.current("w") == B


def test_a_restarted_record_drops_when_nothing_or_no_incarnation_is_known() -> None:
    inc = Incarnations()
    assert inc.record_seen("w", B, restarted=True)  # no incarnation followed
    inc.admit("w", B)
    assert inc.record_seen("w", 0, restarted=True)  # a record without one: as before
    assert inc.current("w") == 0 and inc.live("w") == 0
    assert not inc.record_seen("w", 0, restarted=False)


def test_forget_drops_what_was_known() -> None:
    inc = Incarnations()
    inc.record_seen("w", B, restarted=False)
    inc.admit("w", B)
    inc.forget("w")
    assert (inc.current("w"), inc.live("w")) == (0, 0)
    assert inc.admit("w", A) is Admission.FIRST


def replay(entries: list[tuple[int, list[KvEvent]]], live: int = 0) -> KvIndex:
    """What the feed does with a replayed stream, without the I/O: admit each entry, drop
    the worker on a new process, apply the admitted events."""
    index, inc = KvIndex(), Incarnations()
    if live:
        inc.record_seen("w", live, restarted=False)
    for incarnation, events in entries:
        verdict = inc.admit("w", incarnation)
        if verdict is Admission.STALE:
            continue
        if verdict is not Admission.CURRENT:
            index.remove_worker("w")
        for ev in events:
            assert index.apply(ev) is None
    return index


def stored(i: int, *hashes: int) -> KvEvent:
    return KvEvent("w", i, "stored", hashes)


def test_a_replayed_stream_of_two_processes_ends_with_the_later_ones_state() -> None:
    a = [(A, [stored(i, 100 + i) for i in range(0, 5)]), (A, [stored(5, 105)])]
    b = [(B, [stored(0, 7), stored(1, 8)])]
    late_a = [(A, [stored(6, 106)])]
    for live in (0, B):
        index = replay([*a, *b, *late_a], live)
        assert index.dump() == {"w": {"device": frozenset({7, 8})}}, live
        assert index.next_event_id("w") == 2
    # Without incarnations (today's producers) B's events read as redeliveries.
    old = replay([(0, evs) for _, evs in [*a, *b]])
    assert old.dump()["w"]["device"] == frozenset(range(100, 106))
