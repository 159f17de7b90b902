"""Router policy plugin interface: what policies see, and the plugin protocols.

Contract:

- A policy is any object with a ``name`` and ``select(ctx, candidates) -> Decision``.
  ``candidates`` is non-empty, sorted by instance id, and holds only workers that can
  serve the request. ``select`` must return one of them and must not mutate them.
  Policies may keep their own state (a round-robin cursor, a request-history tree).
  Optional hooks (called by the core when present, no-ops otherwise):
  ``keep_only(worker_ids)`` after discovery changed (drop state of vanished workers) and
  ``evict(now)`` periodically (trim caches; ``now`` from the caller's clock).
- llm-d style plugins compose a policy (a *profile*, see ``profile.py``):
  - :class:`Filter` ``filter(ctx, candidates) -> list`` keeps a subset;
  - :class:`Scorer` ``score(ctx, candidates) -> {worker_id: score}`` with every score in
    [0, 1], higher is better, one entry per candidate;
  - :class:`Picker` ``pick(ctx, candidates, scores) -> Decision`` chooses one.
- What the core fills in before calling a policy: ``ctx.overlaps`` holds the predicted
  overlap of every candidate (from the indexer when the service gave it, else from the
  router's own history; ``ctx.overlap_source`` says which), ``ctx.prompt_blocks`` the
  prompt's full blocks at the candidates' block size, and each :class:`WorkerState` the
  same numbers for that worker plus its load and its pending prefill tokens.
- Policies are created by name through :class:`PolicyRegistry` (see ``registry.py``).
- Injected effects: :data:`Clock` (monotonic seconds) and :class:`Rng` (the subset of
  ``random.Random`` the policies draw from) are constructor arguments; no policy reads
  the wall clock or creates an RNG itself (``services/router/main.py`` does, seeded from
  ``--seed``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# The injected clock and random source, re-exported for the policies.
from services.common.block_hash import MmSpan
from services.common.injected import Clock as Clock
from services.common.injected import Rng as Rng
from services.common.injected import T as T

TIERS = ("device", "host", "store")

@dataclass(frozen=True)
class WorkerOverlap:
    """Leading prompt blocks a worker holds: in any tier, and per tier."""

    worker_id: str
    blocks: int = 0
    by_tier: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteContext:
    """One request as the router sees it.

    Inputs from the service: ``request_id``, ``model``, ``token_ids``, ``cache_salt`` (the
    tenant's: every hash of the prompt, here and in policies, starts from it); optionally
    ``overlaps`` (the indexer's per-worker overlap; workers absent hold nothing; None means
    "no indexer answer": the core falls back to its history), ``block_hashes`` (the
    prompt's chained hashes per block size, so the prompt is hashed once per size) and
    ``tree_blocks`` (blocks indexed per worker, when known: tie-break by smaller tree),
    ``mm_spans`` (the prompt's images: every hash of the prompt includes their keys, see
    :mod:`services.common.block_hash`; empty for text).
    Filled by the core for policies: ``prompt_blocks``, ``overlap_source`` and
    ``overlaps`` for every candidate.
    """

    request_id: str
    model: str
    token_ids: Sequence[int] = field(default_factory=tuple)
    overlaps: Mapping[str, WorkerOverlap] | None = None
    block_hashes: Mapping[int, Sequence[int]] | None = None
    tree_blocks: Mapping[str, int] | None = None
    cache_salt: str = ""
    mm_spans: Sequence[MmSpan] = ()
    prompt_blocks: int = 0
    overlap_source: str = ""

    def for_policies(self, overlaps: Mapping[str, WorkerOverlap], prompt_blocks: int,
                     overlap_source: str) -> RouteContext:
        """This context with what the core fills in for policies (``dataclasses.replace``
        of those three fields, without its per-call field lookup: once per route)."""
        return RouteContext(self.request_id, self.model, self.token_ids, overlaps,
                            self.block_hashes, self.tree_blocks, self.cache_salt,
                            self.mm_spans, prompt_blocks, overlap_source)


@dataclass(frozen=True)
class WorkerState:
    """A candidate worker: latest load report, the router's own accounting, predicted
    overlap of the current prompt."""

    instance_id: str
    address: str
    block_size: int
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0
    # Blocks of requests routed here and not released yet (ceil(prompt/block_size) each).
    active_blocks: int = 0
    # KV capacity from the load report (0 = unknown).
    kv_total_blocks: int = 0
    # False when the load report predates the router's latest release on this worker
    # (it still counts a finished request's blocks).
    load_fresh: bool = True
    # The prompt's full blocks at this worker's block size, and how many it holds.
    prompt_blocks: int = 0
    overlap_blocks: int = 0
    overlap_by_tier: Mapping[str, int] = field(default_factory=dict)
    # Blocks indexed for this worker (its cached tree), when known.
    tree_blocks: int | None = None
    # Uncached prompt tokens the router sent here whose prefill is not over yet (the
    # router's own accounting: added on route, removed on prefill done or release).
    pending_prefill_tokens: int = 0
    # The worker's role from discovery: "agg", "prefill" or "decode" ("" when unknown).
    # P/D-aware policies cost a decode worker by its decode load, not its prefill queue.
    role: str = ""


@dataclass(frozen=True)
class Decision:
    """The chosen worker and why; ``score`` (in [0, 1]) and ``cost`` when the policy has
    them, for traces."""

    worker_id: str
    reason: str
    score: float | None = None
    cost: float | None = None


class Policy(Protocol):
    """A routing policy plugin."""

    name: str

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """Picks one of ``candidates`` (non-empty) for ``ctx``."""
        ...


class Filter(Protocol):
    """Keeps the candidates fit for the request."""

    name: str

    def filter(self, ctx: RouteContext,
               candidates: Sequence[WorkerState]) -> list[WorkerState]:
        """A subset of ``candidates`` (may be empty; the profile then ignores the filter)."""
        ...


class Scorer(Protocol):
    """Rates every candidate in [0, 1] (higher is better)."""

    name: str

    def score(self, ctx: RouteContext,
              candidates: Sequence[WorkerState]) -> dict[str, float]:
        """One score in [0, 1] per candidate id."""
        ...


class Picker(Protocol):
    """Chooses one candidate from the combined scores."""

    name: str

    def pick(self, ctx: RouteContext, candidates: Sequence[WorkerState],
             scores: Mapping[str, float]) -> Decision:
        """One of ``candidates`` (non-empty); ``scores`` has an entry for each."""
        ...


def queue_of(w: WorkerState) -> int:
    """Queued plus running requests: the larger of the engine report and the router's own
    in-flight count (which is fresher)."""
    return max(w.num_running + w.num_waiting, w.in_flight)


def uncached_tokens(prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """Prompt tokens a worker computes after its cached overlap: at least 1 of a non-empty
    prompt (vLLM always computes the last token), 0 of an empty one."""
    if prompt_tokens <= 0:
        return 0
    return max(prompt_tokens - overlap_blocks * block_size, 1)
