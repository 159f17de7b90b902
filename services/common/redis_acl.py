"""Redis ACL users per mesh role: a pure builder of ACL file lines, and its file.

Contract:

- :func:`acl_lines` (namespace, role → password) returns the lines of a Redis 7 ACL file
  (``--aclfile``). Passwords appear only as SHA-256 hashes (``#<hex>``). Each user starts
  from nothing (``reset``: no commands, keys or channels). The rules:

  - ``default``: off. A connection that has not authenticated can run nothing but
    ``AUTH`` / ``HELLO``, which Redis never checks against ACLs.
  - ``worker``: ``XADD`` (and ``PING``) on the namespace's event stream
    (:func:`services.common.event_bus.stream_name`) and nothing else. It cannot read the
    stream, DEL it, touch another key, or run FLUSHALL, CONFIG or KEYS. Every worker
    shares this user. Which worker wrote an entry is proven by its signature
    (:mod:`services.common.event_bus`), not by the Redis user. Known limit: an ACL cannot
    restrict XADD's arguments, so a compromised worker can trim the stream (``MAXLEN 0``,
    ``MINID``: the indexer's gap detection resyncs every worker) or add the largest
    possible entry id, after which every XADD fails ("the stream has exhausted the last
    possible ID"; each relay logs it and an admin must DEL the stream). One stream and
    one Redis user per worker would confine that to the worker itself.
  - ``indexer`` and ``router`` (a router with an embedded index): read the stream through
    a consumer group, and only that key: ``XREADGROUP``, ``XACK``, ``XGROUP CREATE`` /
    ``SETID`` / ``CREATECONSUMER`` / ``DELCONSUMER``, ``XREAD``, ``XRANGE``,
    ``XREVRANGE``, ``XLEN``, ``XINFO``, ``XPENDING``, ``XCLAIM``, ``XAUTOCLAIM``, plus
    ``INFO`` (the feed reads ``run_id`` to notice a Redis restart) and ``PING``. They
    cannot XADD, XDEL, XTRIM or DEL there. A ``router`` also has one Redis 7 selector
    allowing ``XADD`` and ``XREAD`` of the namespace's replica sync stream
    (:func:`sync_stream`) and nothing else there (known limit: ``XADD`` with ``MAXLEN 0``
    empties it; the next snapshots refill it), and ``TIME`` (where a replica starts
    reading that stream).
  - ``store_master``: every ``@read`` / ``@write`` / ``@transaction`` command on its own
    keys ``kvmesh:<ns>:store:*`` (:func:`store_key_pattern`, the keys of
    :mod:`services.store_master.persist`), plus ``INFO`` and ``PING``. It gets no
    ``@dangerous`` command (FLUSHALL, FLUSHDB, KEYS, CONFIG, DEBUG, SWAPDB, ...), and no
    ``SCAN`` / ``RANDOMKEY``, which would show other roles' key names. It cannot XADD to
    the event stream.
  - ``admin`` (operators' tools, the ``admin`` certificate's password): everything.

  A role without a password gets no user, so it cannot log in. An unknown role raises
  ValueError naming it.
- :func:`write_acl_file` (tls folder, namespace) reads the passwords
  (``redis-<role>.pass``, :func:`services.common.tls.redis_password_file`) of the roles
  that have one, and writes the ACL file ``redis-users.acl`` there (mode 0600). It returns
  the file's path. It is idempotent, so every Redis start rewrites it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from services.common.event_bus import stream_name


def sync_stream(namespace: str) -> str:
    """The namespace's router replica sync stream key (:mod:`services.router.replica_sync`
    uses this one)."""
    return f"kvmesh:{namespace}:router-sync"

ACL_FILE = "redis-users.acl"
ACL_ROLES = ("worker", "indexer", "router", "store_master", "admin")
CONNECT = ("+ping",)
STREAM_READ = ("+xreadgroup", "+xack", "+xgroup|create", "+xgroup|setid",
               "+xgroup|createconsumer", "+xgroup|delconsumer", "+xread", "+xrange",
               "+xrevrange", "+xlen", "+xinfo", "+xpending", "+xclaim", "+xautoclaim",
               "+info")
STORE = ("+@read", "+@write", "+@transaction", "-@dangerous", "-scan", "-randomkey",
         "+info")


def store_key_pattern(namespace: str) -> str:
    """The glob of the store master's keys (:mod:`services.store_master.persist`)."""
    return f"kvmesh:{namespace}:store:*"


def _rules(role: str, namespace: str) -> tuple[str, ...]:
    stream = stream_name(namespace)
    if role == "worker":
        return ("-@all", *CONNECT, "+xadd", f"%W~{stream}")
    if role == "indexer":
        return ("-@all", *CONNECT, *STREAM_READ, f"~{stream}")
    if role == "router":  # the indexer's rules, plus a selector: XADD/XREAD of the sync
        # stream; TIME: where a replica starts reading it (services.router.replica_sync)
        return ("-@all", *CONNECT, *STREAM_READ, f"~{stream}", "+time",
                f"(+xadd +xread ~{sync_stream(namespace)})")
    if role == "store_master":
        return ("-@all", *CONNECT, *STORE, f"~{store_key_pattern(namespace)}")
    if role == "admin":
        return ("+@all", "~*", "&*")
    raise ValueError(f"role: no Redis ACL rules for {role!r}; one of {', '.join(ACL_ROLES)}")


def _check_namespace(namespace: str) -> None:
    bad = set(namespace) & set(" *?[]\\\n\r\t")
    if not namespace or bad:
        raise ValueError(f"namespace: {namespace!r} must be non-empty, without spaces or "
                         "glob characters")


def acl_lines(namespace: str, passwords: Mapping[str, str]) -> list[str]:
    """The ACL file lines of ``passwords`` (role → password); see the module docstring."""
    _check_namespace(namespace)
    lines = ["user default reset off"]
    for role, password in sorted(passwords.items()):
        rules = _rules(role, namespace)
        if not password:
            raise ValueError(f"passwords[{role!r}]: empty")
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(" ".join(["user", role, "reset", "on", f"#{digest}", *rules]))
    return lines


def write_acl_file(tls_dir: Path, namespace: str) -> Path:
    """Writes ``tls_dir/redis-users.acl`` from the passwords found there; returns it."""
    from services.common.tls import redis_password_file

    passwords = {}
    for role in ACL_ROLES:
        path = tls_dir / redis_password_file(role)
        if path.is_file():
            passwords[role] = path.read_text().strip()
    text = "\n".join(acl_lines(namespace, passwords)) + "\n"
    out = tls_dir / ACL_FILE
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return out
