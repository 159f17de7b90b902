"""E's answer as protobuf (``encoder.proto``'s ``EmbeddingDescriptor``) and back.

vLLM wants ``ec_transfer_params`` as a dict (``{mm_hash: {"kvmesh": descriptor params,
"metadata": {...}}}``, see :mod:`workers.ec.connector`); between processes it travels as
protobuf. Both conversions live here, at the edge, for E (the encoder service) and the
consumer (the worker):

- ``to_pb(mm_hash, entry, *, cache_hit=False, content_hash="")``: one entry of E's
  ``RequestOutput.ec_transfer_params`` as an ``EmbeddingDescriptor``; ValueError (from
  :meth:`~workers.ec.core.Descriptor.from_params`, naming the field) for a bad one.
  ``num_tokens`` is the embedding's rows.
- ``descriptor(pb)``: the :class:`~workers.ec.core.Descriptor` it names.
- ``ec_transfer_params(pbs)``: the dict a consumer engine gets as
  ``SamplingParams.extra_args["ec_transfer_params"]``; ValueError for a bad descriptor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from protos import encoder_pb2
from workers.ec.core import PARAMS_KEY, Descriptor


def to_pb(mm_hash: str, entry: Mapping[str, Any], *, cache_hit: bool = False,
          content_hash: str = "") -> encoder_pb2.EmbeddingDescriptor:
    """``entry`` = E's ``ec_transfer_params[mm_hash]`` (see the module docstring)."""
    d = Descriptor.from_params(entry.get(PARAMS_KEY))
    pb = encoder_pb2.EmbeddingDescriptor(
        mm_hash=mm_hash, agent=d.agent, agent_metadata=d.agent_metadata, addr=d.addr,
        nbytes=d.nbytes, dtype=d.dtype, shape=list(d.shape), handle=d.handle,
        region=d.region, offset=d.offset, num_tokens=int(d.shape[0]) if d.shape else 0,
        cache_hit=cache_hit, content_hash=content_hash)
    for key, values in (entry.get("metadata") or {}).items():
        pb.placeholder_metadata[key].values.extend(float(v) for v in values)
    return pb


def descriptor(pb: encoder_pb2.EmbeddingDescriptor) -> Descriptor:
    """The connector's descriptor of ``pb``."""
    return Descriptor(pb.agent, pb.agent_metadata, pb.addr, pb.nbytes, pb.dtype,
                      tuple(pb.shape), pb.handle, pb.region, pb.offset)


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def ec_transfer_params(pbs: Iterable[encoder_pb2.EmbeddingDescriptor]) -> dict[str, Any]:
    """The consumer's ``ec_transfer_params`` for these embeddings (validated)."""
    out: dict[str, Any] = {}
    for pb in pbs:
        params = descriptor(pb).to_params()
        Descriptor.from_params(params)  # ValueError names a bad field
        meta = {k: [_number(v) for v in lst.values]
                for k, lst in pb.placeholder_metadata.items()}
        out[pb.mm_hash] = {PARAMS_KEY: params, "metadata": meta}
    return out
