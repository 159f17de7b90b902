"""kv_transfer_params ↔ protobuf.

vLLM's connectors speak a dict (``kv_transfer_params``); kvmesh carries it between
processes as ``worker_pb2.KvTransferParams``. Contract:

- ``to_dict(from_dict(d)) == d`` for every dict whose values are JSON values (None, bool,
  int, float, str, lists and str-keyed dicts of those) and that holds both flags
  ``do_remote_prefill`` and ``do_remote_decode`` (``to_dict`` always writes the two).
- Every key vLLM 0.32's NixlConnector / NixlPushConnector writes has a typed field (see
  ``_SCALARS``, plus ``remote_block_ids``: a flat list of ints, or one list per KV-cache
  group); a key no field knows travels in ``extra`` as a ``google.protobuf.Value``.
- On the way in, keys whose value is None are dropped, and so is an empty
  ``remote_block_ids`` (vLLM reads a missing, None and empty list alike:
  ``params.get("remote_block_ids")``). Tuples come back as lists; a number in ``extra``
  with an integral value comes back as an int (JSON has one number type; ids and counts
  must stay ints), so ``2.0`` there reads back as ``2`` (equal, of another type).
- Malformed input raises :class:`KvParamsError` (a ValueError) naming the key, in both
  directions: a typed key with a value of the wrong type or out of range, a value that is
  not JSON, an int in ``extra`` beyond 2**53 (a JSON number would not hold it exactly), a
  NaN or infinite number in ``extra`` (JSON has none); from protobuf, a Value with no
  kind, both block-id forms at once, or an ``extra`` key that has a typed field. The
  worker servicer answers INVALID_ARGUMENT for a request's params and INTERNAL for the
  engine's.
- :func:`validate_request` checks a *request's* params (a dict from :func:`to_dict`)
  before they reach an engine whose handoff mode is ``mode`` (``EngineInfo.handoff``:
  "pull", "push", "mock", or "" for none) and raises :class:`KvParamsError` naming the
  key. For every mode: ``do_remote_prefill`` and ``do_remote_decode`` are not both set;
  ``remote_port`` is in 1..65535; ``tp_size``, ``dcp_size``, ``pp_size`` and
  ``remote_block_size`` are >= 1; ``remote_num_tokens`` and
  ``remote_prefill_cached_tokens`` are >= 0; ``remote_blocks_expiry_time`` is finite;
  block ids are >= 0; ``transfer_mode`` is "pull" or "push". With ``do_remote_prefill``
  on a NIXL engine (vLLM 0.32's connectors read these keys unchecked: a missing one
  kills EngineCore with a KeyError or an assertion, or parks the request until it times
  out), the keys in :data:`REMOTE_PREFILL_KEYS` for that mode must be present (strings
  non-empty): pull needs ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
  ``remote_port`` and a non-empty ``remote_block_ids``; push needs the same side
  channel and ``tp_size`` (it seeds the block ids itself). The mock engine reads only
  the flags, so nothing more is required there.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2

from protos import worker_pb2

_FLAGS = ("do_remote_prefill", "do_remote_decode")
# dict key → (protobuf field, accepted Python types); every field has explicit presence.
_SCALARS: dict[str, tuple[str, tuple[type, ...]]] = {
    "remote_engine_id": ("remote_engine_id", (str,)),
    "remote_request_id": ("remote_request_id", (str,)),
    "remote_host": ("remote_host", (str,)),
    "remote_port": ("remote_port", (int,)),
    "tp_size": ("tp_size", (int,)),
    "dcp_size": ("dcp_size", (int,)),
    "pp_size": ("pp_size", (int,)),
    "transfer_mode": ("transfer_mode", (str,)),
    "remote_num_tokens": ("remote_num_tokens", (int,)),
    "remote_blocks_expiry_time": ("remote_blocks_expiry_time", (float, int)),
    "remote_block_size": ("remote_block_size", (int,)),
    "remote_prefill_cached_tokens": ("remote_prefill_cached_tokens", (int,)),
    "_remote_blocks_processed": ("remote_blocks_processed", (bool,)),
    "_p_side_truncated": ("p_side_truncated", (bool,)),
}
_BLOCKS = "remote_block_ids"
_TYPED = frozenset((*_FLAGS, *_SCALARS, _BLOCKS))
# Integers a JSON number (an IEEE double) holds exactly.
_MAX_EXACT_INT = 2**53


class KvParamsError(ValueError):
    """A kv_transfer_params value kvmesh cannot carry; the message names the key."""


def _where(key: str) -> str:
    return f"kv_transfer_params[{key!r}]"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(_is_int(b) for b in value)


def _set_blocks(out: worker_pb2.KvTransferParams, value: Any) -> None:
    flat = _is_id_list(value)
    if not flat and not (isinstance(value, list | tuple) and all(map(_is_id_list, value))):
        raise KvParamsError(f"{_where(_BLOCKS)}: expected a list of ints or a list of lists "
                            f"of ints, got {value!r}")
    try:
        if flat:
            out.remote_block_ids.extend(value)
        else:
            for group in value:
                out.remote_block_id_groups.add().block_ids.extend(group)
    except ValueError as exc:  # an id outside int32
        raise KvParamsError(f"{_where(_BLOCKS)}: {exc}") from None


def _set_scalar(out: worker_pb2.KvTransferParams, key: str, value: Any) -> None:
    name, types = _SCALARS[key]
    if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
        raise KvParamsError(f"{_where(key)}: expected {' or '.join(t.__name__ for t in types)}"
                            f", got {type(value).__name__} {value!r}")
    try:
        setattr(out, name, value)
    except (ValueError, OverflowError) as exc:  # out of the field's range
        raise KvParamsError(f"{_where(key)}: {exc}") from None


def _fill_value(where: str, value: Any, out: struct_pb2.Value) -> None:
    """Writes the JSON value ``value`` into ``out``."""
    if value is None:
        out.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        if abs(value) > _MAX_EXACT_INT:
            raise KvParamsError(f"{where}: the integer {value} exceeds 2**53, which a JSON "
                                "number holds exactly")
        out.number_value = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise KvParamsError(f"{where}: {value} is not a JSON number")
        out.number_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, list | tuple):
        out.list_value.SetInParent()
        for i, item in enumerate(value):
            _fill_value(f"{where}[{i}]", item, out.list_value.values.add())
    elif isinstance(value, dict):
        out.struct_value.SetInParent()
        for k, item in value.items():
            if not isinstance(k, str):
                raise KvParamsError(f"{where}: key {k!r} is not a string")
            _fill_value(f"{where}[{k!r}]", item, out.struct_value.fields[k])
    else:
        raise KvParamsError(f"{where}: {type(value).__name__} {value!r} is not a JSON value")


def _read_value(where: str, value: struct_pb2.Value) -> Any:
    """The JSON value in ``value``; integral numbers as ints."""
    kind = value.WhichOneof("kind")
    if kind == "null_value":
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "number_value":
        x = value.number_value
        if not math.isfinite(x):
            raise KvParamsError(f"{where}: {x} is not a JSON number")
        return int(x) if x.is_integer() and abs(x) <= _MAX_EXACT_INT else x
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [_read_value(f"{where}[{i}]", v) for i, v in enumerate(value.list_value.values)]
    if kind == "struct_value":
        return {k: _read_value(f"{where}[{k!r}]", v)
                for k, v in value.struct_value.fields.items()}
    raise KvParamsError(f"{where}: a google.protobuf.Value with no kind set")


def from_dict(params: dict[str, Any] | None) -> worker_pb2.KvTransferParams:
    """A dict from the engine → protobuf; raises :class:`KvParamsError` (see the module
    docstring)."""
    out = worker_pb2.KvTransferParams()
    for key, value in (params or {}).items():
        if not isinstance(key, str):
            raise KvParamsError(f"kv_transfer_params: key {key!r} is not a string")
        if value is None:
            continue
        if key in _FLAGS:
            if not isinstance(value, bool):
                raise KvParamsError(f"{_where(key)}: expected bool, got "
                                    f"{type(value).__name__} {value!r}")
            setattr(out, key, value)
        elif key in _SCALARS:
            _set_scalar(out, key, value)
        elif key == _BLOCKS:
            if isinstance(value, list | tuple) and not value:
                continue
            _set_blocks(out, value)
        else:
            _fill_value(_where(key), value, out.extra[key])
    return out


def to_dict(msg: worker_pb2.KvTransferParams) -> dict[str, Any]:
    """Protobuf → the dict the engine's connector expects: the two flags always, every
    other field only when present; raises :class:`KvParamsError` on a malformed message."""
    out: dict[str, Any] = {k: getattr(msg, k) for k in _FLAGS}
    for key, (name, _) in _SCALARS.items():
        if msg.HasField(name):
            out[key] = getattr(msg, name)
    if msg.remote_block_ids and msg.remote_block_id_groups:
        raise KvParamsError(f"{_where(_BLOCKS)}: both remote_block_ids and "
                            "remote_block_id_groups are set")
    if msg.remote_block_ids:
        out[_BLOCKS] = list(msg.remote_block_ids)
    elif msg.remote_block_id_groups:
        out[_BLOCKS] = [list(g.block_ids) for g in msg.remote_block_id_groups]
    for key, value in msg.extra.items():
        if key in _TYPED:
            raise KvParamsError(f"{_where(key)}: sent in extra, but it has a typed field")
        out[key] = _read_value(_where(key), value)
    return out


# Keys a remote-prefill (D) request must carry, by the engine's handoff mode.
REMOTE_PREFILL_KEYS: dict[str, tuple[str, ...]] = {
    "pull": ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
             _BLOCKS),
    "push": ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
             "tp_size"),
}
# Inclusive lower (and upper) bounds of typed integer keys, where present.
_INT_RANGES: dict[str, tuple[int, int | None]] = {
    "remote_port": (1, 65535),
    "tp_size": (1, None),
    "dcp_size": (1, None),
    "pp_size": (1, None),
    "remote_block_size": (1, None),
    "remote_num_tokens": (0, None),
    "remote_prefill_cached_tokens": (0, None),
}
TRANSFER_MODES = ("pull", "push")


def _block_ids(value: Any) -> list[int]:
    """Every id in a flat or per-group ``remote_block_ids``."""
    if value and isinstance(value[0], list | tuple):
        return [b for group in value for b in group]
    return list(value or ())


def validate_request(params: dict[str, Any], mode: str) -> None:
    """Refuses a request's params an engine of handoff ``mode`` must not see; see the
    module docstring. Raises :class:`KvParamsError` naming the key."""
    if params.get("do_remote_prefill") and params.get("do_remote_decode"):
        raise KvParamsError(f"{_where('do_remote_prefill')} and "
                            f"{_where('do_remote_decode')} are both set; a request is "
                            "either the decode or the prefill side of a handoff")
    for key, (low, high) in _INT_RANGES.items():
        value = params.get(key)
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            raise KvParamsError(f"{_where(key)}: must be {bound}, got {value}")
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and not math.isfinite(expiry):
        raise KvParamsError(f"{_where('remote_blocks_expiry_time')}: must be finite, "
                            f"got {expiry}")
    negative = [b for b in _block_ids(params.get(_BLOCKS)) if b < 0]
    if negative:
        raise KvParamsError(f"{_where(_BLOCKS)}: block ids must be >= 0, got {negative[0]}")
    transfer = params.get("transfer_mode")
    if transfer is not None and transfer not in TRANSFER_MODES:
        raise KvParamsError(f"{_where('transfer_mode')}: must be one of {TRANSFER_MODES}, "
                            f"got {transfer!r}")
    if not params.get("do_remote_prefill"):
        return
    for key in REMOTE_PREFILL_KEYS.get(mode, ()):
        value = params.get(key)
        if value is None or value == "" or (key == _BLOCKS and not _block_ids(value)):
            raise KvParamsError(f"{_where(key)}: required (non-empty) with "
                                f"do_remote_prefill on a {mode}-mode engine")


def is_set(msg: worker_pb2.KvTransferParams) -> bool:
    """True when the message carries any parameter."""
    return msg.ByteSize() > 0


def held_blocks(msg: worker_pb2.KvTransferParams) -> int:
    """How many KV blocks the params name on the remote side (flat, or summed over the
    KV-cache groups)."""
    if msg.remote_block_ids:
        return len(msg.remote_block_ids)
    return sum(len(g.block_ids) for g in msg.remote_block_id_groups)

