"""Engine KV events → kvmesh KV events (pure; no sockets, no asyncio).

vLLM publishes ``BlockStored`` (engine block hashes, parent hash, token ids, medium),
``BlockRemoved`` (engine hashes, medium) and ``AllBlocksCleared``. kvmesh indexes its own
chained block hashes (:mod:`services.common.block_hash`) so that every engine and the
router agree; the translator keeps the mapping engine hash → kvmesh hash that this needs
(a removal carries only engine hashes) and the worker's resulting state.

Contract of :class:`EventTranslator`:

- ``translate(raw)`` takes one decoded engine event (a dict with ``"type"``, as vLLM's
  msgpack maps decode) and returns the kvmesh events it implies, as
  :class:`TranslatedEvent` (kind ``stored`` / ``removed`` / ``cleared``, kvmesh hashes,
  tier), possibly none:
  - stored: the chain continues from the parent's kvmesh hash (the first block of a
    prompt has no parent; it starts from the request's cache salt, :func:`event_salt`,
    so a salted prompt gets exactly the hashes the router computes with that salt).
    Blocks whose parent is unknown (events missed before the relay saw the engine) are
    counted in ``orphans`` and skipped. A kvmesh hash that is already held in that tier
    (two engine blocks with equal tokens, e.g. different LoRA) is reference-counted and
    emitted once.
  - removed: only blocks this translator saw stored; the kvmesh hash is emitted when its
    last engine block in that tier goes.
  - cleared: everything is forgotten.
  Unknown event types raise :class:`UnknownEvent`.
- ``state()`` is the worker's current state, tier → kvmesh hashes; after applying the
  emitted events to an empty index, the index holds exactly this.
- ``reset()`` forgets everything (used after the engine's prefix cache was reset).
- :func:`event_salt`: the cache salt of a BlockStored event without a parent, read
  from vLLM's ``extra_keys`` of its first block. vLLM publishes them untagged, in the
  order LoRA name (when ``lora_name``/``lora_id`` is set), ``(mm_identifier, offset)``
  pairs (lists after msgpack), the cache salt (a string, first block only) and prompt
  embedding digests (bytes); so the salt is the first string after the LoRA name. ""
  when there is none (then the hashes are the unsalted ones, as before). A child event
  needs no salt: its parent's kvmesh hash carries it.
- :func:`event_mm_keys`: per block of a BlockStored event, its multimodal keys, the
  ``(mm_identifier, offset)`` pairs of ``extra_keys`` (lists after msgpack; the strings
  and bytes there are LoRA names, salts and prompt-embedding digests). The stored
  blocks are hashed with them (:func:`services.common.block_hash.block_hashes`
  ``mm_keys``), so a block holding an image hashes the image's identity as the router's
  hash of the same prompt does, and two images behind the same text never share a hash.
- Media map to tiers: GPU/None → device, CPU → host, anything with STORAGE/DISK → store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.block_hash import MmKey, block_hashes


class UnknownEvent(ValueError):
    """An engine event type the translator does not know."""


@dataclass(frozen=True)
class TranslatedEvent:
    """One kvmesh event before the relay numbers it."""

    kind: str
    block_hashes: tuple[int, ...] = ()
    tier: str = "device"


def tier_of(medium: str | None) -> str:
    """The kvmesh tier of an engine's storage medium name."""
    if medium is None or medium.upper() in ("GPU", "DEVICE", "CUDA", ""):
        return "device"
    m = medium.upper()
    if m in ("CPU", "HOST", "DRAM"):
        return "host"
    if "STOR" in m or "DISK" in m:
        return "store"
    return "device"


def event_salt(raw: Mapping[str, Any]) -> str:
    """The cache salt of a parentless BlockStored event (see the module docstring)."""
    extra = raw.get("extra_keys")
    if not extra or not extra[0]:
        return ""
    keys = list(extra[0])
    if raw.get("lora_name") is not None or raw.get("lora_id") is not None:
        keys = keys[1:]
    return next((k for k in keys if isinstance(k, str)), "")


def _mm_pair(key: Any) -> MmKey | None:
    if (isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str)
            and isinstance(key[1], int) and not isinstance(key[1], bool)):
        return key[0], key[1]
    return None


def event_mm_keys(raw: Mapping[str, Any]) -> list[tuple[MmKey, ...]]:
    """Per block of a BlockStored event, its (identifier, offset) keys (module doc)."""
    out: list[tuple[MmKey, ...]] = []
    for keys in raw.get("extra_keys") or ():
        pairs = (_mm_pair(k) for k in (keys or ()))
        out.append(tuple(p for p in pairs if p is not None))
    return out


def _key(h: Any) -> Any:
    """Engine hashes are ints or bytes; lists (from msgpack) become tuples."""
    return tuple(h) if isinstance(h, list) else h


class EventTranslator:
    """See the module docstring."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        # (engine hash, tier) -> kvmesh hash; engine hash -> kvmesh hash (any tier), for parents
        self._ours: dict[tuple[Any, str], int] = {}
        self._chain: dict[Any, int] = {}
        self._refs: dict[tuple[int, str], int] = {}
        self.orphans = 0

    def translate(self, raw: Mapping[str, Any]) -> list[TranslatedEvent]:
        """The kvmesh events one engine event implies (see the module docstring)."""
        kind = raw.get("type")
        if kind == "BlockStored":
            return self._stored(raw)
        if kind == "BlockRemoved":
            return self._removed(raw)
        if kind == "AllBlocksCleared":
            self.reset()
            return [TranslatedEvent("cleared")]
        raise UnknownEvent(f"unknown KV event type {kind!r}")

    def _stored(self, raw: Mapping[str, Any]) -> list[TranslatedEvent]:
        engine_hashes: Sequence[Any] = raw.get("block_hashes") or ()
        tokens: Sequence[int] = raw.get("token_ids") or ()
        bs = int(raw.get("block_size") or self.block_size)
        tier = tier_of(raw.get("medium"))
        parent_raw = raw.get("parent_block_hash")
        parent: int | None = None
        if parent_raw is not None:
            found = self._chain.get(_key(parent_raw))
            if found is None:
                self.orphans += len(engine_hashes)
                return []
            parent = found
        salt = event_salt(raw) if parent is None else ""
        ours = block_hashes(tokens, bs, parent=parent, salt=salt,
                            mm_keys=event_mm_keys(raw))[:len(engine_hashes)]
        new: list[int] = []
        for eh, h in zip(engine_hashes, ours, strict=False):
            k = _key(eh)
            if (k, tier) in self._ours:
                continue  # the engine re-announced a block it already holds
            self._ours[(k, tier)] = h
            self._chain[k] = h
            n = self._refs.get((h, tier), 0)
            self._refs[(h, tier)] = n + 1
            if n == 0:
                new.append(h)
        return [TranslatedEvent("stored", tuple(new), tier)] if new else []

    def _removed(self, raw: Mapping[str, Any]) -> list[TranslatedEvent]:
        tier = tier_of(raw.get("medium"))
        gone: list[int] = []
        for eh in raw.get("block_hashes") or ():
            k = _key(eh)
            h = self._ours.pop((k, tier), None)
            if h is None:
                continue
            if not any((k, t) in self._ours for t in ("device", "host", "store")):
                self._chain.pop(k, None)
            n = self._refs[(h, tier)] - 1
            if n:
                self._refs[(h, tier)] = n
            else:
                del self._refs[(h, tier)]
                gone.append(h)
        return [TranslatedEvent("removed", tuple(gone), tier)] if gone else []

    def state(self) -> dict[str, set[int]]:
        """tier → kvmesh hashes currently held."""
        out: dict[str, set[int]] = {}
        for h, tier in self._refs:
            out.setdefault(tier, set()).add(h)
        return out

    def reset(self) -> None:
        """Forgets every block."""
        self._ours.clear()
        self._chain.clear()
        self._refs.clear()
