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
