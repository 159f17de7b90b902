"""Profiles: filters + weighted scorers + a picker, declared in YAML, used as a policy.

YAML format (``profiles.yaml`` in this package is the default set; ``--profiles FILE``
adds profiles or replaces same-named ones)::

    profiles:
      kv:                                   # the profile's name = a policy name
        description: Dynamo's KV cost       # optional
        filters:                            # optional, applied in order
          - name: kv_usage_below
            args: {max: 0.95}
        scorers:                            # at least one
          - name: kv_cost
            weight: 1.0                     # > 0, default 1
            args: {overlap_weight: 1.0}
        picker: {name: softmax, args: {temperature: 0.0}}   # or just: picker: max_score
      ttft_hit:                             # a *policy profile*: a built-in policy
        description: lowest TTFT, hits x2   # with YAML arguments (no filters/scorers/
        policy:                             # picker then)
          name: ttft
          args: {own_weight: 1.0, chunk_budget: 8192}

Contract:

- :func:`parse_profiles(text, source, known)` parses and validates a YAML document and
  returns ``{name: ProfileSpec}``. Raises :class:`ProfileError` (a ValueError) naming the
  source and profile for: invalid YAML, duplicate keys anywhere (so duplicate profile
  names), unknown keys, unknown filter/scorer/picker names (listing the known ones),
  non-positive weights, no scorer; for a policy profile (``policy:``): an unknown
  built-in policy name, or ``filters``/``scorers``/``picker`` beside it.
- :class:`Profile` is a policy: ``select`` applies the filters (a filter that would keep
  no candidate is skipped and noted in the reason), combines the scorers' scores as
  ``Σ weight·score / Σ weight`` (so the total stays in [0, 1]) and lets the picker choose.
  A scorer returning a score outside [0, 1] or missing a candidate raises ValueError.
  The decision carries the combined score and, when a ``kv_cost`` scorer is present, the
  chosen worker's raw cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from services.router.policies.base import (
    Decision,
    Filter,
    Picker,
    Rng,
    RouteContext,
    Scorer,
    WorkerState,
)
from services.router.policies.plugins import KvCostScorer, MaxScorePicker, SoftmaxPicker


class ProfileError(ValueError):
    """A profiles file is invalid."""


@dataclass(frozen=True)
class PluginSpec:
    """One plugin reference: its registered name and constructor arguments."""

    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0


@dataclass(frozen=True)
class ProfileSpec:
    """A parsed profile."""

    name: str
    scorers: tuple[PluginSpec, ...]
    picker: PluginSpec
    filters: tuple[PluginSpec, ...] = ()
    description: str = ""
    # A policy profile: a built-in policy with arguments (scorers, picker unused).
    policy: PluginSpec | None = None


@dataclass(frozen=True)
class KnownPlugins:
    """Names a profile may refer to."""

    filters: frozenset[str]
    scorers: frozenset[str]
    pickers: frozenset[str]
    policies: frozenset[str] = frozenset()


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that rejects duplicate mapping keys."""


def _construct_unique(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        if key in seen:
            raise ProfileError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique)


def _plugin(raw: Any, kind: str, known: frozenset[str], where: str,
            weighted: bool = False) -> PluginSpec:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict) or "name" not in raw:
        raise ProfileError(f"{where}: each {kind} needs a name")
    allowed = {"name", "args"} | ({"weight"} if weighted else set())
    extra = set(raw) - allowed
    if extra:
        raise ProfileError(f"{where}: unknown {kind} keys {sorted(extra)}; "
                           f"allowed: {sorted(allowed)}")
    name = raw["name"]
    if name not in known:
        raise ProfileError(f"{where}: unknown {kind} {name!r}; known {kind}s: {sorted(known)}")
    args = raw.get("args") or {}
    if not isinstance(args, dict):
        raise ProfileError(f"{where}: args of {kind} {name!r} must be a mapping")
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
        raise ProfileError(f"{where}: weight of {kind} {name!r} must be a number > 0, "
                           f"got {weight!r}")
    return PluginSpec(name, dict(args), float(weight))


_PROFILE_KEYS = {"description", "filters", "scorers", "picker", "policy"}


def parse_profiles(text: str, source: str, known: KnownPlugins) -> dict[str, ProfileSpec]:
    """Parses a profiles document; see the module docstring."""
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (safe loader subclass)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: invalid YAML: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"profiles"} or not isinstance(
            doc["profiles"], dict):
        raise ProfileError(f"{source}: expected a single top-level mapping 'profiles:'")
    out: dict[str, ProfileSpec] = {}
    for name, body in doc["profiles"].items():
        where = f"{source}: profile {name!r}"
        if not isinstance(name, str) or not name:
            raise ProfileError(f"{source}: profile names must be non-empty strings")
        if not isinstance(body, dict):
            raise ProfileError(f"{where}: expected a mapping")
        extra = set(body) - _PROFILE_KEYS
        if extra:
            raise ProfileError(f"{where}: unknown keys {sorted(extra)}; "
                               f"allowed: {sorted(_PROFILE_KEYS)}")
        if "policy" in body:
            clash = sorted(set(body) & {"filters", "scorers", "picker"})
            if clash:
                raise ProfileError(f"{where}: a policy profile takes no {clash}")
            out[name] = ProfileSpec(
                name=name, scorers=(), picker=PluginSpec(""),
                description=str(body.get("description", "")),
                policy=_plugin(body["policy"], "policy", known.policies, where))
            continue
        scorers = body.get("scorers") or []
        filters = body.get("filters") or []
        if not isinstance(scorers, list) or not scorers:
            raise ProfileError(f"{where}: needs a non-empty list of scorers")
        if not isinstance(filters, list):
            raise ProfileError(f"{where}: filters must be a list")
        out[name] = ProfileSpec(
            name=name,
            scorers=tuple(_plugin(s, "scorer", known.scorers, where, weighted=True)
                          for s in scorers),
            picker=_plugin(body.get("picker", "max_score"), "picker", known.pickers, where),
            filters=tuple(_plugin(f, "filter", known.filters, where) for f in filters),
            description=str(body.get("description", "")),
        )
    return out


@dataclass(frozen=True)
class PlainKv:
    """What :attr:`Profile.plain_kv` gives: the profile's one scorer and its picker's
    random source."""

    scorer: KvCostScorer
    rng: Rng


class Profile:
    """Filters → weighted scorers → picker, as one policy (see the module docstring).

    ``plain_kv``: for a profile of Dynamo's cost alone (no filter, one ``kv_cost`` scorer of
    weight 1, a ``max_score`` picker or a ``softmax`` one at temperature 0, the default
    ``kv`` profile; those exact classes, not subclasses, which may override what they
    compute) a :class:`PlainKv`, else None; fixed at construction (a profile is not
    changed after it). ``select`` of such a profile picks the cheapest candidate;
    :func:`services.router.plain.route_plain` makes the same decision from the same
    numbers without building the policies' view.
    """

    def __init__(self, name: str, filters: Sequence[Filter],
                 scorers: Sequence[tuple[Scorer, float]], picker: Picker) -> None:
        if not scorers:
            raise ValueError(f"profile {name!r} has no scorer")
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.plain_kv: PlainKv | None = None
        (scorer, weight), = self.scorers if len(self.scorers) == 1 else ((None, 0.0),)
        if (not self.filters and type(scorer) is KvCostScorer and weight == 1.0
                and (type(picker) is MaxScorePicker
                     or type(picker) is SoftmaxPicker and picker.temperature <= 0)):
            self.plain_kv = PlainKv(scorer, picker._rng)

    def combined_scores(self, ctx: RouteContext,
                        candidates: Sequence[WorkerState]) -> dict[str, float]:
        """``Σ weight·score / Σ weight`` per candidate."""
        total = {w.instance_id: 0.0 for w in candidates}
        weights = sum(weight for _, weight in self.scorers)
        for scorer, weight in self.scorers:
            scores = scorer.score(ctx, candidates)
            for wid in total:
                s = scores.get(wid)
                if s is None or not 0.0 <= s <= 1.0:
                    raise ValueError(f"scorer {scorer.name!r} gave {wid} the score {s!r}; "
                                     "scores must be in [0, 1]")
                total[wid] += weight * s
        return {wid: v / weights for wid, v in total.items()}

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """Filters, scores and picks; see the module docstring."""
        cands = list(candidates)
        notes = []
        for f in self.filters:
            kept = f.filter(ctx, cands)
            if kept:
                cands = kept
            else:
                notes.append(f"filter {f.name} kept none (ignored)")
        scores = self.combined_scores(ctx, cands)
        d = self.picker.pick(ctx, cands, scores)
        cost = None
        for scorer, _ in self.scorers:
            costs = getattr(scorer, "last_costs", None)
            if isinstance(costs, dict) and d.worker_id in costs:
                cost = float(costs[d.worker_id])
        chosen = next(w for w in cands if w.instance_id == d.worker_id)
        parts = [f"{self.name}: {d.reason}", f"score {scores[d.worker_id]:.3f}"]
        if cost is not None:
            parts.append(f"cost {cost:.2f}")
        parts.append(f"overlap {chosen.overlap_blocks}/{chosen.prompt_blocks} blocks")
        parts.extend(notes)
        return Decision(d.worker_id, ", ".join(parts), score=scores[d.worker_id], cost=cost)
