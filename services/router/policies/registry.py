"""The router policy registry: names → factories, filled by one explicit ``register_all``.

Pure: no file reads, no clock, no RNG of its own (``services/router/policy_setup.py``
reads the profiles and perf-model files and builds the registry; ``main.py`` creates the
clock and the seeded RNGs).

Contract:

- ``PolicyRegistry(context=None, arg_loaders=None)``: ``context`` (keyword → value, e.g.
  the live router's ``clock``, or the offline simulator's engine facts ``perf_model``,
  ``chunk_budget``, ``page_size``, ``clock``) is given to every built-in policy factory,
  and every policy profile's, for the keywords it accepts (others are ignored),
  overriding the profile's YAML args. ``arg_loaders`` maps a built-in policy name to a
  function turning YAML args (``{}`` for the bare policy) into its constructor keywords,
  e.g. loading the perf model a ``ttft`` profile names; it may do I/O and runs once per
  profile (when it is added) and once per ``create`` of the bare policy.
- ``register(name, factory)`` adds a policy factory (called with ``rng=`` when it takes
  one); ``register_filter`` / ``register_scorer`` / ``register_picker`` add plugin
  factories (called with the profile's YAML ``args`` as keywords, plus ``rng=`` when they
  take one). Every kind rejects duplicate names with ValueError.
- ``add_profiles(specs, replace)`` makes each profile a policy name (a policy profile,
  ``policy: {name, args}``, builds that built-in policy with the YAML ``args`` (through
  its arg loader, if any) as keywords and names the instance after the profile). A
  profile may not take the name of a built-in policy; it replaces an existing profile
  only with ``replace=True`` (how ``--profiles FILE`` overrides the packaged defaults).
  Each profile is built once (with the registry's ``context`` and an RNG that refuses to
  draw) to check its arguments: bad ones raise :class:`ProfileError` ("bad args").
  ``load_profiles(text, source, replace)`` parses YAML text (see ``profile.py``) and adds;
  the plugin names a profile uses must be registered.
- ``create(name, rng)`` builds a new instance of a policy or profile (each instance has
  its own plugins and state) with the registry's ``context``, or raises KeyError listing
  the known names; ``rng`` (an :class:`~services.router.policies.base.Rng`, required,
  e.g. a seeded ``random.Random``) is what its random choices draw from. A policy whose
  required arguments (``clock``, ``perf_model``) are not in the context raises
  TypeError. Plugin profiles ignore the context. ``names()`` lists policies.
- :func:`register_all` registers every built-in policy, filter, scorer and picker. Call
  it once per registry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from services.router.policies.base import Policy, Rng, T
from services.router.policies.profile import (
    KnownPlugins,
    PluginSpec,
    Profile,
    ProfileError,
    ProfileSpec,
    parse_profiles,
)

Factory = Callable[..., Policy]
PluginFactory = Callable[..., Any]
ArgLoader = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def _takes_rng(factory: Callable[..., Any]) -> bool:
    try:
        return "rng" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _accepted(factory: Callable[..., Any], context: Mapping[str, Any] | None
              ) -> dict[str, Any]:
    """The entries of ``context`` that ``factory`` takes as keywords."""
    if not context:
        return {}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(context)
    return {k: v for k, v in context.items() if k in params and k != "rng"}


def _call(factory: Callable[..., Any], rng: Rng, **kwargs: Any) -> Any:
    if _takes_rng(factory):
        kwargs["rng"] = rng
    return factory(**kwargs)


class _NoDraws:
    """The RNG of the check-builds: building a policy must not draw."""

    def _refuse(self) -> NoReturn:
        raise RuntimeError("a policy drew from the RNG while being built")

    def random(self) -> float:
        self._refuse()

    def choice(self, seq: Sequence[T]) -> T:
        self._refuse()

    def choices(self, population: Sequence[T], weights: Sequence[float] | None = None, *,
                k: int = 1) -> list[T]:
        self._refuse()


class PolicyRegistry:
    """Policy, plugin and profile factories by name."""

    def __init__(self, context: Mapping[str, Any] | None = None,
                 arg_loaders: Mapping[str, ArgLoader] | None = None) -> None:
        self._context: dict[str, Any] = dict(context or {})
        self._arg_loaders: dict[str, ArgLoader] = dict(arg_loaders or {})
        self._factories: dict[str, Factory] = {}
        self._profiles: dict[str, ProfileSpec] = {}
        self._plugins: dict[str, dict[str, PluginFactory]] = {
            "filter": {}, "scorer": {}, "picker": {}}

    def register(self, name: str, factory: Factory) -> None:
        """Adds a policy factory; a name may be registered only once."""
        if name in self._factories:
            raise ValueError(f"policy {name!r} is already registered")
        self._factories[name] = factory

    def _register_plugin(self, kind: str, name: str, factory: PluginFactory) -> None:
        table = self._plugins[kind]
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = factory

    def register_filter(self, name: str, factory: PluginFactory) -> None:
        """Adds a filter factory (duplicates rejected)."""
        self._register_plugin("filter", name, factory)

    def register_scorer(self, name: str, factory: PluginFactory) -> None:
        """Adds a scorer factory (duplicates rejected)."""
        self._register_plugin("scorer", name, factory)

    def register_picker(self, name: str, factory: PluginFactory) -> None:
        """Adds a picker factory (duplicates rejected)."""
        self._register_plugin("picker", name, factory)

    def known_plugins(self) -> KnownPlugins:
        """The plugin names profiles may use."""
        return KnownPlugins(frozenset(self._plugins["filter"]),
                            frozenset(self._plugins["scorer"]),
                            frozenset(self._plugins["picker"]),
                            frozenset(n for n in self._factories if n not in self._profiles))

    def add_profiles(self, specs: Mapping[str, ProfileSpec], replace: bool = False) -> None:
        """Registers each profile as a policy name, after building it once (see the
        module docstring)."""
        for name in specs:
            if name in self._factories and name not in self._profiles:
                raise ProfileError(f"profile {name!r} clashes with the built-in policy {name!r}")
            if name in self._profiles and not replace:
                raise ProfileError(f"profile {name!r} is already registered")
        factories = {name: self._profile_factory(spec) for name, spec in specs.items()}
        for factory in factories.values():
            factory(_NoDraws(), **self._context)
        for name, spec in specs.items():
            self._profiles[name] = spec
            self._factories[name] = factories[name]

    def _profile_factory(self, spec: ProfileSpec) -> Factory:
        if spec.policy is not None:
            return self._policy_profile_factory(spec, spec.policy)

        def build(rng: Rng, **_context: Any) -> Policy:
            def make(kind: str, name: str, args: Mapping[str, Any]) -> Any:
                try:
                    return _call(self._plugins[kind][name], rng, **args)
                except (TypeError, ValueError) as exc:
                    raise ProfileError(f"profile {spec.name!r}: bad args for {kind} "
                                       f"{name!r}: {exc}") from None
            return Profile(
                spec.name,
                [make("filter", f.name, f.args) for f in spec.filters],
                [(make("scorer", s.name, s.args), s.weight) for s in spec.scorers],
                make("picker", spec.picker.name, spec.picker.args),
            )
        return build

    def _policy_profile_factory(self, spec: ProfileSpec, target: PluginSpec) -> Factory:
        base = self._factories[target.name]

        def bad(exc: Exception) -> ProfileError:
            return ProfileError(f"profile {spec.name!r}: bad args for policy "
                                f"{target.name!r}: {exc}")
        try:
            args = self._load_args(target.name, target.args)
        except (OSError, TypeError, ValueError) as exc:
            raise bad(exc) from None

        def build(rng: Rng, **context: Any) -> Policy:
            kwargs = {**args, **_accepted(base, context)}
            try:
                policy: Policy = _call(base, rng, **kwargs)
            except (TypeError, ValueError) as exc:
                raise bad(exc) from None
            policy.name = spec.name
            return policy
        return build

    def _load_args(self, policy: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """YAML args → constructor keywords (through the policy's arg loader, if any)."""
        loader = self._arg_loaders.get(policy)
        return dict(loader(args) if loader is not None else args)

    def load_profiles(self, text: str, source: str = "<profiles>",
                      replace: bool = False) -> list[str]:
        """Parses YAML text and adds its profiles; returns their names."""
        specs = parse_profiles(text, source, self.known_plugins())
        self.add_profiles(specs, replace=replace)
        return sorted(specs)

    def profile(self, name: str) -> ProfileSpec | None:
        """The spec of profile ``name`` (None for built-in policies and unknown names)."""
        return self._profiles.get(name)

    def create(self, name: str, rng: Rng) -> Policy:
        """A new instance of policy ``name`` (see the module docstring)."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; known: {sorted(self._factories)}") from None
        kwargs = {} if name in self._profiles else self._load_args(name, {})
        policy: Policy = _call(factory, rng, **{**kwargs, **_accepted(factory, self._context)})
        return policy

    def names(self) -> list[str]:
        """Registered policy and profile names, sorted."""
        return sorted(self._factories)


def register_all(registry: PolicyRegistry) -> PolicyRegistry:
    """Registers every built-in policy and plugin. Call once per registry. (The packaged
    default profiles are a file: ``services/router/policy_setup.py`` adds them.)"""
    from services.router.policies.approx import ApproxPolicy
    from services.router.policies.plugins import FILTERS, PICKERS, SCORERS
    from services.router.policies.simple import LeastLoaded, RandomPolicy, RoundRobin
    from services.router.policies.ttft import TtftPolicy

    registry.register(RoundRobin.name, RoundRobin)
    registry.register(LeastLoaded.name, LeastLoaded)
    registry.register(RandomPolicy.name, RandomPolicy)
    registry.register(ApproxPolicy.name, ApproxPolicy)
    registry.register(TtftPolicy.name, TtftPolicy)
    for name, f in FILTERS.items():
        registry.register_filter(name, f)
    for name, s in SCORERS.items():
        registry.register_scorer(name, s)
    for name, p in PICKERS.items():
        registry.register_picker(name, p)
    return registry
