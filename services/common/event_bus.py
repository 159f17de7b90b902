"""The KV event bus on Redis Streams: stream naming and the entry format.

Contract:

- One stream per namespace, :func:`stream_name` (``kvmesh:<namespace>:kv-events``).
- Each entry has the fields ``w`` (worker id), ``k`` (kind) and ``d`` (a serialized
  protobuf): kind ``b`` = a :class:`~protos.kv_events_pb2.KvEventBatch` (consecutive
  events of one worker, ids without holes), kind ``s`` = a
  :class:`~protos.kv_events_pb2.KvState` (a full-state resync a worker published
  itself because its engine's events could not be replayed).
- :func:`encode_batch` / :func:`encode_state` build the field maps for ``XADD``;
  :func:`decode_entry` parses one entry's fields back into the message, raising
  :class:`BadEntry` for anything malformed (the consumer skips it and counts it).
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.message import DecodeError

from protos import kv_events_pb2

BATCH = b"b"
STATE = b"s"


class BadEntry(ValueError):
    """A stream entry that is not a kvmesh KV event entry."""


def stream_name(namespace: str) -> str:
    """The namespace's KV event stream key."""
    return f"kvmesh:{namespace}:kv-events"


def encode_batch(batch: kv_events_pb2.KvEventBatch) -> dict[bytes, bytes]:
    """XADD fields for an event batch."""
    return {b"w": batch.worker_id.encode(), b"k": BATCH, b"d": batch.SerializeToString()}


def encode_state(state: kv_events_pb2.KvState) -> dict[bytes, bytes]:
    """XADD fields for a full-state resync."""
    return {b"w": state.worker_id.encode(), b"k": STATE, b"d": state.SerializeToString()}


def decode_entry(
    fields: Mapping[bytes, bytes],
) -> kv_events_pb2.KvEventBatch | kv_events_pb2.KvState:
    """The message in one stream entry."""
    kind, data = fields.get(b"k"), fields.get(b"d")
    if data is None or kind not in (BATCH, STATE):
        raise BadEntry(f"not a KV event entry (fields {sorted(fields)})")
    msg: kv_events_pb2.KvEventBatch | kv_events_pb2.KvState
    msg = kv_events_pb2.KvEventBatch() if kind == BATCH else kv_events_pb2.KvState()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise BadEntry(f"undecodable {kind!r} entry: {exc}") from None
    if not msg.worker_id:
        raise BadEntry("entry without worker id")
    return msg
