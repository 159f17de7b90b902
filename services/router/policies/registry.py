"""The router policy registry: names → factories, filled by one explicit ``register_all``.

Contract:

- ``register(name, factory)`` adds a policy factory (called with ``rng=`` when it takes
  one); ``register_filter`` / ``register_scorer`` / ``register_picker`` add plugin
  factories (called with the profile's YAML ``args`` as keywords, plus ``rng=`` when they
  take one). Every kind rejects duplicate names with ValueError.
- ``add_profiles(specs, replace)`` makes each profile a policy name. A profile may not
  take the name of a built-in policy; it replaces an existing profile only with
  ``replace=True`` (how ``--profiles FILE`` overrides the packaged defaults).
  ``load_profiles(text, source, replace)`` / ``load_profiles_file(path, replace)`` parse
  (see ``profile.py``) and add; the plugin names a profile uses must be registered.
- ``create(name, rng=None)`` builds a new instance of a policy or profile (each instance
  has its own plugins and state) or raises KeyError listing the known names; ``rng``
  (a ``random.Random``) makes random choices reproducible. ``names()`` lists policies.
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
        return KnownPlugins(*(frozenset(self._plugins[k]) for k in ("filter", "scorer",
                                                                      "picker")))

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

    def create(self, name: str, rng: random.Random | None = None) -> Policy:
        """A new instance of policy ``name``."""
        try:
            factory = self._factories[name]
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; known: {sorted(self._factories)}") from None
        policy: Policy = _call(factory, rng or random.Random())
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

    registry.register(RoundRobin.name, RoundRobin)
    registry.register(LeastLoaded.name, LeastLoaded)
    registry.register(RandomPolicy.name, RandomPolicy)
    registry.register(ApproxPolicy.name, ApproxPolicy)
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
