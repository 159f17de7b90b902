"""The handoff state machine on every interleaving of its events (agg, pull, push).

Each scenario is a script per call (what P and D will report, in order), plus the push
timer (each armed generation may fire once, also after it was disarmed: a stale timer) and
optionally the client's Cancel. A depth-first walk delivers, at every step, each event that
could come next, so every order the driver's queue could see is tried; after the terminal
effect the remaining events are still delivered and must do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.frontend import handoff_machine as hm

P_RESULT = "p-last"
P_ERR = RuntimeError("P died")
D_ERR = RuntimeError("D died")

P_SCRIPTS: dict[str, list[hm.Event]] = {
    "ok": [hm.PrefillDone(P_RESULT)],
    "fail": [hm.PrefillFailed("failed: UNAVAILABLE", P_ERR)],
}
D_SCRIPTS: dict[str, list[hm.Event]] = {
    "ok": [hm.DecodeChunk("c1", False), hm.DecodeChunk("c2", True), hm.DecodeEnded()],
    "one_chunk": [hm.DecodeChunk("c1", True), hm.DecodeEnded()],
    "fail_mid": [hm.DecodeChunk("c1", False), hm.DecodeFailed("failed: INTERNAL", D_ERR)],
    "fail_first": [hm.DecodeFailed("failed: UNAVAILABLE", D_ERR)],
    "fail_after_finish": [hm.DecodeChunk("c1", True), hm.DecodeFailed("failed", D_ERR)],
    "no_output": [hm.DecodeEnded()],
    "no_finish": [hm.DecodeChunk("c1", False), hm.DecodeEnded()],
}
TERMINALS = (hm.Done, hm.Fail, hm.Cancelled)


@dataclass
class Sim:
    """What the driver would know: the calls' scripts and how far they are."""

    mode: str
    p_script: list[hm.Event]
    d_script: list[hm.Event]
    with_cancel: bool
    machine: hm.HandoffMachine = field(init=False)
    pos: dict[str, int] = field(default_factory=lambda: {"p": 0, "d": 0})
    started: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    completed: set[str] = field(default_factory=set)
    armed: int = 0  # generation of the armed timer, 0 = none
    unfired: set[int] = field(default_factory=set)  # generations that may still fire
    cancel_used: bool = False
    trace: list[tuple[hm.Event | None, list[hm.Effect]]] = field(default_factory=list)
    unsettled_at_terminal: set[str] | None = None  # started, neither completed nor cancelled

    def __post_init__(self) -> None:
        self.machine = hm.HandoffMachine(self.mode)

    def copy(self) -> Sim:
        new = Sim(self.mode, self.p_script, self.d_script, self.with_cancel)
        new.machine = _clone(self.machine)
        new.pos = dict(self.pos)
        new.started, new.cancelled = set(self.started), set(self.cancelled)
        new.completed, new.unfired = set(self.completed), set(self.unfired)
        new.armed, new.cancel_used, new.trace = self.armed, self.cancel_used, list(self.trace)
        new.unsettled_at_terminal = self.unsettled_at_terminal
        return new

    def script(self, call: str) -> list[hm.Event]:
        return self.p_script if call == "p" else self.d_script

    def enabled(self) -> list[tuple[str, hm.Event]]:
        out: list[tuple[str, hm.Event]] = []
        for call in ("p", "d"):
            if call in self.started and self.pos[call] < len(self.script(call)):
                out.append((call, self.script(call)[self.pos[call]]))
        out += [("timer", hm.Timeout(g)) for g in sorted(self.unfired)]
        if self.with_cancel and not self.cancel_used:
            out.append(("client", hm.Cancel()))
        return out

    def apply(self, effects: list[hm.Effect], event: hm.Event | None) -> None:
        """Records a batch and checks what must hold for each single effect."""
        self.trace.append((event, effects))
        for eff in effects:
            if isinstance(eff, hm.StartPrefill | hm.StartDecode):
                call = "p" if isinstance(eff, hm.StartPrefill) else "d"
                assert call not in self.started, f"{call} started twice"
                self.started.add(call)
            elif isinstance(eff, hm.CancelPrefill | hm.CancelDecode):
                call = "p" if isinstance(eff, hm.CancelPrefill) else "d"
                assert call in self.started and call not in self.cancelled | self.completed, (
                    f"cancel of {call}, which is not running")
                self.cancelled.add(call)
            elif isinstance(eff, hm.ArmTimeout):
                assert self.mode == "push" and not self.armed
                self.armed = eff.generation
                self.unfired.add(eff.generation)
            elif isinstance(eff, hm.DisarmTimeout):
                assert self.armed, "disarm of no timer"
                self.armed = 0
            elif isinstance(eff, TERMINALS):
                self.unsettled_at_terminal = self.started - self.completed - self.cancelled

    def deliver(self, source: str, event: hm.Event) -> None:
        if source in ("p", "d"):
            self.pos[source] += 1
            if self.pos[source] == len(self.script(source)) and source not in self.cancelled:
                self.completed.add(source)
        elif source == "timer":
            assert isinstance(event, hm.Timeout)
            self.unfired.discard(event.generation)
            if self.armed != event.generation:  # stale: disarmed, or an earlier arming
                assert self.machine.handle(event) == []
                self.trace.append((event, []))
                return
            self.armed = 0
        else:
            self.cancel_used = True
        self.apply(self.machine.handle(event), event)


def _clone(m: hm.HandoffMachine) -> hm.HandoffMachine:
    new = hm.HandoffMachine(m.mode)
    new.__dict__.update(m.__dict__)
    return new


def walk(sim: Sim, leaves: list[Sim]) -> None:
    """Every interleaving; a leaf is a state where no event can come any more."""
    if sim.machine.terminal is not None:
        # The rest may still sit in the driver's queue: it must change nothing.
        while options := sim.enabled():
            source, event = options[0]
            sim.deliver(source, event)
        leaves.append(sim)
        return
    options = sim.enabled()
    if not options:
        leaves.append(sim)
        return
    for source, event in options:
        nxt = sim.copy()
        nxt.deliver(source, event)
        walk(nxt, leaves)


def run_all(mode: str, p: str, d: str, with_cancel: bool) -> list[Sim]:
    sim = Sim(mode, P_SCRIPTS[p] if mode != "agg" else [], D_SCRIPTS[d], with_cancel)
    sim.apply(sim.machine.start(), None)
    leaves: list[Sim] = []
    walk(sim, leaves)
    assert leaves
    return leaves


def check(sim: Sim) -> None:
    """The invariants of one complete interleaving."""
    mode, m = sim.mode, sim.machine
    d_stage = "agg" if mode == "agg" else "decode"
    # Exactly one terminal outcome, the last effect of its batch; nothing after it.
    terminal_at = [i for i, (_, effs) in enumerate(sim.trace)
                   if any(isinstance(e, TERMINALS) for e in effs)]
    assert len(terminal_at) == 1, sim.trace
    t = terminal_at[0]
    event, effs = sim.trace[t]
    assert isinstance(effs[-1], TERMINALS) and sum(isinstance(e, TERMINALS) for e in effs) == 1
    assert all(not effs_after for _, effs_after in sim.trace[t + 1:]), sim.trace
    terminal = effs[-1]
    assert m.terminal == terminal and m.phase is hm.Phase.TERMINAL
    # Every call started is completed or cancelled; no timer is left armed.
    assert sim.unsettled_at_terminal == set(), sim.trace
    for call in sim.started:
        state = m.prefill if call == "p" else m.decode
        assert state in (hm.Call.DONE, hm.Call.FAILED, hm.Call.CANCELLED), call
    assert sim.armed == 0, "timer left armed"
    # What happened before the terminal batch, from the events delivered.
    before = [ev for ev, _ in sim.trace[:t] if ev is not None]
    d_chunks_before = [ev for ev in before if isinstance(ev, hm.DecodeChunk)]
    d_finished_before = any(c.finished for c in d_chunks_before)
    # The decisive event and what it must end in.
    if isinstance(event, hm.Cancel):
        assert isinstance(terminal, hm.Cancelled)
    elif isinstance(event, hm.PrefillFailed):
        if d_chunks_before:  # push: it released D's held finish chunk; D had ended
            assert mode == "push" and d_finished_before and isinstance(terminal, hm.Done)
        else:
            assert terminal == hm.Fail("prefill", event.reason, event.error)
    elif isinstance(event, hm.DecodeFailed):
        if d_finished_before:  # after D's finish chunk: a warning, then the normal end
            assert isinstance(terminal, hm.Done) and isinstance(effs[0], hm.Warn)
        else:
            assert terminal == hm.Fail(d_stage, event.reason, event.error)
    elif isinstance(event, hm.Timeout):
        if isinstance(terminal, hm.Fail):
            assert mode == "push" and not d_chunks_before and terminal.stage == "timeout"
        else:  # the hold on D's finish chunk expired after D had ended
            assert isinstance(terminal, hm.Done) and d_finished_before
    if isinstance(terminal, hm.Fail) and terminal.stage == "timeout":
        assert isinstance(event, hm.Timeout)
    # A P failure before D's first chunk always fails the request as "prefill" (unless
    # the request had already ended); after it, only a warning.
    for i, (ev, batch) in enumerate(sim.trace[:t + 1]):
        if isinstance(ev, hm.PrefillFailed) and ev is not None:
            chunks = [e for e, _ in sim.trace[:i] if isinstance(e, hm.DecodeChunk)]
            p_cancelled = any(isinstance(x, hm.CancelPrefill) for _, b in sim.trace[:i]
                              for x in b)
            if p_cancelled:
                assert batch == []
            elif chunks:
                assert mode == "push" and isinstance(batch[0], hm.Warn)
                assert not any(isinstance(x, hm.Fail) for x in batch)
            else:
                assert isinstance(batch[-1], hm.Fail) and batch[-1].stage == "prefill"
    # Emitted chunks: D's chunks in order, each once; the finish chunk carries P's result.
    emits = [(i, e) for i, (_, batch) in enumerate(sim.trace) for e in batch
             if isinstance(e, hm.EmitChunk)]
    emitted = [e for _, e in emits]
    d_chunks = [ev for ev in sim.d_script if isinstance(ev, hm.DecodeChunk)]
    assert [e.chunk for e in emitted] == [c.chunk for c in d_chunks[:len(emitted)]]
    for (i, e), c in zip(emits, d_chunks, strict=False):
        if not c.finished or mode == "agg":
            assert e.prefill is None
        else:  # P's result when P had reported it (before being cancelled, if it was)
            p_ok = False
            for ev, batch in sim.trace[:i + 1]:
                if any(isinstance(x, hm.CancelPrefill) for x in batch) and not p_ok:
                    break
                p_ok = p_ok or isinstance(ev, hm.PrefillDone)
            assert e.prefill == (P_RESULT if p_ok else None)
    if isinstance(terminal, hm.Done):
        assert [e.chunk for e in emitted] == [c.chunk for c in d_chunks]
        assert d_chunks[-1].finished and m.decode is hm.Call.DONE
        assert m.prefill is not hm.Call.RUNNING
    # Pull: D starts only after P is done, with P's result; push: both at once.
    starts = [(i, e) for i, (_, b) in enumerate(sim.trace) for e in b
              if isinstance(e, hm.StartDecode)]
    if mode == "pull" and starts:
        i, start = starts[0]
        assert isinstance(sim.trace[i][0], hm.PrefillDone) and start.prefill == P_RESULT
    elif mode != "pull":
        assert starts and starts[0][0] == 0 and starts[0][1].prefill is None


CASES = [(mode, p, d, c) for mode in ("agg", "pull", "push")
         for p in (P_SCRIPTS if mode != "agg" else ["-"]) for d in D_SCRIPTS
         for c in (False, True)]


@pytest.mark.parametrize(("mode", "p", "d", "with_cancel"), CASES)
def test_every_interleaving_keeps_the_invariants(mode: str, p: str, d: str,
                                                 with_cancel: bool) -> None:
    leaves = run_all(mode, p, d, with_cancel)
    for sim in leaves:
        check(sim)
    if with_cancel:  # Cancel was tried before each event, so some leaf ended Cancelled
        assert any(isinstance(s.machine.terminal, hm.Cancelled) for s in leaves)


def _terminals(mode: str, p: str, d: str) -> set[str]:
    out = set()
    for sim in run_all(mode, p, d, False):
        t = sim.machine.terminal
        out.add(t.stage if isinstance(t, hm.Fail) else type(t).__name__)
    return out


def test_outcomes_per_scenario() -> None:
    """The reachable outcomes, so the walk above is known to cover each kind."""
    assert _terminals("agg", "-", "ok") == {"Done"}
    assert _terminals("agg", "-", "fail_mid") == {"agg"}
    assert _terminals("pull", "ok", "ok") == {"Done"}
    assert _terminals("pull", "fail", "ok") == {"prefill"}
    assert _terminals("pull", "ok", "no_output") == {"decode"}
    # Push: P may fail before or after D's first chunk; the timer may beat either.
    assert _terminals("push", "ok", "ok") == {"Done", "timeout"}
    assert _terminals("push", "fail", "ok") == {"Done", "prefill", "timeout"}
    assert _terminals("push", "ok", "fail_first") == {"decode", "timeout"}
    assert _terminals("push", "fail", "fail_after_finish") == {"Done", "prefill", "timeout"}


def test_push_happy_path_effects_in_order() -> None:
    m = hm.HandoffMachine("push")
    assert m.start() == [hm.StartDecode(None), hm.StartPrefill(), hm.ArmTimeout(1)]
    assert m.handle(hm.PrefillDone(P_RESULT)) == []
    assert m.handle(hm.DecodeChunk("c1", False)) == [hm.DisarmTimeout(), hm.EmitChunk("c1")]
    assert m.handle(hm.DecodeChunk("c2", True)) == [hm.EmitChunk("c2", P_RESULT)]
    assert m.handle(hm.DecodeEnded()) == [hm.Done()]
    assert m.handle(hm.Cancel()) == []


def test_push_holds_the_finish_chunk_until_p_reports() -> None:
    m = hm.HandoffMachine("push")
    m.start()
    assert m.handle(hm.DecodeChunk("c1", True)) == [hm.DisarmTimeout(), hm.ArmTimeout(2)]
    assert m.handle(hm.DecodeEnded()) == []
    assert m.handle(hm.Timeout(1)) == []  # the first arming's stale expiry
    assert m.handle(hm.PrefillFailed("failed: UNAVAILABLE", P_ERR)) == [
        hm.Warn("prefill failed after the decode worker's first output: failed: UNAVAILABLE",
                P_ERR), hm.DisarmTimeout(), hm.EmitChunk("c1", None), hm.Done()]


def test_push_hold_expires_cancels_p() -> None:
    m = hm.HandoffMachine("push")
    m.start()
    m.handle(hm.DecodeChunk("c1", True))
    effects = m.handle(hm.Timeout(2))
    assert effects[0] == hm.CancelPrefill() and isinstance(effects[1], hm.Warn)
    assert effects[2:] == [hm.EmitChunk("c1", None)]
    assert m.handle(hm.DecodeEnded()) == [hm.Done()]


def test_push_p_failure_before_d_output_cancels_d() -> None:
    m = hm.HandoffMachine("push")
    m.start()
    assert m.handle(hm.PrefillFailed("ended without finishing")) == [
        hm.CancelDecode(), hm.DisarmTimeout(), hm.Fail("prefill", "ended without finishing")]


def test_push_timeout_cancels_both() -> None:
    m = hm.HandoffMachine("push")
    m.start()
    effects = m.handle(hm.Timeout(1))
    assert effects[:2] == [hm.CancelPrefill(), hm.CancelDecode()]  # the timer has fired
    assert isinstance(effects[2], hm.Fail) and effects[2].stage == "timeout"


def test_timeout_means_nothing_outside_push() -> None:
    for mode in ("agg", "pull"):
        m = hm.HandoffMachine(mode)
        m.start()
        assert m.handle(hm.Timeout(1)) == []


def test_pull_cancel_while_prefilling() -> None:
    m = hm.HandoffMachine("pull")
    assert m.start() == [hm.StartPrefill()]
    assert m.handle(hm.DecodeChunk("c1", False)) == []  # D is not running: ignored
    assert m.handle(hm.Cancel()) == [hm.CancelPrefill(), hm.Cancelled()]


def test_bad_use_is_refused() -> None:
    with pytest.raises(ValueError, match="handoff mode"):
        hm.HandoffMachine("mock")
    m = hm.HandoffMachine("agg")
    assert m.handle(hm.DecodeEnded()) == []  # before start: nothing
    m.start()
    with pytest.raises(RuntimeError, match="twice"):
        m.start()
