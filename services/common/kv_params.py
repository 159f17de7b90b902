"""kv_transfer_params ↔ protobuf.

vLLM's connectors speak a dict (``kv_transfer_params``); kvmesh carries it between
processes as ``worker_pb2.KvTransferParams``. Contract: ``to_dict(from_dict(d)) == d`` for
every dict whose values are JSON-encodable, with the known keys in typed fields and the
rest JSON-encoded in ``extra``. Keys whose value is None are dropped on the way in (vLLM
treats a missing key and None alike).
"""

from __future__ import annotations

import json
from typing import Any

from protos import worker_pb2

_BOOL = ("do_remote_prefill", "do_remote_decode")
_STR = ("remote_engine_id", "remote_request_id", "remote_host", "transfer_mode")
_INT = ("remote_port", "tp_size")


def from_dict(params: dict[str, Any] | None) -> worker_pb2.KvTransferParams:
    """A dict from the engine → protobuf."""
    out = worker_pb2.KvTransferParams()
    for key, value in (params or {}).items():
        if value is None:
            continue
        if key in _BOOL and isinstance(value, bool):
            setattr(out, key, value)
        elif key in _STR and isinstance(value, str):
            setattr(out, key, value)
        elif key in _INT and isinstance(value, int) and not isinstance(value, bool):
            setattr(out, key, value)
        elif key == "remote_block_ids" and isinstance(value, list) and all(
            isinstance(b, int) for b in value
        ):
            out.remote_block_ids.extend(value)
        else:
            out.extra[key] = json.dumps(value)
    return out


def to_dict(msg: worker_pb2.KvTransferParams) -> dict[str, Any]:
    """Protobuf → the dict the engine's connector expects (unset fields omitted, except the
    two flags, which are always present)."""
    out: dict[str, Any] = {k: getattr(msg, k) for k in _BOOL}
    for key in (*_STR, *_INT):
        value = getattr(msg, key)
        if value:
            out[key] = value
    if msg.remote_block_ids:
        out["remote_block_ids"] = list(msg.remote_block_ids)
    for key, raw in msg.extra.items():
        out[key] = json.loads(raw)
    return out


def is_set(msg: worker_pb2.KvTransferParams) -> bool:
    """True when the message carries any parameter."""
    return msg.ByteSize() > 0


def held_blocks(msg: worker_pb2.KvTransferParams) -> int:
    """How many KV blocks the params name on the remote side (flat or per-group lists)."""
    if msg.remote_block_ids:
        return len(msg.remote_block_ids)
    raw = msg.extra.get("remote_block_ids")
    if raw is None:
        return 0
    groups = json.loads(raw)
    if not isinstance(groups, list):
        return 0
    return sum(len(g) if isinstance(g, list) else 1 for g in groups)
