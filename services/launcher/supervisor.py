"""The restart policy of ``kvmesh up``'s supervisor: a pure core (no processes, no asyncio,
no clock of its own; every call takes ``now``, monotonic seconds).

Contract:

- :meth:`Supervisor.started` records that a child (re)started at ``now``; a restart (a
  start after :meth:`exited`) counts one in :attr:`ChildState.restarts`.
- :meth:`Supervisor.exited` records an unexpected exit (any exit the supervisor did not ask
  for, whatever the code or signal, or a restart that could not even start) and returns
  the :class:`Decision`: when to restart it. The delay backs off exponentially:
  ``initial_s``, then times ``factor`` per exit, capped at ``max_s`` (defaults 0.5 s
  doubling to 30 s). A child that had stayed up at least ``reset_after_s`` (60 s) before
  it exited counts as healthy again: its delay starts over at ``initial_s``.
- Crash loops: a child that exits more than ``crashloop_exits`` times (5) within
  ``crashloop_window_s`` (120 s) is *crash-looping*. The supervisor never gives up on it
  (as Kubernetes' CrashLoopBackOff): it keeps restarting it every ``max_s`` and says so in
  each decision (``crashloop``), so every failure is logged and counted, and the child
  comes back by itself once whatever broke it (a port, a dependency) is fixed.
- :meth:`Supervisor.due` lists the children whose restart time has come, oldest first.
- :meth:`Supervisor.pending` tells whether a child waits for its restart;
  :meth:`Supervisor.forget` drops a child (stopped on purpose); :meth:`Supervisor.state` /
  :meth:`Supervisor.states` are what the status file shows.
- :func:`describe_exit` names a ``Popen.returncode``: ``"3"`` or ``"SIGKILL"``.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff and crash-loop parameters (module docstring)."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 60.0
    crashloop_exits: int = 5
    crashloop_window_s: float = 120.0

    def problems(self) -> list[str]:
        """What is wrong with the values (empty when valid), naming each field."""
        out = []
        if not 0 < self.initial_s <= self.max_s:
            out.append(f"initial_s must be in (0, max_s={self.max_s}], got {self.initial_s}")
        if self.factor < 1:
            out.append(f"factor must be >= 1, got {self.factor}")
        for name in ("reset_after_s", "crashloop_window_s"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.crashloop_exits < 1:
            out.append(f"crashloop_exits must be >= 1, got {self.crashloop_exits}")
        return out


@dataclass(frozen=True)
class Decision:
    """What to do about one exit: restart ``name`` at ``restart_at`` (``delay_s`` from the
    exit); ``exits_in_window`` exits within the crash-loop window, ``crashloop`` when more
    than the policy allows."""

    name: str
    delay_s: float
    restart_at: float
    exits_in_window: int
    crashloop: bool


@dataclass
class ChildState:
    """One supervised child: starts, restarts done, last exit, pending restart."""

    name: str
    started_at: float
    restarts: int = 0
    up: bool = True  # started and not exited since (a failed spawn never comes up)
    last_exit: str = ""
    restart_at: float | None = None
    crashloop: bool = False
    backoff_step: int = 0
    exits: deque[float] = field(default_factory=deque)


def describe_exit(returncode: int | None) -> str:
    """``"3"`` for exit code 3, ``"SIGKILL"`` for death by signal 9 (``returncode`` -9)."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return str(returncode)


class Supervisor:
    """Restart decisions for named children (module docstring)."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        problems = self.policy.problems()
        if problems:
            raise ValueError("invalid restart policy: " + "; ".join(problems))
        self._children: dict[str, ChildState] = {}

    def started(self, name: str, now: float) -> ChildState:
        """``name`` is running since ``now``; a start after an exit is a restart."""
        state = self._children.get(name)
        if state is None:
            state = self._children[name] = ChildState(name, now)
        elif state.restart_at is not None:
            state.restarts += 1
            state.restart_at = None
            state.started_at = now
        state.up = True
        return state

    def exited(self, name: str, how: str, now: float) -> Decision:
        """``name`` exited unexpectedly at ``now`` (``how``: :func:`describe_exit`'s text, or
        why it could not start): when to restart it."""
        state = self._children[name]
        p = self.policy
        if state.up and now - state.started_at >= p.reset_after_s:
            state.backoff_step = 0  # it ran long enough: a fresh failure
        state.up = False
        state.exits.append(now)
        while state.exits and state.exits[0] <= now - p.crashloop_window_s:
            state.exits.popleft()
        crashloop = len(state.exits) > p.crashloop_exits
        delay = p.max_s if crashloop else min(p.max_s, p.initial_s * p.factor **
                                               state.backoff_step)
        state.backoff_step += 1
        state.last_exit = how
        state.crashloop = crashloop
        state.restart_at = now + delay
        return Decision(name, delay, state.restart_at, len(state.exits), crashloop)

    def state(self, name: str) -> ChildState:
        """The tracked state of ``name`` (KeyError when unknown)."""
        return self._children[name]

    def pending(self, name: str) -> bool:
        """``name`` exited and waits for its restart."""
        state = self._children.get(name)
        return state is not None and state.restart_at is not None

    def due(self, now: float) -> list[str]:
        """Children whose restart time has come, the longest-waiting first."""
        waiting = [s for s in self._children.values()
                   if s.restart_at is not None and s.restart_at <= now]
        return [s.name for s in sorted(waiting, key=lambda s: s.restart_at or 0.0)]

    def forget(self, name: str) -> None:
        """Stop tracking ``name`` (it was stopped on purpose)."""
        self._children.pop(name, None)

    def states(self) -> list[ChildState]:
        """Every tracked child, in the order they were first started."""
        return list(self._children.values())
