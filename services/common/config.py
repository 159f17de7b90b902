"""Configuration: every flag has a ``KVMESH_*`` environment variable and one ``validate()``.

Contract:

- A service's config is a dataclass deriving from :class:`BaseConfig`. Each field becomes a
  command-line flag ``--field-name`` whose default comes from the environment variable
  ``KVMESH_FIELD_NAME`` when set, else from the dataclass default. Precedence:
  flag > env var > default.
- :func:`load_config` parses flags and env vars, builds the dataclass, calls ``validate()``
  and returns it. Bad values raise :class:`ConfigError` (``main`` turns it into exit code 2).
- ``validate()`` checks every field at once and raises one :class:`ConfigError` listing
  all problems. Subclasses extend it by overriding ``problems()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar


class ConfigError(ValueError):
    """One or more configuration values are invalid."""


def _env_name(field_name: str) -> str:
    return "KVMESH_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _base_type(tp: Any) -> Any:
    """Strip ``X | None`` to ``X``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _converter(tp: Any) -> Any:
    tp = _base_type(tp)
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    raise TypeError(f"unsupported config field type {tp!r}")


@dataclasses.dataclass
class BaseConfig:
    """Fields every kvmesh process shares."""

    namespace: str = dataclasses.field(
        default="kvmesh", metadata={"help": "etcd key and Redis stream namespace"}
    )
    etcd_endpoint: str = dataclasses.field(
        default="127.0.0.1:2379", metadata={"help": "etcd host:port"}
    )
    redis_url: str = dataclasses.field(
        default="", metadata={"help": "Redis of the KV event bus, redis://host:port "
                                      "(empty: no KV events)"}
    )
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "gRPC bind host"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port (0 = any free)"})
    advertise_host: str = dataclasses.field(
        default="", metadata={"help": "host published in etcd (default: --host)"}
    )
    lease_ttl: int = dataclasses.field(
        default=10, metadata={"help": "etcd lease TTL in seconds"}
    )
    grace_s: float = dataclasses.field(
        default=5.0, metadata={"help": "graceful shutdown grace period in seconds"}
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": "logging level"})

    def problems(self) -> list[str]:
        """Returns a list of human-readable problems; empty when valid."""
        out: list[str] = []
        if not self.namespace or "/" in self.namespace:
            out.append("namespace must be non-empty and contain no '/'")
        if ":" not in self.etcd_endpoint:
            out.append(f"etcd_endpoint must be host:port, got {self.etcd_endpoint!r}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "unix://")):
            out.append(f"redis_url must start with redis:// or unix://, got {self.redis_url!r}")
        if not 0 <= self.port <= 65535:
            out.append(f"port out of range: {self.port}")
        if self.lease_ttl < 1:
            out.append("lease_ttl must be >= 1 second")
        if self.grace_s < 0:
            out.append("grace_s must be >= 0")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            out.append(f"unknown log_level {self.log_level!r}")
        return out

    def validate(self) -> None:
        """Raises ConfigError listing every problem, or returns None."""
        found = self.problems()
        if found:
            raise ConfigError("invalid configuration: " + "; ".join(found))

    @property
    def public_host(self) -> str:
        """The host other processes use to reach this one."""
        return self.advertise_host or self.host

    def etcd_host_port(self) -> tuple[str, int]:
        """Splits ``etcd_endpoint`` into (host, port)."""
        host, _, port = self.etcd_endpoint.rpartition(":")
        return host, int(port)


C = TypeVar("C", bound=BaseConfig)


def build_parser(
    cls: type[BaseConfig], environ: typing.Mapping[str, str]
) -> argparse.ArgumentParser:
    """Builds an argparse parser for ``cls`` whose defaults come from ``environ``."""
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        conv = _converter(hints[f.name])
        env = _env_name(f.name)
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if env in environ:
            try:
                default = conv(environ[env])
            except ValueError as exc:
                raise ConfigError(f"{env}: {exc}") from exc
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (env {env}, default {default!r})"
        if conv is _parse_bool:
            parser.add_argument(flag, dest=f.name, type=_parse_bool, nargs="?", const=True,
                                default=default, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=conv, default=default, help=help_text)
    return parser


def load_config(
    cls: type[C], argv: Sequence[str] | None = None, environ: typing.Mapping[str, str] | None = None
) -> C:
    """Parses flags (``argv``) and env vars (``environ``) into ``cls`` and validates it."""
    env = os.environ if environ is None else environ
    parser = build_parser(cls, env)
    try:
        ns = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            raise
        raise ConfigError(f"bad command line (exit {exc.code})") from exc
    cfg = cls(**vars(ns))
    cfg.validate()
    return cfg
