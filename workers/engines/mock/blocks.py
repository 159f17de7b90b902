"""The mock engine's KV block manager: vLLM-like paged blocks with prefix caching (pure).

No asyncio, no I/O. Blocks are numbered ``0 .. num_blocks - 1``; each has a reference
count and, once it is a *full, cached* block, the chained hash of the prefix it ends
(:func:`services.common.block_hash.block_hashes`; the engine's hashes *are* kvmesh's, so
a relay's translation is the identity on hashes).

Contract of :class:`BlockManager` (vLLM v1 ``KVCacheManager`` semantics):

- ``lookup(hashes)``: how many leading ``hashes`` are cached (no state change).
- ``allocate(req, num_tokens, hits=())``: makes ``req`` hold enough blocks for
  ``num_tokens`` tokens. On the first call, ``hits`` (leading cached hashes from
  ``lookup``) become the request's first blocks (ref count + 1; a cached block with ref 0
  leaves the free queue). New blocks come from the head of the free queue; popping a
  cached block evicts it: its hash is dropped and a ``BlockRemoved`` event is queued.
  All or nothing: returns False, changing nothing, when the free queue is too short.
- ``hash_blocks(token_ids, parent=None, salt="")``: kvmesh's chained hashes, the first
  block salted with the request's cache salt (tenant isolation: a salted prefix never
  hits another salt's blocks).
- ``commit(req, token_ids, num_computed, salt="", known=())``: the request's blocks that
  are now full (``num_computed // block_size``) and not yet cached become cached: their
  hashes (``known``, when given, are ``hash_blocks`` of leading full blocks of
  ``token_ids`` with this salt, already computed: they are reused, the rest is hashed) are
  registered and one ``BlockStored`` event per contiguous run is queued, in vLLM's decoded
  form (``block_hashes``, ``parent_block_hash``, ``token_ids`` of those blocks,
  ``block_size``, ``medium``, and, for a run starting at the first block of a salted
  request, vLLM's ``extra_keys``: ``[(salt,), None, ...]``, one entry per block, so the
  relay's translator finds the salt as it does in vLLM's events). When a full block's
  hash is already cached in another block (two requests computed the same prefix at
  once), the request switches to the cached block and its own block goes back to the
  free queue (same content; no event). So every
  full block a live request holds is cached, and a new block's parent is always cached.
- ``free(req)``: drops the request's references; blocks reaching ref 0 go to the tail of
  the free queue in reverse order (a request's last block is evicted first, as in vLLM),
  keeping their hashes (they stay prefix-cache hits until evicted).
- ``reset()``: when no block is in use, forgets every cached hash, queues
  ``AllBlocksCleared`` and returns True; otherwise returns False and changes nothing.
- ``drain_events()``: the queued events, oldest first, and clears the queue.
- ``num_free`` / ``num_used`` / ``usage``: free-queue length (cached blocks with ref 0
  count as free, as in vLLM), ``num_blocks - num_free`` and ``num_used / num_blocks``.
- ``check()``: raises AssertionError when an invariant does not hold (tests): free +
  used == total, ref counts >= 0, a block is in the free queue iff its ref count is 0,
  the hash map and the blocks' hashes agree, each request's full blocks are cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from services.common.block_hash import block_hashes


class BlockManager:
    """See the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, *, medium: str = "GPU",
                 enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        # ref-0 blocks, head = next to allocate (and evict); insertion-ordered
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[int]] = {}  # hashes of the request's cached blocks
        self._events: list[dict[str, Any]] = []
        self.evictions = 0

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def cached_hashes(self) -> set[int]:
        """Hashes of every cached block (held or free)."""
        return set(self._cached)

    def holds(self, req: str) -> bool:
        """True while ``req`` holds blocks (allocated and not freed)."""
        return req in self._req_blocks

    def blocks_of(self, req: str) -> list[int]:
        """Block ids held by ``req`` (a copy; empty when none)."""
        return list(self._req_blocks.get(req, ()))

    def lookup(self, hashes: Sequence[int]) -> int:
        """Leading ``hashes`` that are cached."""
        if not self.enable_caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def hash_blocks(self, token_ids: Sequence[int], parent: int | None = None,
                    salt: str = "") -> list[int]:
        """Chained hashes of the full blocks of ``token_ids`` (continuing ``parent``, else
        from ``salt``'s root)."""
        return block_hashes(token_ids, self.block_size, parent=parent, salt=salt)

    # -- changes -------------------------------------------------------------------------

    def allocate(self, req: str, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Hold blocks for ``num_tokens`` tokens (all or nothing); see the module doc."""
        held = self._req_blocks.get(req)
        if held is not None and num_tokens <= len(held) * self.block_size:
            return True  # within the blocks it holds (most decode steps): nothing to do
        first = held is None
        hit_ids = [self._cached[h] for h in hits] if first and hits else []
        have = (len(held) if held is not None else 0) + len(hit_ids)
        need = max(0, -(-num_tokens // self.block_size) - have)
        # hit blocks that sit in the free queue leave it when touched
        touching = sum(1 for b in hit_ids if self._ref[b] == 0)
        if need > len(self._free) - touching:
            return False
        if first:
            held = []
            self._req_blocks[req] = held
            self._req_hashes[req] = []
            for h, b in zip(hits, hit_ids, strict=True):
                self._touch(b)
                held.append(b)
                self._req_hashes[req].append(h)
        assert held is not None
        removed: list[int] = []
        for _ in range(need):
            b, _none = self._free.popitem(last=False)
            old = self._hash[b]
            if old is not None:
                del self._cached[old]
                self._hash[b] = None
                removed.append(old)
                self.evictions += 1
            self._ref[b] = 1
            held.append(b)
        if removed:
            self._events.append({"type": "BlockRemoved", "block_hashes": removed,
                                 "medium": self.medium})
        return True

    def _touch(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._free[b]
        self._ref[b] += 1

    def commit(self, req: str, token_ids: Sequence[int], num_computed: int,
               salt: str = "", known: Sequence[int] = ()) -> None:
        """Caches the request's newly full blocks; see the module docstring."""
        if not self.enable_caching:
            return
        held = self._req_blocks[req]
        hashes = self._req_hashes[req]
        bs = self.block_size
        full = min(num_computed // bs, len(held))
        start = len(hashes)
        if full <= start:
            return
        new = list(known[start:full])
        if start + len(new) < full:  # hash the blocks past the known ones
            rest = start + len(new)
            parent = new[-1] if new else hashes[-1] if hashes else None
            new += self.hash_blocks(token_ids[rest * bs:full * bs], parent, salt)
        run: list[int] = []
        run_start = start
        for i, h in enumerate(new, start):
            b = held[i]
            other = self._cached.get(h)
            if other is None:
                self._hash[b] = h
                self._cached[h] = b
                if not run:
                    run_start = i
                run.append(h)
            else:  # computed twice at once: share the cached block, give ours back
                self._emit_stored(run, run_start, token_ids, hashes, salt)
                run = []
                self._touch(other)
                held[i] = other
                self._release(b)
            hashes.append(h)
        self._emit_stored(run, run_start, token_ids, hashes, salt)

    def _emit_stored(self, run: list[int], start: int, token_ids: Sequence[int],
                     hashes: list[int], salt: str) -> None:
        if not run:
            return
        bs = self.block_size
        event: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(run),
            "parent_block_hash": hashes[start - 1] if start else None,
            "token_ids": list(token_ids[start * bs:(start + len(run)) * bs]),
            "block_size": bs, "medium": self.medium,
        }
        if salt and not start:
            event["extra_keys"] = [(salt,)] + [None] * (len(run) - 1)
        self._events.append(event)

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free[b] = None  # tail: evicted last

    def free(self, req: str) -> None:
        """Drops ``req``'s references (no-op for an unknown request)."""
        held = self._req_blocks.pop(req, None)
        self._req_hashes.pop(req, None)
        if held is None:
            return
        for b in reversed(held):
            self._release(b)

    def reset(self) -> bool:
        """Forgets every cached hash when no block is in use; see the module docstring."""
        if self.num_used:
            return False
        for h, b in self._cached.items():
            assert self._hash[b] == h
            self._hash[b] = None
        self._cached.clear()
        self._events.append({"type": "AllBlocksCleared"})
        return True

    def drain_events(self) -> list[dict[str, Any]]:
        """Queued events, oldest first; the queue is emptied."""
        out, self._events = self._events, []
        return out

    # -- invariants ----------------------------------------------------------------------

    def check(self) -> None:
        """Raises AssertionError when an invariant is broken (see the module docstring)."""
        refs = [0] * self.num_blocks
        for req, held in self._req_blocks.items():
            for b in held:
                refs[b] += 1
            hashes = self._req_hashes[req]
            assert len(hashes) <= len(held), req
            for i, h in enumerate(hashes):
                assert self._hash[held[i]] == h, (req, i)
        assert refs == self._ref, "ref counts disagree with the requests' block tables"
        assert all(r >= 0 for r in self._ref)
        for b in range(self.num_blocks):
            assert (b in self._free) == (self._ref[b] == 0), b
        assert len(self._free) + sum(1 for r in self._ref if r > 0) == self.num_blocks
        for h, b in self._cached.items():
            assert self._hash[b] == h
        assert sum(1 for h in self._hash if h is not None) == len(self._cached)
