"""Configuration of one offline replay run (pure).

Contract of :class:`SimConfig`: every knob of the simulation with Dynamo-compatible
defaults (engine block 64, 16,384 blocks, 256 sequences, 8,192 batched tokens, Dynamo's
polynomial timing; trace blocks of 512 tokens; TTFT ≤ 2 s and mean ITL ≤ 50 ms).
``validate()`` raises ValueError naming every problem. ``replace(**kw)`` returns a copy.
Topology: ``prefill_workers == decode_workers == 0`` means ``workers`` aggregated workers;
otherwise P prefill + D decode workers (``disagg_order`` ``prefill_first`` or
``decode_first``, ``conditional_disagg`` on/off; transfer time = KV bytes /
``transfer_bandwidth``, KV bytes = blocks · ``kv_bytes_per_token`` · block size).
``prefill_whole`` turns on the router's "P serves whole" (:mod:`services.router.disagg`):
the simulated P workers advertise ``can_decode_alone`` (the mock engine is vLLM-like)
and, when every D's KV is full, a P runs the request whole as an aggregated worker would;
the label then ends ``-whole``.
``admission``: ``none`` (admit all), or a policy of :mod:`services.router.admission.core`
(``early``: Mooncake early rejection; ``current_load``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.router.admission.core import POLICIES as ADMISSION_POLICIES
from services.router.disagg import DisaggConfig
from workers.engines.mock.timing import TimingModel, make_timing

if TYPE_CHECKING:
    from bench.offline.admission import SimAdmission

# Policies that read the indexer's overlaps (the others route without it).
INDEX_POLICIES_EXCLUDED = frozenset({"round_robin", "random", "least_loaded", "approx"})
ADMISSIONS = ADMISSION_POLICIES  # the router's own names (none = admit all)


@dataclass(frozen=True)
class SimConfig:
    """See the module docstring."""

    # trace and SLOs
    trace_block_size: int = 512
    speedup: float = 1.0
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.050
    # engine (the mock core)
    block_size: int = 64
    num_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 1 << 22
    timing_spec: str = "poly"
    engine_speedup: float = 1.0
    kv_bytes_per_token: int = 128 << 10  # Llama-3-8B bf16: 32 layers · 8 KV heads · 128 · 2 · 2
    transfer_bandwidth: float = 25e9
    # topology
    workers: int = 8
    prefill_workers: int = 0
    decode_workers: int = 0
    disagg_order: str = "prefill_first"
    conditional_disagg: bool = True
    prefill_whole: bool = False
    # routing, indexing, admission
    policy: str = "kv"
    prefill_policy: str | None = None
    profiles_file: str | None = None
    event_delay_s: float = 0.0
    admission: str = "none"
    seed: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0 or self.decode_workers > 0

    def problems(self) -> list[str]:
        out = []
        if self.trace_block_size < 1 or self.block_size < 1 or self.num_blocks < 1:
            out.append("trace_block_size, block_size and num_blocks must be >= 1")
        if not self.speedup > 0 or not self.engine_speedup > 0:
            out.append("speedup and engine_speedup must be > 0")
        if self.slo_ttft_s <= 0 or self.slo_itl_s <= 0:
            out.append("SLOs must be > 0")
        if self.disaggregated:
            if self.decode_workers < 1:
                out.append("a disaggregated topology needs at least one decode worker")
            if self.prefill_workers < 0:
                out.append("prefill_workers must be >= 0")
        elif self.workers < 1:
            out.append("workers must be >= 1")
        # the router's own checks of these knobs (order; prefill_whole needs prefill_first)
        out.extend(DisaggConfig(order=self.disagg_order, conditional=self.conditional_disagg,
                                prefill_whole=self.prefill_whole).problems())
        if self.event_delay_s < 0:
            out.append("event_delay_s must be >= 0")
        if self.admission not in ADMISSIONS:
            out.append(f"admission must be one of {ADMISSIONS}")
        if self.kv_bytes_per_token < 0 or not self.transfer_bandwidth > 0:
            out.append("kv_bytes_per_token must be >= 0 and transfer_bandwidth > 0")
        return out

    def validate(self) -> None:
        bad = self.problems()
        if bad:
            raise ValueError("; ".join(bad))

    def replace(self, **kw: Any) -> SimConfig:
        return dataclasses.replace(self, **kw)

    def timing(self) -> TimingModel:
        """A fresh timing model for one engine."""
        return make_timing(self.timing_spec)

    def uses_index(self) -> bool:
        """Whether the router policies read the indexer's overlaps."""
        names = {self.policy} | ({self.prefill_policy} if self.prefill_policy else set())
        return not names <= INDEX_POLICIES_EXCLUDED

    def make_admission(self, sim: Any) -> SimAdmission | None:
        """The admission adapter, or None when every request is admitted."""
        if self.admission == "none":
            return None
        from bench.offline.admission import SimAdmission

        return SimAdmission(self.admission, sim)

    def label(self) -> str:
        """A short name for plots: policy, topology, admission."""
        topo = (f"{self.prefill_workers}P{self.decode_workers}D-{self.disagg_order}"
                f"{'' if self.conditional_disagg else '-always'}"
                f"{'-whole' if self.prefill_whole else ''}" if self.disaggregated
                else f"{self.workers}agg")
        adm = "" if self.admission == "none" else f"+{self.admission}"
        return f"{self.policy}/{topo}{adm}"
