"""Router plugins: YAML profiles, llm-d scorers, the SGLang approx policy, random."""

import random
from collections import Counter
from pathlib import Path

import pytest

from services.router.core import RouterCore
from services.router.main import RouterConfig
from services.router.plan import WorkerRecord
from services.router.policies.approx import ApproxPolicy
from services.router.policies.base import RouteContext, WorkerState
from services.router.policies.profile import Profile, ProfileError
from services.router.policies.registry import PolicyRegistry, register_all
from services.router.policy_setup import default_registry
from tests.manual_clock import Clock


def state(i: str, **kw: object) -> WorkerState:
    return WorkerState(i, f"addr-{i}", 16, **kw)  # type: ignore[arg-type]


# --- profiles -------------------------------------------------------------------------

def test_default_profiles_are_policies() -> None:
    names = default_registry().names()
    assert {"kv", "kv_sampled", "prefix_load", "approx", "random", "round_robin",
            "least_loaded"} <= set(names)


def test_profile_weights_combine_scores() -> None:
    reg = default_registry()
    reg.load_profiles("""
profiles:
  mix:
    scorers:
      - {name: prefix_cache, weight: 3}
      - {name: kv_utilization, weight: 1}
    picker: max_score
""")
    policy = reg.create("mix", random.Random(0))
    assert isinstance(policy, Profile)
    a = state("a", prompt_blocks=10, overlap_blocks=10, kv_usage=0.9)  # 3·1 + 0.1 = 3.1
    b = state("b", prompt_blocks=10, overlap_blocks=5, kv_usage=0.0)  # 3·0.5 + 1 = 2.5
    ctx = RouteContext("r", "m")
    assert policy.combined_scores(ctx, [a, b]) == pytest.approx({"a": 3.1 / 4, "b": 2.5 / 4})
    assert policy.select(ctx, [a, b]).worker_id == "a"
    # Same inputs, weights flipped: free KV now wins.
    reg.load_profiles("""
profiles:
  mix:
    scorers:
      - {name: prefix_cache, weight: 1}
      - {name: kv_utilization, weight: 3}
""", replace=True)
    assert reg.create("mix", random.Random(0)).select(ctx, [a, b]).worker_id == "b"


def test_unknown_plugin_names_are_rejected_clearly() -> None:
    reg = default_registry()
    with pytest.raises(ProfileError, match=r"profile 'x': unknown scorer 'prefix'; "
                                           r"known scorers: \[.*'prefix_cache'"):
        reg.load_profiles("profiles:\n  x:\n    scorers: [{name: prefix}]\n", "f.yaml")
    with pytest.raises(ProfileError, match="unknown picker 'best'"):
        reg.load_profiles("profiles:\n  x:\n    scorers: [queue]\n    picker: best\n")
    with pytest.raises(ProfileError, match="unknown filter"):
        reg.load_profiles("profiles:\n  x:\n    scorers: [queue]\n    filters: [nope]\n")
    with pytest.raises(ProfileError, match="weight"):
        reg.load_profiles("profiles:\n  x:\n    scorers: [{name: queue, weight: 0}]\n")
    with pytest.raises(ProfileError, match="non-empty list of scorers"):
        reg.load_profiles("profiles:\n  x:\n    picker: random\n")
    with pytest.raises(ProfileError, match="unknown keys"):
        reg.load_profiles("profiles:\n  x:\n    scorers: [queue]\n    pickr: random\n")
    with pytest.raises(ProfileError, match="bad args for scorer 'kv_cost'"):
        reg.load_profiles("profiles:\n  x:\n    scorers: [{name: kv_cost, args: {w: 1}}]\n")
    assert "x" not in reg.names()


def test_duplicate_names_are_rejected() -> None:
    reg = default_registry()
    with pytest.raises(ProfileError, match="duplicate key 'a'"):
        reg.load_profiles("profiles:\n  a:\n    scorers: [queue]\n"
                          "  a:\n    scorers: [kv_cost]\n")
    with pytest.raises(ProfileError, match="clashes with the built-in policy"):
        reg.load_profiles("profiles:\n  random:\n    scorers: [queue]\n", replace=True)
    with pytest.raises(ProfileError, match="already registered"):
        reg.load_profiles("profiles:\n  kv:\n    scorers: [queue]\n")
    with pytest.raises(ValueError, match="already registered"):
        reg.register_scorer("queue", object)
    with pytest.raises(ValueError, match="already registered"):
        register_all(reg)
    # Plugins a fresh registry does not know are rejected when a profile names them.
    with pytest.raises(ProfileError, match="unknown scorer"):
        PolicyRegistry().load_profiles("profiles:\n  a:\n    scorers: [queue]\n")


def test_profiles_file_adds_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("""
profiles:
  kv:   # overrides the packaged one: least queue instead of cost
    scorers: [queue]
  mine:
    scorers: [kv_utilization]
    picker: {name: random}
""")
    reg = default_registry(f)
    assert "mine" in reg.names()
    spec = reg.profile("kv")
    assert spec is not None and [s.name for s in spec.scorers] == ["queue"]
    # Profiles are usable as the prefill policy too.
    c = RouterCore(policy=reg.create("least_loaded", random.Random(0)),
                   prefill_policy=reg.create("mine", random.Random(0)), clock=lambda: 0.0)
    c.set_workers([WorkerRecord("p1", "a", "m", "prefill", 16, 4096, "pull", "L"),
                   WorkerRecord("d1", "b", "m", "decode", 16, 4096, "pull", "L")])
    plan = c.route(RouteContext("r", "m", tuple(range(4000))))
    assert plan.prefill is not None and plan.reason.count("mine: random pick") == 1
    with pytest.raises(ProfileError, match="cannot read"):
        default_registry(tmp_path / "missing.yaml")


def test_filter_that_keeps_none_is_ignored() -> None:
    reg = default_registry()
    reg.load_profiles("""
profiles:
  f:
    filters: [{name: kv_usage_below, args: {max: 0.5}}]
    scorers: [queue]
""")
    p = reg.create("f", random.Random(0))
    ok = [state("a", kv_usage=0.9, num_running=0), state("b", kv_usage=0.4, num_running=5)]
    assert p.select(RouteContext("r", "m"), ok).worker_id == "b"  # a filtered out
    full = [state("a", kv_usage=0.9), state("b", kv_usage=0.95, num_running=3)]
    d = p.select(RouteContext("r", "m"), full)
    assert d.worker_id == "a" and "kept none" in d.reason


def test_llmd_scorers() -> None:
    reg = default_registry()
    reg.load_profiles("profiles:\n  q: {scorers: [queue]}\n  pc: {scorers: [prefix_cache]}\n")
    cands = [state("a", num_running=4), state("b", num_running=2, in_flight=3),
             state("c", num_waiting=1)]
    q = reg.create("q", random.Random(0))
    assert isinstance(q, Profile)
    assert q.combined_scores(RouteContext("r", "m"), cands) == pytest.approx(
        {"a": 0.0, "b": 1 / 3, "c": 1.0})
    pc = reg.create("pc", random.Random(0))
    assert isinstance(pc, Profile)
    got = pc.combined_scores(RouteContext("r", "m"), [
        state("a", prompt_blocks=4, overlap_blocks=1), state("b", prompt_blocks=0)])
    assert got == {"a": 0.25, "b": 0.0}


def test_random_policy_is_seeded() -> None:
    cands = [state("a"), state("b"), state("c")]
    reg = default_registry()

    def draws(seed: int) -> list[str]:
        p = reg.create("random", random.Random(seed))
        return [p.select(RouteContext(str(i), "m"), cands).worker_id for i in range(300)]

    assert draws(3) == draws(3)
    counts = Counter(draws(3))
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 70


# --- approx (SGLang CacheAwarePolicy) --------------------------------------------------

def toks(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_approx_cache_threshold_and_smallest_tree() -> None:
    p = ApproxPolicy(cache_threshold=0.3, clock=Clock(0.0))
    cands = [state("w1"), state("w2")]
    a = toks(0, 64)  # 4 pages
    assert p.select(RouteContext("1", "m", a), cands).worker_id == "w1"  # trees 0/0 → id
    assert p.tree_size("w1") == 4
    # A new prompt (match rate 0) → smallest tree: w2.
    d = p.select(RouteContext("2", "m", toks(10_000, 32)), cands)
    assert d.worker_id == "w2" and "smallest tree" in d.reason
    # a + 96 new tokens: 64/160 = 0.4 > 0.3 → w1 although w1's tree is larger.
    d = p.select(RouteContext("3", "m", a + toks(500, 96)), cands)
    assert d.worker_id == "w1" and "cache hit" in d.reason
    assert p.match("w1", a + toks(500, 96)) == 160
    # a + 160 new tokens: 64/224 = 0.29 <= 0.3 → smallest tree (w2 has 2 pages).
    d = p.select(RouteContext("4", "m", a + toks(900, 160)), cands)
    assert d.worker_id == "w2"


def test_approx_never_matches_across_tenants() -> None:
    p = ApproxPolicy(cache_threshold=0.3, clock=Clock(0.0))
    cands = [state("w1"), state("w2")]
    a = toks(0, 64)
    assert p.select(RouteContext("1", "m", a, cache_salt="tenant-a"), cands).worker_id == "w1"
    assert p.match("w1", a, "tenant-a") == 64
    assert p.match("w1", a) == p.match("w1", a, "tenant-b") == 0
    d = p.select(RouteContext("2", "m", a, cache_salt="tenant-b"), cands)  # B's guess
    assert d.worker_id == "w2" and "cache hit" not in d.reason
    d = p.select(RouteContext("3", "m", a, cache_salt="tenant-a"), cands)  # A's repeat
    assert d.worker_id == "w1" and "cache hit" in d.reason


def test_approx_imbalance_switches_to_shortest_queue() -> None:
    p = ApproxPolicy(clock=Clock(0.0))  # 0.3 / 64 / 1.5
    a = toks(0, 64)
    p.select(RouteContext("1", "m", a), [state("w1"), state("w2")])  # a → w1
    # diff 90 > 64 and 100 > 10 · 1.5 → imbalanced: shortest queue despite the cache.
    d = p.select(RouteContext("2", "m", a), [state("w1", num_running=100),
                                             state("w2", num_running=10)])
    assert d.worker_id == "w2" and "imbalanced" in d.reason
    # diff 90 > 64 but 300 <= 210 · 1.5 → balanced → the cache wins.
    d = p.select(RouteContext("3", "m", a + toks(700, 16)),
                 [state("w1", num_running=300), state("w2", num_running=210)])
    assert d.worker_id == "w1"
    # diff 60 <= 64 → balanced even though 70 > 10 · 1.5 (w2 now has a too; tie → smaller).
    d = p.select(RouteContext("4", "m", toks(0, 64)),
                 [state("w1", in_flight=70), state("w2", in_flight=10)])
    assert d.worker_id == "w2" and "cache hit" in d.reason


def test_approx_eviction_lru_size_cap_and_age() -> None:
    clock = Clock(0.0)
    p = ApproxPolicy(max_pages_per_worker=4, max_age_s=100, clock=clock)
    only = [state("w1")]
    a, b = toks(0, 48), toks(5000, 48)  # 3 pages each
    p.select(RouteContext("1", "m", a), only)
    clock.t = 10
    p.select(RouteContext("2", "m", b), only)
    assert p.tree_size("w1") == 6
    clock.t = 20
    assert p.evict(clock.t) == 2  # cap 4: a's two deepest pages go first
    assert p.match("w1", a) == 16 and p.match("w1", b) == 48
    clock.t = 30
    p.select(RouteContext("3", "m", a[:16]), only)  # touches a's root
    clock.t = 115  # b (t=10) is older than 100 s, a's root (t=30) is not
    assert p.evict(clock.t) == 3
    assert p.match("w1", a) == 16 and p.match("w1", b) == 0 and p.tree_size("w1") == 1


def test_approx_drops_trees_of_vanished_workers_via_core() -> None:
    clock = Clock(0.0)
    p = ApproxPolicy(clock=clock)
    c = RouterCore(policy=p, clock=clock)
    c.set_workers([WorkerRecord("w1", "a", "m", "agg", 16, 4096),
                   WorkerRecord("w2", "b", "m", "agg", 16, 4096)])
    c.route(RouteContext("r", "m", toks(0, 64)))
    assert p.tree_size("w1") == 4
    c.set_workers([WorkerRecord("w2", "b", "m", "agg", 16, 4096)])
    assert p.tree_size("w1") == 0
    assert c.evict(0.0) == 0


def test_the_live_router_passes_its_clock_to_approx() -> None:
    clock = Clock(0.0)
    reg = RouterConfig().registry(clock)
    p = reg.create("approx", random.Random(0))
    assert isinstance(p, ApproxPolicy)
    p.select(RouteContext("1", "m", toks(0, 32)), [state("w1")])  # stamped at t = 0
    clock.t = 50.0
    p.max_age_s = 10.0
    assert p.evict(None) == 2  # evict() without a time reads the injected clock
    with pytest.raises(TypeError, match="clock"):
        ApproxPolicy()  # type: ignore[call-arg]


def test_bad_plugin_values_are_profile_errors() -> None:
    reg = default_registry()
    with pytest.raises(ProfileError, match="unknown tier 'disk'"):
        reg.load_profiles("profiles:\n  x:\n    scorers:\n      - name: kv_cost\n"
                          "        args: {tier_credit: {disk: 0.25}}\n")
    with pytest.raises(ProfileError, match="temperature must be >= 0"):
        reg.load_profiles("profiles:\n  x:\n    scorers: [kv_cost]\n"
                          "    picker: {name: softmax, args: {temperature: -1}}\n")
