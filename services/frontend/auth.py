"""Frontend API keys and tenants (pure: no sockets, no asyncio, no clock).

Contract:

- Keys come from ``--api-keys``/``KVMESH_API_KEYS`` (comma-separated; ``--api-key K`` may
  be repeated, see :func:`merge_api_key_flags`) and from ``--api-key-file``: one
  ``key [tenant]`` per line, a field starting with ``#`` starts a comment (a ``#`` inside
  a key is part of it), blank lines are skipped (:func:`parse_key_file`,
  :class:`KeyFileError` naming the line). Nothing given fails open to a weaker setting:
  an empty ``--api-key``, one holding a comma, an empty item in a non-empty list, and a
  key file without any key are errors (the API would otherwise be open). A key without a
  tenant (every ``--api-keys`` key) is its own tenant, named
  :func:`key_tenant` (the first 16 hex digits of its SHA-256), so isolation per key is
  the default. A key listed twice is an error, even with the same tenant.
- :class:`ApiKeys` ``check(header)`` takes an HTTP ``Authorization`` value (or gRPC
  ``authorization`` metadata), ``Bearer <key>`` (scheme case-insensitive), and returns
  the key's :class:`Tenant`, or raises :class:`Unauthorized` (missing header, another
  scheme, unknown key; the message never echoes the key). The comparison is constant in
  time with respect to which key matched: SHA-256 of the presented key is compared with
  :func:`hmac.compare_digest` against the digest of *every* configured key, without
  stopping at the first match (equal-length digests: the key's length leaks nothing
  either). With no key configured (``ApiKeys.enabled`` False) every caller is the
  :data:`OPEN` tenant, as vLLM without ``--api-key``.
- A tenant's cache salt (:func:`tenant_salt`) is the first 16 hex digits of
  SHA-256(``"kvmesh-tenant\\0" + tenant``): never the key itself, stable across restarts
  and frontends. With ``shared`` (``--shared-prefix-cache``, an explicit opt-in) every
  tenant gets salt "" and all tenants share one prefix cache; the open tenant always
  has salt "" (nothing to isolate from).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FLAG_ONE = "--api-key"
FLAG_MANY = "--api-keys"
MAX_KEY_CHARS = 4096


class Unauthorized(Exception):
    """A missing or invalid API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class KeyFileError(ValueError):
    """A malformed API key file or key list; the message names the line or the key's
    position (never the key)."""


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to: its name (for logs and metrics) and cache salt."""

    name: str
    cache_salt: str


OPEN = Tenant("open", "")


def key_tenant(key: str) -> str:
    """The tenant name of a key without one: the first 16 hex digits of SHA-256(key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant_salt(tenant: str) -> str:
    """The cache salt of ``tenant`` (see the module docstring)."""
    return hashlib.sha256(b"kvmesh-tenant\0" + tenant.encode()).hexdigest()[:16]


def merge_api_key_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` with every ``--api-key K`` / ``--api-key=K`` (repeatable) folded, with any
    ``--api-keys``, into one ``--api-keys K1,K2,...`` (the config parser takes one value
    per flag). Other arguments keep their order. A ``--api-key`` without a value is left
    for the parser to refuse; an empty ``--api-key`` value or one holding a comma raises
    KeyFileError (one key per flag: "a,b" would silently make "b" a key)."""
    out: list[str] = []
    keys: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        for flag in (FLAG_ONE, FLAG_MANY):
            value: str | None = None
            if arg == flag and i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            elif arg.startswith(flag + "="):
                value, i = arg[len(flag) + 1:], i + 1
            if value is None:
                continue
            if flag == FLAG_ONE and (not value.strip() or "," in value):
                raise KeyFileError(f"{FLAG_ONE}: one non-empty key per flag, without commas "
                                   "(use --api-keys K1,K2 for a list)")
            keys.append(value)
            break
        else:
            out.append(arg)
            i += 1
    if keys:
        out += [FLAG_MANY, ",".join(keys)]
    return out


def split_keys(text: str) -> list[str]:
    """The keys of a comma-separated list (surrounding blanks stripped); "" (not given)
    has none; an empty item in a non-empty list raises KeyFileError naming its position
    (a list of blanks would otherwise leave the API open)."""
    if not text:
        return []
    items = [k.strip() for k in text.split(",")]
    for n, k in enumerate(items, 1):
        if not k:
            raise KeyFileError(f"item #{n} of the key list is empty")
    return items


def parse_key_file(text: str) -> list[tuple[str, str | None]]:
    """``(key, tenant or None)`` per line of an API key file (see the module docstring)."""
    out: list[tuple[str, str | None]] = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        comment = next((i for i, f in enumerate(fields) if f.startswith("#")), len(fields))
        fields = fields[:comment]
        if not fields:
            continue
        if len(fields) > 2:
            raise KeyFileError(f"line {n}: expected 'key [tenant]', got {len(fields)} fields")
        out.append((fields[0], fields[1] if len(fields) == 2 else None))
    return out


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    """The configured keys and their tenants; see the module docstring."""

    def __init__(self, entries: Iterable[tuple[str, str | None]], shared: bool = False) -> None:
        self.shared = shared
        self._digests: list[bytes] = []
        self._tenants: list[Tenant] = []
        seen: set[bytes] = set()
        for i, (key, tenant) in enumerate(entries, 1):
            if not key or any(c.isspace() for c in key) or len(key) > MAX_KEY_CHARS:
                raise KeyFileError(f"API key #{i}: must be 1..{MAX_KEY_CHARS} characters "
                                   "without blanks")
            d = _digest(key)
            if d in seen:
                raise KeyFileError(f"API key #{i} is listed twice")
            seen.add(d)
            name = tenant or key_tenant(key)
            self._digests.append(d)
            self._tenants.append(Tenant(name, "" if shared else tenant_salt(name)))

    @classmethod
    def from_sources(cls, keys: str = "", file_text: str | None = None,
                     shared: bool = False) -> ApiKeys:
        """Keys from a comma-separated list and the text of a key file (None: no file)."""
        entries: list[tuple[str, str | None]] = [(k, None) for k in split_keys(keys)]
        if file_text is not None:
            in_file = parse_key_file(file_text)
            if not in_file:
                raise KeyFileError("no key in the file (the API would be open)")
            entries += in_file
        return cls(entries, shared=shared)

    @property
    def enabled(self) -> bool:
        """True when at least one key is configured (else the API is open)."""
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def tenants(self) -> set[str]:
        """The configured tenant names."""
        return {t.name for t in self._tenants}

    def check(self, header: str | None) -> Tenant:
        """The tenant of ``Authorization: Bearer <key>``; Unauthorized otherwise."""
        if not self.enabled:
            return OPEN
        if not header:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <key>'")
        presented = _digest(key.strip())
        found = -1
        for i, d in enumerate(self._digests):
            hit = hmac.compare_digest(presented, d)  # every key, no early exit
            found = i if hit else found
        if found < 0:
            raise Unauthorized("invalid API key")
        return self._tenants[found]
