"""The router policy registry: names → factories, filled by one explicit ``register_all``.

Contract: ``register(name, factory)`` rejects duplicate names; ``create(name)`` builds a new
policy instance or raises KeyError listing the known names; ``names()`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable

from services.router.policies.base import Policy

Factory = Callable[[], Policy]


class PolicyRegistry:
    """Policy factories by name."""

    def __init__(self) -> None:
        self._factories: dict[str, Factory] = {}

    def register(self, name: str, factory: Factory) -> None:
        """Adds a factory; a name may be registered only once."""
        if name in self._factories:
            raise ValueError(f"policy {name!r} is already registered")
        self._factories[name] = factory

    def create(self, name: str) -> Policy:
        """A new instance of policy ``name``."""
        try:
            return self._factories[name]()
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; known: {sorted(self._factories)}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._factories)


def register_all(registry: PolicyRegistry) -> PolicyRegistry:
    """Registers every built-in policy. Call once per registry."""
    from services.router.policies.simple import LeastLoaded, RoundRobin

    registry.register(RoundRobin.name, RoundRobin)
    registry.register(LeastLoaded.name, LeastLoaded)
    return registry


def default_registry() -> PolicyRegistry:
    """A registry with every built-in policy."""
    return register_all(PolicyRegistry())
