"""SGLang's CacheAwarePolicy: an approximate per-worker prefix tree from request history.

No engine events: the router remembers which prompts it sent where. Prompts are cut into
pages of ``page_size`` tokens and each page is identified by its chained hash (so a page
hash names a whole prefix and the tree collapses to a set of page hashes per worker).
The chain starts from the request's ``cache_salt`` (its tenant's), so tenants never match
each other's pages.

Contract of :class:`ApproxPolicy` (``name = "approx"``):

- ``select(ctx, candidates)``: with loads ``q`` = queued + running (see ``queue_of``):
  1. imbalanced when ``max(q) − min(q) > balance_abs_threshold`` and
     ``max(q) > min(q) · balance_rel_threshold`` → the shortest queue;
  2. else the best match (most leading pages in its tree; ties → smaller tree → id) when
     its match rate ``matched tokens / prompt tokens`` > ``cache_threshold``;
  3. else the smallest tree (ties → shorter queue → id).
  The prompt's pages are then inserted into the chosen worker's tree (touching them).
- ``evict(now)`` (call it periodically, e.g. every 60 s, with the caller's clock): drops
  pages not touched for ``max_age_s`` (when set), then trims each tree to
  ``max_pages_per_worker`` least-recently-used first; within one prompt deeper pages go
  first, so a surviving page's prefix survives too. Inserts also trim a tree that grew
  past twice the cap. Returns the number of pages evicted.
- ``keep_only(worker_ids)`` drops the trees of vanished workers.
- ``match(worker, token_ids, salt)`` / ``tree_size(worker)`` expose the tree for tests and traces.
The clock used to stamp page accesses is injected (``clock``, keyword-only and required:
the live router passes its monotonic clock, the offline replay its virtual one, tests a
fake one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.common.block_hash import MmSpan, block_hashes, mm_block_keys
from services.router.policies.base import Clock, Decision, RouteContext, WorkerState, queue_of


class ApproxPolicy:
    """See the module docstring."""

    name = "approx"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, page_size: int = 16,
                 max_pages_per_worker: int = 65536, max_age_s: float | None = None, *,
                 clock: Clock) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if page_size < 1 or max_pages_per_worker < 1:
            raise ValueError("page_size and max_pages_per_worker must be >= 1")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.page_size = page_size
        self.max_pages = max_pages_per_worker
        self.max_age_s = max_age_s
        self._clock = clock
        # worker → page hash → last access time; order = eviction order (oldest first).
        self._trees: dict[str, OrderedDict[int, float]] = {}

    def _pages(self, token_ids: Sequence[int], salt: str,
               mm: Sequence[MmSpan] = ()) -> list[int]:
        keys = mm_block_keys(mm, len(token_ids), self.page_size) if mm else None
        return block_hashes(token_ids, self.page_size, salt=salt, mm_keys=keys)

    def _match_pages(self, worker: str, pages: Sequence[int]) -> int:
        tree = self._trees.get(worker)
        if not tree:
            return 0
        n = 0
        for p in pages:
            if p not in tree:
                break
            n += 1
        return n

    def match(self, worker: str, token_ids: Sequence[int], salt: str = "") -> int:
        """Leading tokens of ``token_ids`` (a tenant's with its ``salt``) in ``worker``'s
        tree (whole pages)."""
        return self._match_pages(worker, self._pages(token_ids, salt)) * self.page_size

    def tree_size(self, worker: str) -> int:
        """Pages in ``worker``'s tree."""
        return len(self._trees.get(worker, ()))

    def _insert(self, worker: str, pages: Sequence[int]) -> None:
        tree = self._trees.setdefault(worker, OrderedDict())
        now = self._clock()
        for p in reversed(pages):  # the root ends up most recent: leaves are evicted first
            tree[p] = now
            tree.move_to_end(p)
        if len(tree) > 2 * self.max_pages:
            self._trim(tree, self.max_pages)

    @staticmethod
    def _trim(tree: OrderedDict[int, float], cap: int) -> int:
        n = 0
        while len(tree) > cap:
            tree.popitem(last=False)
            n += 1
        return n

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """See the module docstring."""
        loads = {w.instance_id: queue_of(w) for w in candidates}
        lo, hi = min(loads.values()), max(loads.values())
        pages = self._pages(ctx.token_ids, ctx.cache_salt, ctx.mm_spans)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            w = min(candidates, key=lambda c: (loads[c.instance_id], c.instance_id))
            reason = (f"approx: imbalanced (queues {lo}..{hi}), "
                      f"shortest queue {loads[w.instance_id]}")
        else:
            matched = {c.instance_id: self._match_pages(c.instance_id, pages)
                       for c in candidates}
            best = min(candidates, key=lambda c: (-matched[c.instance_id],
                                                  self.tree_size(c.instance_id),
                                                  c.instance_id))
            tokens = len(ctx.token_ids)
            rate = matched[best.instance_id] * self.page_size / tokens if tokens else 0.0
            if rate > self.cache_threshold:
                w = best
                reason = f"approx: cache hit, match rate {rate:.2f} > {self.cache_threshold}"
            else:
                w = min(candidates, key=lambda c: (self.tree_size(c.instance_id),
                                                   loads[c.instance_id], c.instance_id))
                reason = (f"approx: best match rate {rate:.2f} <= {self.cache_threshold}, "
                          f"smallest tree ({self.tree_size(w.instance_id)} pages)")
        self._insert(w.instance_id, pages)
        return Decision(w.instance_id, reason)

    def evict(self, now: float | None = None) -> int:
        """Drops expired pages and trims trees to the cap; returns pages evicted."""
        now = self._clock() if now is None else now
        n = 0
        for tree in self._trees.values():
            if self.max_age_s is not None:
                while tree and next(iter(tree.values())) < now - self.max_age_s:
                    tree.popitem(last=False)
                    n += 1
            n += self._trim(tree, self.max_pages)
        return n

    def keep_only(self, worker_ids: Iterable[str]) -> None:
        """Forgets the trees of workers not in ``worker_ids``."""
        alive = set(worker_ids)
        for w in [w for w in self._trees if w not in alive]:
            del self._trees[w]
