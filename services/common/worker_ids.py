"""Which worker ids a worker certificate may act as: the one rule that etcd's grants
(:mod:`services.common.etcd_auth`), the indexer's check of signed KV events
(:mod:`services.common.event_bus`) and the workers' config (:mod:`workers.config`,
:mod:`workers.fleet`) all apply.

Contract (pure):

- Only a *fleet certificate* has sub-ids: an instance certificate ``worker:<name>``
  whose name is :data:`FLEET_NAME` (``fleet``) or :data:`FLEET_PREFIX` (``fleet-``) and
  at least one more character, without a dot (:func:`has_sub_ids`). A mock fleet (many
  workers in one process, one certificate) names its workers with them. Every other
  worker instance certificate (``kvmesh up``'s ``decode-0``, compose's ``w0``, a
  planner's worker) acts only as its exact name, so a compromised real worker cannot
  register extra records, or sign KV events, for ids of its own making (issue 13:
  "workers may write only their own key").
- :func:`may_act_as` (``name``, ``worker_id``): the instance certificate ``worker:<name>``
  may act as worker id ``<name>`` itself and, for a fleet certificate only, as any
  *sub-id* ``<name>.<suffix>``, where the suffix is one or more letters, digits, ``-`` or
  ``_`` (:data:`SUFFIX_CHARS`). So ``name.`` (empty suffix), ``name.x.y`` (a second
  dot), ``namex`` and ``other.name`` are refused for every name.
- :func:`tls.issue` refuses a worker instance name with a dot, and
  :func:`etcd_auth.plan` an identity with one, so the owner of a worker id is
  unambiguous: the part before its first dot. A name with a dot (a certificate issued
  before this rule) acts only as itself, and so does the shared role certificate (name
  :data:`SHARED_NAME`), which binds no worker id.
- :func:`sub_id` (``name``, ``suffix``) builds ``<name>.<suffix>``; ValueError naming
  the suffix when the result is not one ``name`` may act as.
"""

from __future__ import annotations

import string

SEPARATOR = "."
SUFFIX_CHARS = frozenset(string.ascii_letters + string.digits + "-_")
SHARED_NAME = "worker"  # the shared role certificate ``worker`` (its CN is the role)
FLEET_NAME = "fleet"
FLEET_PREFIX = "fleet-"  # ``worker:fleet-<x>``: a mock fleet's certificate, with sub-ids


def has_sub_ids(name: str) -> bool:
    """Whether certificate ``name`` is a fleet certificate, the only kind that may act as
    sub-ids (module docstring): ``fleet`` or ``fleet-<x>``, without a dot."""
    fleet = name == FLEET_NAME or (name.startswith(FLEET_PREFIX) and name != FLEET_PREFIX)
    return fleet and SEPARATOR not in name


def valid_suffix(suffix: str) -> bool:
    """One or more letters, digits, ``-`` or ``_``."""
    return bool(suffix) and all(c in SUFFIX_CHARS for c in suffix)


def may_act_as(name: str, worker_id: str) -> bool:
    """Whether the instance certificate ``worker:<name>`` may act as ``worker_id``."""
    if not name:
        return False
    if worker_id == name:
        return True
    head, sep, suffix = worker_id.partition(SEPARATOR)
    return bool(sep) and head == name and has_sub_ids(name) and valid_suffix(suffix)


def sub_id(name: str, suffix: str) -> str:
    """``<name>.<suffix>``; ValueError naming ``suffix`` unless ``name`` may act as it."""
    out = f"{name}{SEPARATOR}{suffix}"
    if not may_act_as(name, out):
        why = (f"only a fleet certificate ({FLEET_NAME!r} or {FLEET_PREFIX}<x>, no dot) "
               f"has sub-ids" if not has_sub_ids(name)
               else "it must be letters, digits, '-' or '_'")
        raise ValueError(f"suffix {suffix!r}: {out!r} is no sub-id of {name!r} ({why})")
    return out
