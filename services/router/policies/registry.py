"""The router policy registry: names → factories, filled by one explicit ``register_all``.

Contract:

- ``register(name, factory)`` adds a policy factory (called with ``rng=`` when it takes
  one); ``register_filter`` / ``register_scorer`` / ``register_picker`` add plugin
  factories (called with the profile's YAML ``args`` as keywords, plus ``rng=`` when they
  take one). Every kind rejects duplicate names with ValueError.
- ``add_profiles(specs, replace)`` makes each profile a policy name (a policy profile,
  ``policy: {name, args}``, builds that built-in policy with the YAML ``args`` as
  keywords and names the instance after the profile). A profile may not
  take the name of a built-in policy; it replaces an existing profile only with
  ``replace=True`` (how ``--profiles FILE`` overrides the packaged defaults).
  ``load_profiles(text, source, replace)`` / ``load_profiles_file(path, replace)`` parse
  (see ``profile.py``) and add; the plugin names a profile uses must be registered.
- ``create(name, rng=None, context=None)`` builds a new instance of a policy or profile
  (each instance has its own plugins and state) or raises KeyError listing the known
  names; ``rng`` (a ``random.Random``) makes random choices reproducible. ``context``
  (keyword → value, e.g. the offline simulator's engine facts: ``perf_model``,
  ``chunk_budget``, ``page_size``, ``clock``) is passed to a built-in policy's factory,
  or a policy profile's, for the keywords it accepts (others are ignored), overriding
  the profile's YAML args; plugin profiles ignore it. ``names()`` lists policies.
- :func:`register_all` registers every built-in policy, filter, scorer and picker, and
  the packaged default profiles (``profiles.yaml``). Call it once per registry.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from services.router.policies.base import Policy
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
DEFAULT_PROFILES = "profiles.yaml"


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


def _call(factory: Callable[..., Any], rng: random.Random, **kwargs: Any) -> Any:
    if _takes_rng(factory):
        kwargs["rng"] = rng
    return factory(**kwargs)


class PolicyRegistry:
    """Policy, plugin and profile factories by name."""

    def __init__(self) -> None:
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
        """Registers each profile as a policy name (see the module docstring)."""
        for name in specs:
            if name in self._factories and name not in self._profiles:
                raise ProfileError(f"profile {name!r} clashes with the built-in policy {name!r}")
            if name in self._profiles and not replace:
                raise ProfileError(f"profile {name!r} is already registered")
        for name, spec in specs.items():
            self._profiles[name] = spec
            self._factories[name] = self._profile_factory(spec)

    def _profile_factory(self, spec: ProfileSpec) -> Factory:
        if spec.policy is not None:
            return self._policy_profile_factory(spec, spec.policy)

        def build(rng: random.Random) -> Policy:
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

        def build(rng: random.Random, **context: Any) -> Policy:
            kwargs = {**target.args, **_accepted(base, context)}
            try:
                policy: Policy = _call(base, rng, **kwargs)
            except (TypeError, ValueError) as exc:
                raise ProfileError(f"profile {spec.name!r}: bad args for policy "
                                   f"{target.name!r}: {exc}") from None
            policy.name = spec.name
            return policy
        return build

    def load_profiles(self, text: str, source: str = "<profiles>",
                      replace: bool = False) -> list[str]:
        """Parses and adds profiles; returns their names. Each is built once to check its
        plugin arguments."""
        specs = parse_profiles(text, source, self.known_plugins())
        for spec in specs.values():
            self._profile_factory(spec)(random.Random(0))
        self.add_profiles(specs, replace=replace)
        return sorted(specs)

    def load_profiles_file(self, path: str | Path, replace: bool = True) -> list[str]:
        """``load_profiles`` on a file (replacing same-named profiles by default)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ProfileError(f"cannot read profiles file {p}: {exc}") from None
        return self.load_profiles(text, str(p), replace=replace)

    def profile(self, name: str) -> ProfileSpec | None:
        """The spec of profile ``name`` (None for built-in policies and unknown names)."""
        return self._profiles.get(name)

    def create(self, name: str, rng: random.Random | None = None,
               context: Mapping[str, Any] | None = None) -> Policy:
        """A new instance of policy ``name`` (see the module docstring)."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; known: {sorted(self._factories)}") from None
        policy: Policy = _call(factory, rng or random.Random(), **_accepted(factory, context))
        return policy

    def names(self) -> list[str]:
        """Registered policy and profile names, sorted."""
        return sorted(self._factories)


def default_profiles_text() -> str:
    """The packaged default profiles (``services/router/profiles.yaml``)."""
    return resources.files("services.router").joinpath(DEFAULT_PROFILES).read_text()


def register_all(registry: PolicyRegistry) -> PolicyRegistry:
    """Registers every built-in policy, plugin and default profile. Call once per
    registry."""
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
    registry.load_profiles(default_profiles_text(), f"services/router/{DEFAULT_PROFILES}")
    return registry


def default_registry(profiles_file: str | Path | None = None) -> PolicyRegistry:
    """A registry with every built-in policy, plus the profiles of ``profiles_file``."""
    reg = register_all(PolicyRegistry())
    if profiles_file:
        reg.load_profiles_file(profiles_file, replace=True)
    return reg
