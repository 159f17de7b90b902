"""Which worker ids a worker certificate may act as: the one rule that etcd's grants
(:mod:`services.common.etcd_auth`), the indexer's check of signed KV events
(:mod:`services.common.event_bus`) and the workers' config (:mod:`workers.config`,
:mod:`workers.fleet`) all apply.

Contract (pure):

- :func:`may_act_as` (``name``, ``worker_id``): the instance certificate ``worker:<name>``
  may act as worker id ``<name>`` itself and as any *sub-id* ``<name>.<suffix>``, where
  the suffix is one or more letters, digits, ``-`` or ``_`` (:data:`SUFFIX_CHARS`). So
  ``name.`` (empty suffix), ``name.x.y`` (a second dot), ``namex`` and ``other.name`` are
  refused. Sub-ids are what a mock fleet (many workers in one process, one certificate)
  names its workers.
- Sub-ids exist only for an instance name without a dot (:func:`tls.issue` refuses a
  worker instance name with a dot, and :func:`etcd_auth.plan` an identity with one), so
  the owner of a worker id is unambiguous: the part before its first dot. A name with a
  dot (a certificate issued before this rule) acts only as itself, and so does the shared
  role certificate (name :data:`SHARED_NAME`), which binds no worker id.
- :func:`sub_id` (``name``, ``suffix``) builds ``<name>.<suffix>``; ValueError naming
  the suffix when the result is not one ``name`` may act as.
"""

from __future__ import annotations

import string

SEPARATOR = "."
SUFFIX_CHARS = frozenset(string.ascii_letters + string.digits + "-_")
SHARED_NAME = "worker"  # the shared role certificate ``worker`` (its CN is the role)


def has_sub_ids(name: str) -> bool:
    """Whether certificate ``name`` may act as sub-ids at all (module docstring)."""
    return bool(name) and name != SHARED_NAME and SEPARATOR not in name


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
        why = ("certificate name has a dot or is the shared 'worker' certificate"
               if not has_sub_ids(name) else "it must be letters, digits, '-' or '_'")
        raise ValueError(f"suffix {suffix!r}: {out!r} is no sub-id of {name!r} ({why})")
    return out
