"""Prefill/decode decisions: pairing rules, conditional disaggregation, the decode-first
decider. Pure functions over plain numbers.

Contract:

- :func:`incompatibility(p, d)` returns None when prefill worker ``p`` can hand KV to
  decode worker ``d`` (same handoff mode, block size and KV layout), else a sentence
  saying why not. The router refuses such pairs at routing time. An SGLang worker (handoff
  mode ``sglang``: SGLang's bootstrap handshake; its ``kv_layout`` starts ``sglang|``)
  never pairs with another engine's, whatever the other's mode: the reason says
  "engines differ" and names both.
- :func:`can_prefill_locally(d)`: whether decode worker ``d`` can serve a request alone
  (conditional disaggregation, decode-first without a P): an SGLang decode server cannot
  (it only receives KV through its bootstrap), every other can.
- :func:`bypass_prefill(...)` is Dynamo's conditional disaggregation: serve on D alone when
  ``eff_isl < isl_max and eff_isl / prompt < isl_ratio`` (``eff_isl`` = prompt tokens not
  cached on D), or when the prefill pool is overloaded. Returns (bypass, reason).
- :func:`decode_first_needs_prefill(...)` is llm-d's prefix-based decider: use a remote P
  only when the tokens not cached on the chosen D are at least ``threshold``.
- "P serves whole" (``DisaggConfig.prefill_whole``, **off by default**): when every decode
  worker's KV is full, a prefill worker that can decode alone runs the request as an
  aggregated worker would (prefill and decode locally), using the spare KV of the P pool.
  :func:`can_decode_alone(p, advertised)` is that capability: the worker must advertise
  it (``WorkerRecord.can_decode_alone``; a vLLM P worker can, its NIXL connector only
  adds the handoff) and must not be an SGLang prefill server (which only hands KV to its
  decode peer through the bootstrap), whatever it advertises.
  :func:`kv_after(kv_usage, active_blocks, block_size, capacity_blocks, tokens)` is a
  worker's predicted KV fraction once ``tokens`` more are placed there: ``(max(kv_usage ·
  capacity, active_blocks · block_size) + tokens) / capacity`` tokens (None when the
  capacity is unknown). :func:`prefill_serves_whole(p_after, d_afters, cfg)` is the
  default rule (a policy's ``prefer_prefill_whole`` hook may replace it, see
  :mod:`services.router.core`): True when every D's predicted fraction is above
  ``whole_d_kv`` and P's stays at or below ``whole_p_kv``; an unknown fraction (None)
  never counts as full on D and always as full on P, so the rule stays off without load
  reports. Returns (serve whole, reason).
  Live: ``kvmesh router --prefill-whole`` (``--whole-d-kv``, ``--whole-p-kv``) turns it
  on; vLLM and mock P workers advertise the capability (discovery's ``decode_alone``,
  :data:`services.common.discovery.DECODE_ALONE`), SGLang's do not. The plan has no
  prefill, so the frontend runs it as an aggregated request on P (no handoff
  parameters: P's connector does nothing). The offline replay's flag is
  ``python -m bench.offline --prefill-whole``.
"""

from __future__ import annotations

from dataclasses import dataclass

ORDERS = ("prefill_first", "decode_first")


@dataclass(frozen=True)
class DisaggConfig:
    """Knobs of the P/D decisions (defaults as Dynamo and llm-d ship them)."""

    order: str = "prefill_first"
    conditional: bool = True
    isl_max: int = 2048
    isl_ratio: float = 0.7
    # A prefill worker with at least this many queued + in-flight requests is overloaded.
    prefill_max_queue: int = 8
    decode_first_threshold: int = 16
    # "P serves whole" (module docstring): off by default (kvmesh router --prefill-whole).
    prefill_whole: bool = False
    whole_d_kv: float = 0.9
    whole_p_kv: float = 0.8

    def problems(self) -> list[str]:
        """Human-readable problems; empty when valid."""
        out = []
        if self.order not in ORDERS:
            out.append(f"disagg order must be one of {ORDERS}, got {self.order!r}")
        if self.isl_max < 0 or not 0.0 <= self.isl_ratio <= 1.0:
            out.append("isl_max must be >= 0 and isl_ratio in [0, 1]")
        if self.prefill_max_queue < 1:
            out.append("prefill_max_queue must be >= 1")
        if self.decode_first_threshold < 0:
            out.append("decode_first_threshold must be >= 0")
        if not 0.0 < self.whole_d_kv <= 1.0 or not 0.0 < self.whole_p_kv <= 1.0:
            out.append("whole_d_kv and whole_p_kv must be in (0, 1]")
        if self.prefill_whole and self.order != "prefill_first":
            out.append("prefill_whole needs disagg order prefill_first (decode_first picks "
                       "D before any P)")
        return out


@dataclass(frozen=True)
class PairInfo:
    """What pairing needs to know about one worker."""

    instance_id: str
    handoff_mode: str
    block_size: int
    kv_layout: str


SGLANG_MODE = "sglang"


def _engine(w: PairInfo) -> str:
    """The engine family a worker's pairing facts show ("sglang" or "vllm")."""
    sglang = w.handoff_mode == SGLANG_MODE or w.kv_layout.startswith("sglang|")
    return "sglang" if sglang else "vllm"


def can_prefill_locally(d: PairInfo) -> bool:
    """Whether decode worker ``d`` can run a prompt itself (module docstring)."""
    return _engine(d) != "sglang"


def can_decode_alone(p: PairInfo, advertised: bool) -> bool:
    """Whether prefill worker ``p`` can serve a request whole (module docstring)."""
    return advertised and _engine(p) != "sglang"


def kv_after(kv_usage: float, active_blocks: int, block_size: int, capacity_blocks: int,
             tokens: int) -> float | None:
    """A worker's predicted KV fraction with ``tokens`` more (module docstring)."""
    cap = capacity_blocks * block_size
    if cap <= 0:
        return None
    used = max(kv_usage * cap, float(active_blocks * block_size))
    return (used + max(tokens, 0)) / cap


def prefill_serves_whole(p_after: float | None, d_afters: list[float | None],
                         cfg: DisaggConfig) -> tuple[bool, str]:
    """The default "P serves whole" rule (module docstring)."""
    if not cfg.prefill_whole:
        return False, "P serving whole is off"
    if not d_afters or any(d is None or d <= cfg.whole_d_kv for d in d_afters):
        return False, "a decode worker has KV headroom"
    if p_after is None or p_after > cfg.whole_p_kv:
        return False, "every decode worker's KV is full, and so is P's"
    worst = min(d for d in d_afters if d is not None)
    return True, (f"P serves whole: every decode worker's KV would be above "
                  f"{cfg.whole_d_kv:g} (least {worst:.2f}), P's {p_after:.2f}")


def incompatibility(p: PairInfo, d: PairInfo) -> str | None:
    """Why ``p`` cannot hand KV to ``d``, or None when it can."""
    if _engine(p) != _engine(d):
        names = {"sglang": "SGLang (bootstrap handshake)", "vllm": "vLLM (NIXL connector)"}
        return (f"engines differ: prefill worker {p.instance_id} is {names[_engine(p)]}, "
                f"decode worker {d.instance_id} is {names[_engine(d)]}; KV moves only "
                f"between workers of one engine")
    if not p.handoff_mode or not d.handoff_mode:
        return f"{p.instance_id if not p.handoff_mode else d.instance_id} has no KV connector"
    if p.handoff_mode != d.handoff_mode:
        return (f"handoff modes differ: {p.instance_id} uses {p.handoff_mode}, "
                f"{d.instance_id} uses {d.handoff_mode}")
    if p.block_size != d.block_size:
        return (f"KV block sizes differ: {p.instance_id} has {p.block_size}, "
                f"{d.instance_id} has {d.block_size}")
    if p.kv_layout != d.kv_layout:
        return (f"KV layouts differ: {p.instance_id} has {p.kv_layout!r}, "
                f"{d.instance_id} has {d.kv_layout!r}")
    return None


def bypass_prefill(prompt_tokens: int, overlap_blocks: int, block_size: int,
                   prefill_queue: int, cfg: DisaggConfig) -> tuple[bool, str]:
    """Whether to skip the remote prefill (see the module docstring)."""
    if not cfg.conditional:
        return False, "conditional disaggregation off"
    eff_isl = max(prompt_tokens - overlap_blocks * block_size, 0)
    ratio = eff_isl / prompt_tokens if prompt_tokens else 0.0
    if eff_isl < cfg.isl_max and ratio < cfg.isl_ratio:
        return True, (f"local prefill on D: {eff_isl} uncached tokens "
                      f"({ratio:.2f} of the prompt) < {cfg.isl_ratio}")
    if prefill_queue >= cfg.prefill_max_queue:
        return True, f"local prefill on D: prefill queue {prefill_queue} is full"
    return False, f"remote prefill: {eff_isl} uncached tokens ({ratio:.2f} of the prompt)"


def decode_first_needs_prefill(prompt_tokens: int, overlap_blocks: int, block_size: int,
                               threshold: int) -> tuple[bool, str]:
    """llm-d's decider: remote prefill only for at least ``threshold`` uncached tokens."""
    uncached = max(prompt_tokens - overlap_blocks * block_size, 0)
    if uncached >= threshold:
        return True, f"remote prefill: {uncached} tokens not cached on D >= {threshold}"
    return False, f"local prefill on D: {uncached} tokens not cached on D < {threshold}"
