"""The pure state machine of one request's worker calls: aggregated, or P → D (pull, push).

No I/O, no clock, no asyncio: :class:`HandoffMachine` turns events (what a call did, the
push timer, the client going away) into effects (start or cancel a call, arm the timer,
emit a chunk, end the request). :mod:`services.frontend.handoff` is the asyncio driver that
runs the calls, feeds their outcomes in as events and executes the effects. Payloads
(responses, errors) are opaque to the machine: it only passes them on.

Contract of :meth:`HandoffMachine.start` / :meth:`HandoffMachine.handle` (each returns the
effects to execute, in order):

- ``agg``: one call (the "decode" call, stage ``agg``): ``start`` → ``StartDecode(None)``.
- ``pull``: ``start`` → ``StartPrefill``; ``PrefillDone(result)`` → ``StartDecode(result)``,
  preceded by ``EmitChunk(first)`` when P's token is the request's first token
  (``PrefillDone.first``); ``PrefillFailed`` → ``Fail("prefill")``.
- ``push``: ``start`` → ``StartDecode(None)``, ``StartPrefill``, ``ArmTimeout(1)``: D and P
  run at the same time and D waits for P's WRITE. Until D's first chunk, ``PrefillFailed``
  ends the request (``CancelDecode``, ``Fail("prefill")``: D would wait forever) and a
  ``Timeout`` of the armed generation ends it with ``Fail("timeout")``. D's first chunk
  disarms the timer; a P failure after it is only reported (``Warn``). D's finish chunk is
  held until P's outcome is known, so that it carries P's result (``EmitChunk.prefill``);
  the timer is re-armed meanwhile and on its expiry P is cancelled (``Warn``) and the
  chunk goes out with ``prefill=None``.
- D's chunks go out in order as ``EmitChunk`` (disaggregated finish chunks carry P's result
  in ``prefill``, or None when it never came). D ending without any chunk, or without a
  finish chunk, is ``Fail`` of D's stage (``agg`` or ``decode``) with the reason; so is
  ``DecodeFailed`` before D's finish chunk (after it: ``Warn``, treated as the end).
- ``Done`` once D has finished and ended and P (if any) has settled. ``Cancel`` (the client
  went away) → ``Cancelled``.
- Every terminal effect (``Done``, ``Fail``, ``Cancelled``) is the last effect of its
  batch, preceded by ``CancelPrefill`` / ``CancelDecode`` for each call still running and
  ``DisarmTimeout`` when the timer is armed. After it, and for a call already cancelled,
  every event is ignored (returns ``[]``); so is a ``Timeout`` of a stale generation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MODES = ("agg", "pull", "push")


# Events -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillDone:
    """P's call finished well; ``result`` is its last response. ``first`` (pull only): the
    chunk of P's sampled token when it goes out as the request's first token (D then
    continues from prompt + that token), else None."""

    result: object
    first: object = None


@dataclass(frozen=True)
class PrefillFailed:
    """P's call failed or ended badly; ``reason`` says how, ``error`` is the cause."""

    reason: str
    error: object = None


@dataclass(frozen=True)
class DecodeChunk:
    """One response from D's call (or the aggregated worker); ``finished`` when it has a
    finish reason."""

    chunk: object
    finished: bool


@dataclass(frozen=True)
class DecodeEnded:
    """D's stream ended with status OK."""


@dataclass(frozen=True)
class DecodeFailed:
    """D's call failed; ``reason`` says how, ``error`` is the cause."""

    reason: str
    error: object = None


@dataclass(frozen=True)
class Timeout:
    """The push timer armed as ``generation`` expired."""

    generation: int


@dataclass(frozen=True)
class Cancel:
    """The consumer went away."""


Event = (PrefillDone | PrefillFailed | DecodeChunk | DecodeEnded | DecodeFailed | Timeout
         | Cancel)


# Effects ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StartPrefill:
    """Call P."""


@dataclass(frozen=True)
class StartDecode:
    """Call D (or the aggregated worker); ``prefill`` is P's result in pull mode."""

    prefill: object = None


@dataclass(frozen=True)
class CancelPrefill:
    """Cancel P's call (aborts the request on P)."""


@dataclass(frozen=True)
class CancelDecode:
    """Cancel D's call (aborts the request on D)."""


@dataclass(frozen=True)
class ArmTimeout:
    """Start the push timer; its expiry is ``Timeout(generation)``."""

    generation: int


@dataclass(frozen=True)
class DisarmTimeout:
    """Stop the push timer."""


@dataclass(frozen=True)
class EmitChunk:
    """Pass D's ``chunk`` to the consumer. ``prefill``: P's result for a disaggregated
    finish chunk (None otherwise, or when P's result never came)."""

    chunk: object
    prefill: object = None


@dataclass(frozen=True)
class Warn:
    """Something failed that does not end the request: log it once."""

    message: str
    error: object = None


@dataclass(frozen=True)
class Done:
    """Terminal: the request finished."""


@dataclass(frozen=True)
class Fail:
    """Terminal: ``stage`` ("agg", "prefill", "decode" or "timeout") failed."""

    stage: str
    reason: str
    error: object = None


@dataclass(frozen=True)
class Cancelled:
    """Terminal: the consumer went away."""


Effect = (StartPrefill | StartDecode | CancelPrefill | CancelDecode | ArmTimeout
          | DisarmTimeout | EmitChunk | Warn | Done | Fail | Cancelled)
Terminal = Done | Fail | Cancelled


class Call(enum.Enum):
    """Where one worker call stands."""

    IDLE = "idle"  # not started
    RUNNING = "running"
    DONE = "done"  # ended well (P: PrefillDone; D: DecodeEnded after its finish chunk)
    FAILED = "failed"
    CANCELLED = "cancelled"


class Phase(enum.Enum):
    """Where the request stands."""

    PREFILL = "prefill"  # pull: waiting for P
    WAIT_FIRST = "wait_first"  # D started, no chunk yet
    STREAMING = "streaming"  # D's chunks flow
    FINISHING = "finishing"  # D sent its finish chunk; waiting for D's end and/or P
    TERMINAL = "terminal"


class HandoffMachine:
    """One request's calls; see the module docstring."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"handoff mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.phase = Phase.PREFILL
        self.prefill = Call.IDLE
        self.decode = Call.IDLE
        self.terminal: Terminal | None = None
        self._p_result: object = None
        self._held: object = None  # push: D's finish chunk, until P settles
        self._holding = False
        self._d_ended = False  # D's stream ended (OK) after its finish chunk
        self._timer = 0  # generation of the armed timer; 0 = none armed
        self._generations = 0
        self._started = False

    @property
    def decode_stage(self) -> str:
        """The stage a failure of the D call is reported as."""
        return "agg" if self.mode == "agg" else "decode"

    def start(self) -> list[Effect]:
        """The first effects; call once."""
        if self._started:
            raise RuntimeError("HandoffMachine.start called twice")
        self._started = True
        if self.mode == "pull":
            self.prefill = Call.RUNNING
            return [StartPrefill()]
        self.phase = Phase.WAIT_FIRST
        self.decode = Call.RUNNING
        if self.mode == "agg":
            return [StartDecode(None)]
        self.prefill = Call.RUNNING
        return [StartDecode(None), StartPrefill(), self._arm()]

    def handle(self, event: Event) -> list[Effect]:
        """The effects of ``event``; see the module docstring."""
        if self.terminal is not None or not self._started:
            return []
        if isinstance(event, Cancel):
            return self._end(Cancelled())
        if isinstance(event, Timeout):
            return self._on_timeout(event)
        if isinstance(event, PrefillDone | PrefillFailed):
            if self.prefill is not Call.RUNNING:
                return []
            return self._on_prefill(event)
        if self.decode is not Call.RUNNING:
            return []
        return self._on_decode(event)

    # internals ----------------------------------------------------------------------

    def _arm(self) -> ArmTimeout:
        self._generations += 1
        self._timer = self._generations
        return ArmTimeout(self._timer)

    def _disarm(self) -> list[Effect]:
        if not self._timer:
            return []
        self._timer = 0
        return [DisarmTimeout()]

    def _end(self, terminal: Terminal) -> list[Effect]:
        out: list[Effect] = []
        if self.prefill is Call.RUNNING:
            self.prefill = Call.CANCELLED
            out.append(CancelPrefill())
        if self.decode is Call.RUNNING:
            self.decode = Call.CANCELLED
            out.append(CancelDecode())
        out += self._disarm()
        self.phase = Phase.TERMINAL
        self.terminal = terminal
        out.append(terminal)
        return out

    def _p_settled(self) -> bool:
        return self.prefill is not Call.RUNNING

    def _release_held(self) -> list[Effect]:
        """Push: P has settled; send D's finish chunk, end when D has ended too."""
        self._holding = False
        out: list[Effect] = [*self._disarm(), EmitChunk(self._held, self._p_result)]
        self._held = None
        if self._d_ended:
            out += self._end(Done())
        return out

    def _on_timeout(self, event: Timeout) -> list[Effect]:
        if not self._timer or event.generation != self._timer:
            return []  # stale: disarmed, or an earlier arming
        self._timer = 0
        if self.phase is Phase.WAIT_FIRST:
            return self._end(Fail("timeout", "decode worker got no pushed KV in time"))
        # FINISHING while holding D's finish chunk: P never reported; stop waiting.
        self.prefill = Call.CANCELLED
        return [CancelPrefill(), Warn("prefill worker did not report after the decode "
                                      "worker finished; cancelled"), *self._release_held()]

    def _on_prefill(self, event: PrefillDone | PrefillFailed) -> list[Effect]:
        if isinstance(event, PrefillDone):
            self.prefill = Call.DONE
            self._p_result = event.result
            if self.mode == "pull":
                self.phase = Phase.WAIT_FIRST
                self.decode = Call.RUNNING
                first: list[Effect] = [] if event.first is None else [EmitChunk(event.first)]
                return [*first, StartDecode(event.result)]
            return self._release_held() if self._holding else []
        self.prefill = Call.FAILED
        if self.mode == "pull" or self.phase is Phase.WAIT_FIRST:
            return self._end(Fail("prefill", event.reason, event.error))
        warn = Warn(f"prefill failed after the decode worker's first output: {event.reason}",
                    event.error)
        return [warn, *self._release_held()] if self._holding else [warn]

    def _on_decode(self, event: Event) -> list[Effect]:
        if isinstance(event, DecodeChunk):
            return self._on_chunk(event)
        if isinstance(event, DecodeFailed):
            if self.phase is Phase.FINISHING:
                return [Warn(f"decode worker failed after its finish chunk: {event.reason}",
                             event.error), *self._on_ended()]
            self.decode = Call.FAILED
            return self._end(Fail(self.decode_stage, event.reason, event.error))
        return self._on_ended()

    def _on_chunk(self, event: DecodeChunk) -> list[Effect]:
        out: list[Effect] = []
        if self.phase is Phase.FINISHING:
            return [Warn("decode worker sent a chunk after its finish chunk; dropped")]
        if self.phase is Phase.WAIT_FIRST:
            self.phase = Phase.STREAMING
            out += self._disarm()
        if not event.finished:
            return [*out, EmitChunk(event.chunk)]
        self.phase = Phase.FINISHING
        if self.mode == "push" and not self._p_settled():
            self._holding = True
            self._held = event.chunk
            return [*out, self._arm()]
        prefill = None if self.mode == "agg" else self._p_result
        return [*out, EmitChunk(event.chunk, prefill)]

    def _on_ended(self) -> list[Effect]:
        if self.phase is Phase.WAIT_FIRST:
            self.decode = Call.FAILED
            return self._end(Fail(self.decode_stage, "ended the stream without output"))
        if self.phase is Phase.STREAMING:
            self.decode = Call.FAILED
            return self._end(Fail(self.decode_stage, "ended the stream without finishing"))
        self.decode = Call.DONE
        self._d_ended = True
        return [] if self._holding else self._end(Done())
