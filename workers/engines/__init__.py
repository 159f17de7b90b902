"""Engines behind one interface, created by name through a lazy registry.

Contract:

- ``register_engine(kind, target)``: maps ``kind`` to ``"module.path:ClassName"``. Nothing is
  imported until the engine is created. Registering a kind twice raises ValueError.
- ``create_engine(kind, **kwargs) -> Engine``: imports the engine's module, then returns
  ``Class(**kwargs)`` (not started; call ``await engine.start()``). An unknown kind raises
  ValueError naming the known kinds; a class that is not an :class:`Engine` raises TypeError.
- ``engine_kinds()``: the registered kinds, sorted.

Built in: ``"vllm"`` -> :class:`workers.engines.vllm_engine.VllmEngine`, which takes
``config=VllmEngineConfig(...)``; as a shortcut, ``create_engine("vllm", model_path=...,
...)`` builds the config from the keyword arguments. ``"mock"`` ->
:class:`workers.engines.mock.MockEngine` (simulated, no model), which takes
``config=MockEngineConfig(...)`` (and optionally ``event_sink=``); the same shortcut
builds the config from keyword arguments that are its fields. ``"afd"`` -> the
Attention-FFN disaggregated engine of ``config=AfdEngineConfig(...)``'s role
(:mod:`workers.engines.afd.mesh_engine`: attention or FFN), with ``worker_id=``.
``"sglang"`` -> :class:`workers.engines.sglang.engine.SglangEngine` (a child SGLang
server in ``.sglvenv``), which takes ``config=SglangEngineConfig(...)``; the same
shortcut builds the config from keyword arguments.
"""

from __future__ import annotations

import importlib
from typing import Any

from workers.engines.base import Engine

_REGISTRY: dict[str, str] = {}


def register_engine(kind: str, target: str) -> None:
    """Register ``kind`` -> ``"module:Class"`` (imported lazily); duplicates are rejected."""
    if kind in _REGISTRY:
        raise ValueError(f"engine kind {kind!r} is already registered ({_REGISTRY[kind]})")
    if ":" not in target:
        raise ValueError(f"engine target must look like 'module:Class', got {target!r}")
    _REGISTRY[kind] = target


def engine_kinds() -> list[str]:
    """The registered engine kinds, sorted."""
    return sorted(_REGISTRY)


def _load(kind: str) -> type[Engine]:
    try:
        target = _REGISTRY[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r}; known: {engine_kinds()}") from None
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"{target} is not an Engine subclass")
    return cls


def create_engine(kind: str, **kwargs: Any) -> Engine:
    """Create (but do not start) an engine of ``kind``; see the module docstring."""
    cls = _load(kind)
    if kind == "vllm" and "config" not in kwargs:
        from workers.engines.vllm_engine import VllmEngineConfig

        kwargs = {"config": VllmEngineConfig(**kwargs)}
    elif kind == "mock" and "config" not in kwargs:
        from workers.engines.mock.engine import MockEngineConfig

        sink = kwargs.pop("event_sink", None)
        kwargs = {"config": MockEngineConfig(**kwargs), "event_sink": sink}
    elif kind == "sglang" and "config" not in kwargs:
        from workers.engines.sglang.engine import SglangEngineConfig

        kwargs = {"config": SglangEngineConfig(**kwargs)}
    return cls(**kwargs)


register_engine("vllm", "workers.engines.vllm_engine:VllmEngine")
register_engine("mock", "workers.engines.mock.engine:MockEngine")
register_engine("afd", "workers.engines.afd.mesh_engine:AfdEngineKind")
register_engine("sglang", "workers.engines.sglang.engine:SglangEngine")
