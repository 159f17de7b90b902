"""The KV event bus on Redis Streams: stream naming and the entry format.

Contract:

- One stream per namespace, :func:`stream_name` (``kvmesh:<namespace>:kv-events``).
- Each entry has the fields ``w`` (worker id), ``k`` (kind) and ``d`` (a serialized
  protobuf): kind ``b`` = a :class:`~protos.kv_events_pb2.KvEventBatch` (consecutive
  events of one worker, ids without holes), kind ``s`` = a
  :class:`~protos.kv_events_pb2.KvState` (a full-state resync a worker published
  itself because its engine's events could not be replayed). A signed entry (a mesh with
  certificates) also has ``m``, the signer's MAC, and, when the signer is not ``w``
  itself, ``s``: the signer's name (its certificate's name; a mock fleet signs the
  events of its workers ``<name>.<suffix>`` as ``<name>``). Absent ``s`` means the
  signer is ``w``. ``m`` = HMAC-SHA256(the signer's event key, :func:`mac_input`), where
  ``mac_input(w, k, d)`` = ``b"kvmesh-ev1"`` + len(w) as 4 bytes big-endian + w + k + d
  and, with ``s``, ``mac_input(w, k, d, s)`` = ``b"kvmesh-ev2"`` + len(s) as 4 bytes
  big-endian + s + len(w) (4 bytes) + w + k + d, so ``s`` is covered too. The signer's
  key is :func:`services.common.tls.derive_event_key` (events secret, signer name).
- :func:`encode_batch` / :func:`encode_state` build the field maps for ``XADD``. With a
  ``key`` they add ``m`` (and ``s`` for a ``signer`` other than the message's worker).
  :func:`decode_entry` parses one entry's fields back into the message. It raises
  :class:`BadEntry` for anything malformed (the consumer skips it and counts it). Given
  ``keys`` (signer name → its event key, None for an unknown signer), it accepts only
  entries whose ``m`` verifies under the signer's key, whose signer may act as ``w``
  (:func:`services.common.worker_ids.may_act_as`: ``w`` itself, or a sub-id
  ``<signer>.<suffix>`` of a fleet certificate ``fleet[-<x>]``) and whose message names
  that same worker ``w``. Otherwise it raises :class:`BadSignature` (a BadEntry) with
  ``reason`` :data:`UNSIGNED` (no ``m``) or :data:`FORGED` (wrong MAC, an unknown
  signer, a signer that may not act as ``w``, or a message for another worker than
  ``w``). Without ``keys`` (a mesh without certificates) ``m`` and ``s`` are ignored and
  unsigned entries are accepted, as before.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping

from google.protobuf.message import DecodeError

from protos import kv_events_pb2
from services.common.worker_ids import may_act_as

BATCH = b"b"
STATE = b"s"
MAC_CONTEXT = b"kvmesh-ev1"
MAC_CONTEXT_SIGNER = b"kvmesh-ev2"  # an entry naming its signer (field s)
UNSIGNED = "unsigned"
FORGED = "forged"
KeyLookup = Callable[[str], bytes | None]


class BadEntry(ValueError):
    """A stream entry that is not a kvmesh KV event entry."""


class BadSignature(BadEntry):
    """An entry whose sender is not proven: ``reason`` is UNSIGNED or FORGED; ``worker_id``
    is the sender the entry claims (its ``w`` field), ``signer`` who it says signed it
    (``s``, else ``w``)."""

    def __init__(self, reason: str, worker_id: str, detail: str, signer: str = "") -> None:
        by = f" signed by {signer!r}" if signer and signer != worker_id else ""
        super().__init__(f"{reason} entry for worker {worker_id!r}{by}: {detail}")
        self.reason = reason
        self.worker_id = worker_id
        self.signer = signer or worker_id


def stream_name(namespace: str) -> str:
    """The namespace's KV event stream key."""
    return f"kvmesh:{namespace}:kv-events"


def mac_input(worker: bytes, kind: bytes, data: bytes, signer: bytes = b"") -> bytes:
    """The bytes an entry's MAC covers (module docstring); ``signer`` b"" = no ``s``."""
    head = MAC_CONTEXT_SIGNER + len(signer).to_bytes(4, "big") + signer if signer \
        else MAC_CONTEXT
    return head + len(worker).to_bytes(4, "big") + worker + kind + data


def _mac(key: bytes, worker: bytes, kind: bytes, data: bytes, signer: bytes) -> bytes:
    return hmac.new(key, mac_input(worker, kind, data, signer), hashlib.sha256).digest()


def _fields(worker_id: str, kind: bytes, data: bytes, key: bytes | None,
            signer: str) -> dict[bytes, bytes]:
    w = worker_id.encode()
    fields = {b"w": w, b"k": kind, b"d": data}
    if key is not None:
        s = signer.encode() if signer and signer != worker_id else b""
        if s:
            fields[b"s"] = s
        fields[b"m"] = _mac(key, w, kind, data, s)
    return fields


def encode_batch(batch: kv_events_pb2.KvEventBatch, key: bytes | None = None,
                 signer: str = "") -> dict[bytes, bytes]:
    """XADD fields for an event batch, signed with ``key`` (of ``signer``, default the
    batch's worker) if given."""
    return _fields(batch.worker_id, BATCH, batch.SerializeToString(), key, signer)


def encode_state(state: kv_events_pb2.KvState, key: bytes | None = None,
                 signer: str = "") -> dict[bytes, bytes]:
    """XADD fields for a full-state resync, signed with ``key`` (of ``signer``, default
    the state's worker) if given."""
    return _fields(state.worker_id, STATE, state.SerializeToString(), key, signer)


def _text(fields: Mapping[bytes, bytes], name: bytes, what: str) -> str | None:
    """Field ``name`` as text (None when absent); BadEntry when empty or not UTF-8."""
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise BadEntry(f"{what} {raw[:64]!r} is not UTF-8") from None
    if not text:
        raise BadEntry(f"entry without {what} (empty)")
    return text


def _verify(fields: Mapping[bytes, bytes], kind: bytes, data: bytes, keys: KeyLookup) -> str:
    """The sender ``w`` once its signer's MAC verifies and the signer may act as it;
    BadSignature otherwise."""
    sender = _text(fields, b"w", "worker id")
    if sender is None:
        raise BadEntry("entry without worker id")
    named = _text(fields, b"s", "signer (field s)")
    signer = named or sender
    mac = fields.get(b"m")
    if mac is None:
        raise BadSignature(UNSIGNED, sender, "no MAC (field m)", signer)
    if not may_act_as(signer, sender):
        raise BadSignature(FORGED, sender, f"{signer!r} may not act as {sender!r} "
                           f"(only as itself, or a fleet certificate as its sub-ids "
                           f"<name>.<suffix>)", signer)
    key = keys(signer)
    if key is None:
        raise BadSignature(FORGED, sender, "no event key for this signer", signer)
    s = named.encode() if named is not None else b""
    if not hmac.compare_digest(mac, _mac(key, sender.encode(), kind, data, s)):
        raise BadSignature(FORGED, sender, "MAC does not verify", signer)
    return sender


def decode_entry(
    fields: Mapping[bytes, bytes], keys: KeyLookup | None = None,
) -> kv_events_pb2.KvEventBatch | kv_events_pb2.KvState:
    """The message in one stream entry; with ``keys`` only a signed one (module
    docstring)."""
    kind, data = fields.get(b"k"), fields.get(b"d")
    if data is None or kind not in (BATCH, STATE):
        raise BadEntry(f"not a KV event entry (fields {sorted(fields)})")
    sender = _verify(fields, kind, data, keys) if keys is not None else None
    msg: kv_events_pb2.KvEventBatch | kv_events_pb2.KvState
    msg = kv_events_pb2.KvEventBatch() if kind == BATCH else kv_events_pb2.KvState()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise BadEntry(f"undecodable {kind!r} entry: {exc}") from None
    if not msg.worker_id:
        raise BadEntry("entry without worker id")
    if sender is not None and msg.worker_id != sender:
        raise BadSignature(FORGED, sender, f"it carries events of {msg.worker_id!r}")
    return msg
