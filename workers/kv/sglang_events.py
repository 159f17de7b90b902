"""SGLang KV events → the vLLM-shaped dicts :mod:`workers.kv.event_translate` takes (pure).

SGLang 0.5.23 (``srt/disaggregation/kv_events.py``, ``srt/mem_cache/events.py``) publishes
on ZMQ with vLLM's wire and replay protocol: frames ``[topic, seq, msgpack]``, the batch a
positional array ``[ts, [events], attn_dp_rank]``, each event a tagged map (``"type"``
is the class name) whose ``None`` optional fields are omitted. What differs from vLLM:

- ``BlockStored`` has no ``extra_keys`` and no ``group_idx``; the request's cache salt is
  its own field ``cache_salt`` (vLLM: the first string of the first block's
  ``extra_keys``), plus ``session_id`` (attribution only) and ``lora_name``.
- hashes are per page (``page_size`` tokens), signed 64-bit ints; consecutive pages of one
  radix node are coalesced into one event whose ``block_size`` is the page size (a short
  last page would get its own event with a smaller ``block_size``).
- media are ``GPU``, ``CPU_PINNED``, ``DISK`` and ``EXTERNAL``.

Contract of :class:`SglangEventConverter` (``convert(raw) -> dict | None``):

- ``BlockStored``: the same hashes, parent, token ids and block size; ``medium`` mapped to
  the names :func:`workers.kv.event_translate.tier_of` reads (``CPU_PINNED`` → ``CPU``,
  ``EXTERNAL`` → ``STORAGE``); a ``cache_salt`` becomes vLLM's ``extra_keys`` (the salt as
  the first block's only key, so :func:`~workers.kv.event_translate.event_salt` finds it;
  the translator reads the salt of parentless events only: a child's parent hash already
  carries it). Dropped (``None``, counted in ``skipped``, by reason): an event whose
  ``block_size`` is not ``page_size`` (kvmesh indexes full blocks of the worker's block
  size only; its children then become the translator's orphans), one with LoRA fields
  (kvmesh hashes do not include the adapter, so its blocks would collide with the base
  model's), and one with bigram (EAGLE) token pairs.
- ``BlockRemoved``: hashes and mapped medium. ``AllBlocksCleared``: unchanged.
- Anything else is returned unchanged (the translator raises UnknownEvent for an unknown
  type, which the relay counts as a bad payload).

So after conversion the relay computes kvmesh's own chained hashes from the token ids
(:func:`services.common.block_hash.block_hashes`), exactly as for vLLM: the router cannot
tell which engine a worker runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

# SGLang's StorageMedium values -> names tier_of() maps to device / host / store.
MEDIA = {"GPU": "GPU", "CPU_PINNED": "CPU", "CPU": "CPU", "DISK": "DISK",
         "EXTERNAL": "STORAGE"}


def medium_of(medium: Any) -> str | None:
    """The vLLM-style medium name of an SGLang one (None stays None: device)."""
    if medium is None:
        return None
    name = str(medium)
    return MEDIA.get(name.upper(), name)


class SglangEventConverter:
    """See the module docstring."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self.skipped: Counter[str] = Counter()

    def __call__(self, raw: Any) -> Any:
        return self.convert(raw)

    def convert(self, raw: Any) -> Any:
        """The translator's form of one SGLang event, or None to drop it."""
        if not isinstance(raw, Mapping):
            return raw
        kind = raw.get("type")
        if kind == "BlockStored":
            return self._stored(raw)
        if kind == "BlockRemoved":
            out: dict[str, Any] = {"type": "BlockRemoved",
                                   "block_hashes": list(raw.get("block_hashes") or ())}
            out["medium"] = medium_of(raw.get("medium"))
            return out
        return raw

    def _stored(self, raw: Mapping[str, Any]) -> dict[str, Any] | None:
        hashes = list(raw.get("block_hashes") or ())
        tokens = list(raw.get("token_ids") or ())
        size = int(raw.get("block_size") or 0)
        if size != self.page_size:
            self.skipped["block_size"] += 1
            return None
        if raw.get("lora_name") is not None or raw.get("lora_id") is not None:
            self.skipped["lora"] += 1
            return None
        if any(not isinstance(t, int) or isinstance(t, bool) for t in tokens):
            self.skipped["tokens"] += 1
            return None
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": hashes,
            "parent_block_hash": raw.get("parent_block_hash"), "token_ids": tokens,
            "block_size": size, "medium": medium_of(raw.get("medium")),
        }
        salt = raw.get("cache_salt")
        if salt:
            out["extra_keys"] = [[str(salt)]] + [None] * (len(hashes) - 1)
        return out
