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
- The machinery takes any dataclass (``kvmesh up`` drives its parser with
  :class:`services.launcher.up.MeshSpec`): :func:`add_fields` adds one flag per field to a
  parser, with field types ``str``, ``int``, ``float``, ``bool`` (``--flag`` alone means
  true), ``pathlib.Path`` or ``X | None`` of one of those; field metadata ``help`` is the
  flag's help, ``choices`` its allowed values (checked for the flag and the variable), and
  ``flag: False`` keeps a field off the command line. :func:`from_args` builds the
  dataclass from the parsed flags (fields without a flag keep their defaults).
- TLS fields (:mod:`services.common.tls`): ``tls_dir`` (empty: insecure, one warning
  logged), ``tls_cert`` (certificate stem, default the role), ``insecure`` (overrides
  ``tls_dir``); ``problems()`` rejects a ``tls_dir`` without ``ca.pem``.
- :class:`SeededConfig` is :class:`BaseConfig` plus ``--seed`` (default -1) for a process
  whose choices are random; ``problems()`` rejects a seed below -1, naming the field.
  :func:`seeded_rng` turns the seed into the process's ``random.Random``: a seed ≥ 0
  gives the same draws every run, -1 one seeded from the OS.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar


class ConfigError(ValueError):
    """One or more configuration values are invalid."""


def env_name(field_name: str) -> str:
    """The environment variable of field ``field_name``: ``KVMESH_FIELD_NAME``."""
    return "KVMESH_" + field_name.upper()


def flag_name(field_name: str) -> str:
    """The command-line flag of field ``field_name``: ``--field-name``."""
    return "--" + field_name.replace("_", "-")


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` → True, ``0/false/no/off`` or empty → False, else ValueError."""
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
        return parse_bool
    if tp in (int, float, str, Path):
        return tp
    raise TypeError(f"unsupported config field type {tp!r}")


@dataclasses.dataclass
class BaseConfig:
    """Fields every kvmesh process shares."""

    namespace: str = dataclasses.field(
        default="kvmesh", metadata={"help": "etcd key and Redis stream namespace"}
    )
    etcd_endpoint: str = dataclasses.field(
        default="127.0.0.1:2379", metadata={"help": "etcd host:port, or https://host:port "
                                                    "(mTLS with the role's certificate, "
                                                    "needs --tls-dir)"}
    )
    redis_url: str = dataclasses.field(
        default="", metadata={"help": "Redis of the KV event bus, redis://host:port, or "
                                      "rediss://host:port (TLS and the role's ACL user, "
                                      "needs --tls-dir); empty: no KV events"}
    )
    host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "gRPC bind host"})
    port: int = dataclasses.field(default=0, metadata={"help": "gRPC port (0 = any free)"})
    health_port: int = dataclasses.field(
        default=-1, metadata={"help": "plaintext port on --host serving only grpc.health.v1 "
                                      "(the kubelet's native grpc probe cannot present a "
                                      "client certificate); -1: none, 0: any free"}
    )
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
    tls_dir: str = dataclasses.field(
        default="", metadata={"help": "folder with the mesh CA (ca.pem) and role certificates "
                                      "(<role>.pem, <role>-key.pem; `kvmesh certs`): every "
                                      "gRPC server requires client certificates and authorizes "
                                      "by role, every client presents its role's (empty: "
                                      "insecure)"}
    )
    tls_cert: str = dataclasses.field(
        default="", metadata={"help": "certificate file stem in --tls-dir, e.g. "
                                      "worker-decode-0 (default: the process's role)"}
    )
    insecure: bool = dataclasses.field(
        default=False, metadata={"help": "plaintext gRPC without authorization, even with "
                                         "--tls-dir"}
    )

    def problems(self) -> list[str]:
        """Returns a list of human-readable problems; empty when valid."""
        out: list[str] = []
        if self.tls_dir and not self.insecure and not Path(self.tls_dir, "ca.pem").is_file():
            out.append(f"tls_dir: {self.tls_dir!r} has no ca.pem (run `kvmesh certs --out "
                       f"{self.tls_dir}`)")
        if not self.namespace or "/" in self.namespace:
            out.append("namespace must be non-empty and contain no '/'")
        if ":" not in self.etcd_endpoint:
            out.append(f"etcd_endpoint must be host:port, got {self.etcd_endpoint!r}")
        elif self.etcd_endpoint.startswith("https://") and (not self.tls_dir or self.insecure):
            out.append(f"etcd_endpoint {self.etcd_endpoint!r} is https: it needs --tls-dir "
                       f"(a client certificate), not --insecure")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://",
                                                              "unix://")):
            out.append("redis_url must start with redis://, rediss:// (TLS) or unix://, got "
                       f"{self.redis_url!r}")
        if not 0 <= self.port <= 65535:
            out.append(f"port out of range: {self.port}")
        if not -1 <= self.health_port <= 65535:
            out.append(f"health_port out of range: {self.health_port} (-1: none)")
        elif self.health_port > 0 and self.health_port == self.port:
            out.append(f"health_port must differ from port ({self.port})")
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


def _seed_problem(seed: int) -> str | None:
    return f"seed must be >= 0, or -1 for one from the OS; got {seed}" if seed < -1 else None


def seeded_rng(seed: int) -> random.Random:
    """``random.Random(seed)`` for ``seed >= 0`` (reproducible draws); for -1 a generator
    seeded from the OS. Any other negative seed is a ValueError."""
    problem = _seed_problem(seed)
    if problem is not None:
        raise ValueError(problem)
    return random.Random(None if seed == -1 else seed)


@dataclasses.dataclass
class SeededConfig(BaseConfig):
    """BaseConfig plus the seed of the process's random choices (see :func:`seeded_rng`)."""

    seed: int = dataclasses.field(
        default=-1, metadata={"help": "seed of this process's random choices, for "
                                      "reproducible runs (-1: from the OS)"}
    )

    def problems(self) -> list[str]:
        problem = _seed_problem(self.seed)
        return super().problems() + ([problem] if problem else [])


C = TypeVar("C", bound=BaseConfig)
D = TypeVar("D")


def _flag_fields(cls: type[Any]) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def add_fields(parser: argparse.ArgumentParser, cls: type[Any],
               environ: Mapping[str, str]) -> list[str]:
    """Adds a flag for each field of dataclass ``cls`` to ``parser`` (see the module
    docstring), its default taken from ``environ`` when the field's variable is set there.
    A variable whose value does not convert, or is not one of the field's ``choices``,
    leaves the dataclass default and is returned as a problem naming it (the caller
    decides when to report them)."""
    problems = []
    hints = typing.get_type_hints(cls)
    for f in _flag_fields(cls):
        conv = _converter(hints[f.name])
        env = env_name(f.name)
        choices = f.metadata.get("choices")
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if env in environ:
            raw = environ[env]
            try:
                value = conv(raw)
            except ValueError as exc:
                problems.append(f"{env}={raw!r}: {exc}")
            else:
                if choices is not None and value not in choices:
                    problems.append(f"{env}={raw!r}: not one of {', '.join(map(str, choices))}")
                else:
                    default = value
        shown = str(default) if isinstance(default, Path) else default
        help_text = f"{f.metadata.get('help', '')} (env {env}, default {shown!r})"
        if conv is parse_bool:
            parser.add_argument(flag_name(f.name), dest=f.name, type=parse_bool, nargs="?",
                                const=True, default=default, help=help_text)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, type=conv, default=default,
                                choices=choices, help=help_text)
    return problems


def from_args(cls: type[D], args: argparse.Namespace) -> D:
    """Dataclass ``cls`` from the flags :func:`add_fields` added (not validated); fields
    without a flag keep their defaults, other attributes of ``args`` are ignored."""
    return cls(**{f.name: getattr(args, f.name) for f in _flag_fields(cls)})


def build_parser(cls: type[BaseConfig], environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """Builds an argparse parser for ``cls`` whose defaults come from ``environ``; a bad
    variable raises ConfigError naming every bad one."""
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip().splitlines()[0])
    problems = add_fields(parser, cls, environ)
    if problems:
        raise ConfigError("invalid environment: " + "; ".join(problems))
    return parser


def load_config(
    cls: type[C], argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
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
    cfg = from_args(cls, ns)
    cfg.validate()
    return cfg
