"""The router's compact decision: what :meth:`RouterCore.route
<services.router.core.RouterCore.route>` decides and records for the common request,
computed from the same numbers without the policies' view.

Why: a lone request (one every 10 ms, as at 100 req/s without overlap) runs the
frontend's code cold on this machine, and there each Python function and object it
touches costs several µs (``bench/mesh_profile/cold.py``). The general route builds a
RouteContext, a WorkerState per candidate, the profile's scores and a Decision; for the
default ``kv`` profile this module's path does the same arithmetic inline (route +
release of a 64-token prompt: about half the general path's time warm, ~110 µs less
after 10 ms idle; a lone request through the mesh: −0.10 ms at p50).

Contract:

- :func:`plain_candidates(core, model, prompt_tokens, max_tokens)`: when ``core.route``
  would pick among aggregated workers only, with the policy's ``plain_kv``
  (:class:`~services.router.policies.profile.PlainKv`: the default ``kv`` profile), no
  admission and no failure mark, and every worker of ``model`` fits the request (its
  ``max_model_len``) at one block size > 0: those workers sorted by id and the block
  size; else None.
- :func:`route_plain(core, request_id, candidates, n, max_tokens, hashes, overlaps,
  tree_blocks)` for those candidates, a prompt of ``n`` tokens hashed to ``hashes`` at
  their block size, ``overlaps`` as a RouteContext holds the index's answer (None: the
  core's history) and ``tree_blocks`` (called on a tie only) for the context's
  ``tree_blocks``: the plan ``core.route`` returns for that request with no exclusion,
  recorded as it records it (in flight, active blocks, pending prefill, history; the
  same random draw on a tie; the scorer's ``last_costs``). None, with nothing recorded,
  where ``core.route`` would raise (the request is in flight) or a cost is not finite:
  call ``core.route``. ``tests/unit/test_router_plain.py`` holds the two equal over
  randomized fleets, loads, indexes, peers and ties. Change :func:`~services.router.
  policies.plugins.kv_cost` and this together.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence

from services.router.core import _NO_LOAD, RouterCore
from services.router.plan import RoutePlan, WorkerRecord
from services.router.policies.base import WorkerOverlap
from services.router.policies.plugins import best_id, credited_blocks, minmax_low_is_best
from services.router.policies.profile import PlainKv

_BY_ID = operator.attrgetter("instance_id")


def plain_candidates(core: RouterCore, model: str, prompt_tokens: int, max_tokens: int
                     ) -> tuple[list[WorkerRecord], int] | None:
    """When :func:`route_plain` decides a request of ``model`` (see the module docstring):
    its candidates, sorted by id, and their one block size; else None."""
    plain = getattr(core.policy, "plain_kv", None)
    if plain is None or core.admission is not None or core._marks:
        return None
    need = prompt_tokens + max(max_tokens, 0)
    out = [w for w in core._workers.values() if w.model == model]
    if not out or out[0].block_size <= 0:
        return None  # no worker, or no block size: route()
    for w in out:
        if w.role != "agg" or w.block_size != out[0].block_size or not w.fits(need):
            return None  # P/D, mixed block sizes, a context too short: route()
    if len(out) > 1:
        out.sort(key=_BY_ID)
    return out, out[0].block_size

def route_plain(core: RouterCore, request_id: str, candidates: list[WorkerRecord], n: int,
                max_tokens: int, hashes: Sequence[int],
                overlaps: Mapping[str, WorkerOverlap] | None,
                tree_blocks: Callable[[], Mapping[str, int] | None]) -> RoutePlan | None:
    """``core.route``'s plan and records (see the module docstring)."""
    plain: PlainKv = core.policy.plain_kv  # type: ignore[attr-defined]
    if request_id in core._in_flight:
        return None
    total = len(hashes)
    scorer, peers, stale = plain.scorer, core.peers.totals(), core._stale
    credits, weight = scorer.credits, scorer.overlap_weight
    costs: dict[str, float] = {}
    held: dict[str, tuple[int, dict[str, int]]] = {}
    for w in candidates:
        wid = w.instance_id
        if overlaps is None:
            blocks = core.history.overlap(wid, hashes)
            by_tier = {"device": blocks} if blocks else {}
        elif (got := overlaps.get(wid)) is None:
            blocks, by_tier = 0, {}
        else:
            blocks = min(got.blocks, total)
            by_tier = {t: min(k, total) for t, k in got.by_tier.items() if k}
        held[wid] = (blocks, by_tier)
        # kv_cost() of the policies' view, from the same numbers; its tier walk
        # (credited_blocks) only where a tier other than device holds some
        credited = blocks * credits["device"] if not by_tier or (
            len(by_tier) == 1 and by_tier.get("device") == blocks) \
            else credited_blocks(blocks, by_tier, credits)
        load = core._loads.get(wid) or _NO_LOAD
        active = core._flight_blocks.get(wid, 0) + (peers[wid].active_blocks
                                                    if wid in peers else 0)
        reported = load.kv_usage * load.kv_total_blocks \
            if load.kv_total_blocks > 0 and wid not in stale else 0.0
        cost = weight * max(total - credited, 0.0) + max(float(active), reported)
        if not math.isfinite(cost):
            return None  # the policies' view refuses it: route() says how
        costs[wid] = cost
    scorer.last_costs = costs
    scores = minmax_low_is_best(costs)
    trees: list[Mapping[str, int] | None] = []

    def tree_of(wid: str) -> int:
        if not trees:
            trees.append(tree_blocks())
        known = trees[0]
        return known.get(wid, 0) if known is not None else core.history.size(wid)
    wid, why = best_id(list(costs), scores, plain.rng, tree_of)
    (blocks, by_tier), cost, score = held[wid], costs[wid], scores[wid]
    reason = (f"{core.policy.name}: max score{why}, score {score:.3f}, cost {cost:.2f}, "
              f"overlap {blocks}/{total} blocks")
    plan = RoutePlan(core._workers[wid], None, core.policy.name, reason, blocks,
                     overlap_by_tier=by_tier,
                     overlap_source="indexer" if overlaps is not None else "history",
                     prompt_blocks=total, score=score, cost=float(cost))
    return core._commit(request_id, plan, n, max_tokens, lambda _: hashes)
