"""The restart policy of ``kvmesh up`` (services.launcher.supervisor), on a manual clock."""

from __future__ import annotations

import pytest

from services.launcher.supervisor import RestartPolicy, Supervisor, describe_exit

POLICY = RestartPolicy(initial_s=0.5, factor=2.0, max_s=30.0, reset_after_s=60.0,
                       crashloop_exits=5, crashloop_window_s=120.0)


def crash(sup: Supervisor, name: str, now: float) -> float:
    """Exits ``name`` at ``now``, restarts it when due; returns the delay."""
    d = sup.exited(name, "SIGKILL", now)
    assert sup.pending(name) and sup.due(d.restart_at - 0.001) == []
    assert sup.due(d.restart_at) == [name]
    sup.started(name, d.restart_at)
    assert not sup.pending(name)
    return d.delay_s


def test_backoff_doubles_up_to_the_cap_and_counts_restarts() -> None:
    sup = Supervisor(POLICY)
    sup.started("decode-0", 0.0)
    now, delays = 0.0, []
    for _ in range(9):
        now += 1.0  # up 1 s each time: never healthy long enough to reset
        delays.append(crash(sup, "decode-0", now))
        now += delays[-1]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(delays) == 30.0 and delays[-1] == 30.0
    st = sup.state("decode-0")
    assert st.restarts == 9 and st.last_exit == "SIGKILL"


def test_a_child_up_long_enough_starts_its_backoff_over() -> None:
    sup = Supervisor(POLICY)
    sup.started("router", 0.0)
    assert crash(sup, "router", 1.0) == 0.5
    assert crash(sup, "router", 2.0) == 1.0
    assert crash(sup, "router", 4.0) == 2.0   # started at 3.0, up 1 s
    assert crash(sup, "router", 6.0 + 60.0) == 0.5  # up 60 s since 6.0: healthy again


def test_restarts_that_cannot_even_spawn_keep_backing_off() -> None:
    sup = Supervisor(POLICY)
    sup.started("agg-0", 0.0)
    now, delays = 100.0, []  # up 100 s, then every restart fails to spawn (no started())
    for _ in range(4):
        d = sup.exited("agg-0", "could not start", now)
        delays.append(d.delay_s)
        now = d.restart_at
    assert delays == [0.5, 1.0, 2.0, 4.0]


def test_a_crash_loop_is_retried_at_the_cap_forever() -> None:
    sup = Supervisor(RestartPolicy(initial_s=0.5, max_s=30.0, crashloop_exits=3,
                                   crashloop_window_s=120.0, reset_after_s=1000.0))
    sup.started("redis", 0.0)
    decisions = []
    now = 0.0
    for _ in range(6):
        now += 0.1
        d = sup.exited("redis", "1", now)
        decisions.append(d)
        now = d.restart_at
        sup.started("redis", now)
    assert [d.crashloop for d in decisions] == [False, False, False, True, True, True]
    assert [d.delay_s for d in decisions[3:]] == [30.0, 30.0, 30.0]
    assert decisions[3].exits_in_window == 4
    assert sup.state("redis").crashloop and sup.state("redis").restarts == 6


def test_exits_older_than_the_window_leave_the_crash_loop() -> None:
    sup = Supervisor(RestartPolicy(crashloop_exits=2, crashloop_window_s=10.0,
                                   reset_after_s=1000.0))
    sup.started("indexer", 0.0)
    for t in (1.0, 2.0, 3.0):
        d = sup.exited("indexer", "1", t)
        sup.started("indexer", t + 0.01)
    assert d.crashloop
    d = sup.exited("indexer", "1", 13.5)  # 1.0, 2.0 and 3.0 are out of the 10 s window
    assert not d.crashloop and d.exits_in_window == 1


def test_due_lists_the_longest_waiting_first_and_forget_drops() -> None:
    sup = Supervisor(POLICY)
    for name in ("a", "b"):
        sup.started(name, 0.0)
    sup.exited("b", "1", 1.0)
    sup.exited("a", "1", 1.2)
    assert sup.due(1.0) == []
    assert sup.due(10.0) == ["b", "a"]
    sup.forget("a")
    assert [s.name for s in sup.states()] == ["b"] and not sup.pending("a")


def test_describe_exit_names_codes_and_signals() -> None:
    assert describe_exit(3) == "3"
    assert describe_exit(0) == "0"
    assert describe_exit(-9) == "SIGKILL"
    assert describe_exit(-15) == "SIGTERM"
    assert describe_exit(None) == "running"


def test_an_invalid_policy_is_refused_naming_the_fields() -> None:
    with pytest.raises(ValueError, match="initial_s") as err:
        Supervisor(RestartPolicy(initial_s=0.0, factor=0.5, crashloop_exits=0))
    assert "factor" in str(err.value) and "crashloop_exits" in str(err.value)
