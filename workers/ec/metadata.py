"""What crosses vLLM's scheduler -> worker boundary for the kvmesh EC connector.

:class:`EcMeta` (one per step, vLLM's ``ECConnectorMetadata``): the region file both
halves map, and

- ``saves`` (producer): embeddings the worker must copy from vLLM's encoder cache into
  their slot (when it encodes them, or at once when the encoder cache already holds
  them), header last;
- ``drops`` (producer): ``mm_hash``es whose slots were freed: forget pending saves;
- ``loads`` (consumer): embeddings already READ into the staging region, for the worker
  to copy into vLLM's encoder cache before the step gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata


@dataclass(frozen=True)
class SlotItem:
    """One embedding in a region: header at ``offset``, payload right after it."""

    mm_hash: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class EcMeta(ECConnectorMetadata):
    """One step's work for the worker half (see the module docstring)."""

    region: str = ""
    region_bytes: int = 0
    saves: list[SlotItem] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    loads: list[SlotItem] = field(default_factory=list)
