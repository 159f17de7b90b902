"""The store connector's planning, without vLLM: block counts and hashes in, jobs out.

:class:`StorePlanner` is the scheduler half's state machine
(:mod:`workers.kv.store.scheduler` feeds it from vLLM's objects and asks the store);
the functions at the end are the worker half's bookkeeping of job results
(:mod:`workers.kv.store.worker`). Nothing here does I/O.

Contract:

- :class:`StoreSettings` ``.from_extra(extra, kv_cache_groups)``: the connector's
  ``kv_connector_extra_config`` (see :mod:`workers.kv.store_connector`); ValueError
  without ``store_master``; more than one KV cache group turns save and load off.
- ``key_prefix(layout, tp_rank, tp_size)`` → ``kv/<xxh3 of layout, 16 hex>/tp<r>of<n>/``;
  a key is the prefix + the block's chained hash (16 hex).
- ``StorePlanner(block_size, key_prefix, *, save, load, async_load, prefetch, publish)``:
  per live request (``track``) the prompt's keys and chained block hashes, computed once.

  - ``track(req_id, prompt_token_ids, eligible)``: registers a request at first sight
    (idempotent). An ineligible request (LoRA, multimodal, prompt embeddings, no
    prompt) gets no keys: it is neither saved nor loaded.
  - ``lookup(req_id, num_computed_tokens)`` → the keys to ask the store for: those of the
    full prompt blocks after the local hit, never the block holding the prompt's last
    token (vLLM must compute at least one). Empty (ask nothing, report ``(0, False)``)
    when loads are off, the request is ineligible, a load of it failed before, or
    nothing is left to ask.
  - ``matched(req_id, num_computed_tokens, hits)`` → ``(hits × block_size, async)``
    (``async`` = ``async_load`` and ``hits > 0``) for ``hits`` leading keys of the
    lookup found in the store. Remembers the local hit it saw (vLLM sets
    ``num_computed_tokens`` only after the allocation) and, with ``prefetch``, the hit
    keys for a prefetch.
  - ``allocated(req_id, num_external_tokens)``: with ``num_external_tokens > 0``, plans a
    load of the blocks from that remembered local hit on. Ignored while an asynchronous
    load of the request is in flight (the call vLLM makes after it).
  - ``plan(computed, scheduled, block_ids)`` → :class:`StepPlan` of one scheduler step.
    ``computed``: ``req_id → num_computed_tokens`` of the scheduled requests (new ones
    first), ``scheduled``: ``req_id → tokens scheduled``, ``block_ids(req_id)``: the
    request's block ids (one KV cache group), or None when no KV cache manager is bound
    (then nothing is loaded or saved). Loads: the planned ones (keys ↔ block ids). Saves:
    per scheduled request, the prompt blocks that become full in this step and were
    neither loaded nor hit locally at its first step; each block once per request.
    Prefetch: the hit keys of requests that were looked up but not scheduled, once per
    request.
  - ``reported(finished_recving, done)`` → :class:`StoredPrefix` list, one per job the
    worker reported with ``n > 0`` blocks now in the store (``done``: ``(req_id, first,
    n)``): the request's whole prefix up to block ``first + n`` (empty with ``publish``
    off). A load job that reports fewer blocks than planned marks its request: it is
    never offered the store again. ``finished_recving`` ends in-flight async loads.
  - ``finished(req_id)``: forgets the request. Unreported jobs are kept (at most 10 000
    of each kind, the oldest dropped first) since a report may still come.
- Worker bookkeeping: ``leading(results, good)`` (how many leading results are good),
  ``job_counts(jobs, results, good)`` (``(req_id, first, n)`` per job over the
  concatenated ``results``), ``failed_blocks(jobs, results)`` (block ids whose load
  result is not "ok").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

import xxhash

from services.common.block_hash import block_hashes

MAX_UNREPORTED = 10_000  # jobs kept waiting for a report (reports lost on a worker error)


@dataclass(frozen=True)
class StoreSettings:
    """The connector's ``kv_connector_extra_config``, parsed."""

    store_master: str
    replicas: int = 1
    save: bool = True
    load: bool = True
    async_load: bool = False
    publish_events: bool = True
    l1_bytes: int = 0
    segment_bytes: int = 0
    rpc_timeout_s: float = 5.0
    transfer_timeout_s: float = 10.0
    # mTLS to the master (services.common.tls.tls_for reads these): "" = plaintext
    tls_dir: str = ""
    tls_cert: str = "worker"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], kv_cache_groups: int = 1
                   ) -> StoreSettings:
        """Raises ValueError without ``store_master``; >1 KV cache group: save/load off."""
        master = extra.get("store_master")
        if not master:
            raise ValueError("kv_connector_extra_config.store_master is required")
        single = kv_cache_groups <= 1  # block ids of one group only: no hybrid models
        return cls(
            store_master=str(master),
            replicas=int(extra.get("replicas", 1)),
            save=bool(extra.get("save", True)) and single,
            load=bool(extra.get("load", True)) and single,
            async_load=bool(extra.get("async_load", False)),
            publish_events=bool(extra.get("publish_events", True)),
            l1_bytes=int(extra.get("l1_mib", 0)) << 20,
            segment_bytes=int(extra.get("segment_mib", 0)) << 20,
            rpc_timeout_s=float(extra.get("rpc_timeout_s", 5.0)),
            transfer_timeout_s=float(extra.get("transfer_timeout_s", 10.0)),
            tls_dir=str(extra.get("tls_dir", "")),
            tls_cert=str(extra.get("tls_cert", "worker")),
        )


def key_prefix(layout: str, tp_rank: int, tp_size: int) -> str:
    """``kv/<layout hash>/tp<rank>of<size>/`` (see the module docstring)."""
    return f"kv/{xxhash.xxh3_64_hexdigest(layout.encode())}/tp{tp_rank}of{tp_size}/"


@dataclass
class BlockJob:
    """Blocks of one request to load or save: ``keys[i]`` ↔ ``block_ids[i]``."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    first: int = 0  # the request's block index of keys[0]


@dataclass
class StepPlan:
    """What the worker side does in one step."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    prefetch: list[str] = field(default_factory=list)  # store → L1 (queued requests)


@dataclass(frozen=True)
class StoredPrefix:
    """A prompt prefix now available from the store: its chained block hashes and tokens,
    and the tenant's cache salt its hashes start from ("" = unsalted)."""

    block_hashes: list[int]
    token_ids: list[int]
    salt: str = ""


@dataclass
class _ReqState:
    """Bookkeeping of one live request."""

    req_id: str
    tokens: Sequence[int]  # the prompt's token ids
    keys: list[str]
    hashes: list[int]  # keys[i] ends with hashes[i] (chained block hashes of the prompt)
    salt: str = ""  # the tenant's cache salt the hashes start from
    eligible: bool = True
    saved_upto: int = -1  # prompt blocks [0, saved_upto) are in the store or need no save
    load_from: int = 0  # planned load: blocks [load_from, load_to)
    load_to: int = 0
    hit_keys: list[str] = field(default_factory=list)  # last lookup's store hits
    lookup_local: int = 0  # blocks the engine had locally at the last lookup
    loading: bool = False  # an asynchronous load is in flight
    load_failed: bool = False  # a load of this request failed: do not offer the store again
    prefetched: bool = False


def _trim(jobs: dict[Any, Any]) -> None:
    if len(jobs) > MAX_UNREPORTED:  # reports lost (worker error): forget the oldest
        jobs.pop(next(iter(jobs)))


class StorePlanner:
    """See the module docstring."""

    def __init__(self, block_size: int, key_prefix: str, *, save: bool = True,
                 load: bool = True, async_load: bool = False, prefetch: bool = False,
                 publish: bool = True) -> None:
        self.block_size = block_size
        self.key_prefix = key_prefix
        self.save, self.load, self.async_load = save, load, async_load
        self.prefetch, self.publish = prefetch, publish
        self.requests: dict[str, _ReqState] = {}
        self._pending_loads: dict[str, None] = {}  # ordered set
        self._prefetch_wanted: set[str] = set()
        self._load_jobs: dict[tuple[str, int], int] = {}  # (req_id, first) → blocks
        # (req_id, first) → (prompt token ids, prompt block hashes), until reported
        self._jobs: dict[tuple[str, int], tuple[Sequence[int], list[int], str]] = {}

    @classmethod
    def from_settings(cls, settings: StoreSettings, block_size: int,
                      prefix: str) -> StorePlanner:
        return cls(block_size, prefix, save=settings.save, load=settings.load,
                   async_load=settings.async_load, prefetch=settings.l1_bytes > 0,
                   publish=settings.publish_events)

    # -- keys ---------------------------------------------------------------------------

    def keys_of(self, token_ids: Sequence[int], salt: str = "") -> list[str]:
        """The store keys of every full block of ``token_ids`` (a tenant's with its cache
        ``salt``: salted hashes, so tenants never share a store object)."""
        return self._keys(block_hashes(token_ids, self.block_size, salt=salt))

    def _keys(self, hashes: Sequence[int]) -> list[str]:
        return [f"{self.key_prefix}{h:016x}" for h in hashes]

    # -- lookups and loads --------------------------------------------------------------

    def track(self, req_id: str, prompt_token_ids: Sequence[int], eligible: bool,
              salt: str = "") -> None:
        if req_id in self.requests:
            return
        ok = eligible and bool(prompt_token_ids)
        hashes = block_hashes(prompt_token_ids, self.block_size, salt=salt) if ok else []
        self.requests[req_id] = _ReqState(req_id, prompt_token_ids, self._keys(hashes),
                                          hashes, eligible=ok, salt=salt)

    def lookup(self, req_id: str, num_computed_tokens: int) -> list[str]:
        st = self.requests[req_id]
        if not (self.load and st.eligible) or st.load_failed:
            return []
        local = num_computed_tokens // self.block_size
        limit = min(len(st.keys), (len(st.tokens) - 1) // self.block_size)
        return st.keys[local:limit] if local < limit else []

    def matched(self, req_id: str, num_computed_tokens: int, hits: int) -> tuple[int, bool]:
        st = self.requests[req_id]
        local = num_computed_tokens // self.block_size
        st.lookup_local = local
        if self.prefetch and hits and not st.prefetched:
            st.hit_keys = st.keys[local:local + hits]
            self._prefetch_wanted.add(req_id)
        return hits * self.block_size, self.async_load and hits > 0

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        st = self.requests[req_id]
        if num_external_tokens <= 0 or st.loading:  # (async: the call after the load)
            return
        st.loading = self.async_load
        start = st.lookup_local  # the local hit the matching lookup saw
        st.load_from, st.load_to = start, start + num_external_tokens // self.block_size
        self._pending_loads[req_id] = None

    # -- one step -----------------------------------------------------------------------

    def plan(self, computed: Mapping[str, int], scheduled: Mapping[str, int],
             block_ids: Callable[[str], Sequence[int]] | None) -> StepPlan:
        out = StepPlan()
        for req_id in self._pending_loads:
            st = self.requests.get(req_id)
            if st is None or block_ids is None:
                continue
            ids = block_ids(req_id)
            rng = range(st.load_from, st.load_to)
            out.loads.append(BlockJob(req_id, [st.keys[i] for i in rng],
                                      [ids[i] for i in rng], st.load_from))
            self._track(st, st.load_from)
            self._load_jobs[(req_id, st.load_from)] = len(rng)
            st.saved_upto = max(st.saved_upto, st.load_to)
        for req_id in self._prefetch_wanted:  # lookup hit, not scheduled (yet): prefetch
            st = self.requests.get(req_id)
            if st is not None and req_id not in self._pending_loads and not st.prefetched:
                out.prefetch.extend(st.hit_keys)
                st.prefetched = True
        self._prefetch_wanted.clear()
        self._pending_loads.clear()
        if self.save and block_ids is not None:
            for req_id, done in computed.items():
                st = self.requests.get(req_id)
                if st is None or not st.eligible:
                    continue
                if st.saved_upto < 0:  # first step: blocks hit locally need no save
                    st.saved_upto = done // self.block_size
                upto = min((done + scheduled.get(req_id, 0)) // self.block_size,
                           len(st.keys))
                if upto > st.saved_upto:
                    ids = block_ids(req_id)
                    rng = range(st.saved_upto, upto)
                    out.saves.append(BlockJob(req_id, [st.keys[i] for i in rng],
                                              [ids[i] for i in rng], st.saved_upto))
                    self._track(st, st.saved_upto)
                    st.saved_upto = upto
        return out

    def _track(self, st: _ReqState, first: int) -> None:
        if not self.publish:
            return
        _trim(self._jobs)
        # references, sliced when the job is reported (no per-step copy of the prompt)
        self._jobs[(st.req_id, first)] = (st.tokens, st.hashes, st.salt)

    # -- reports ------------------------------------------------------------------------

    def reported(self, finished_recving: Sequence[str] | set[str],
                 done: Sequence[tuple[str, int, int]]) -> list[StoredPrefix]:
        for req_id in finished_recving:
            st = self.requests.get(req_id)
            if st is not None:
                st.loading = False
        stored: list[StoredPrefix] = []
        for req_id, first, n in done:
            wanted = self._load_jobs.pop((req_id, first), None)
            st = self.requests.get(req_id)
            if wanted is not None and n < wanted and st is not None:
                # After a failed load vLLM recomputes; an async request is queued again
                # and looked up again, and the master may still list the lost replicas.
                st.load_failed = True
            job = self._jobs.pop((req_id, first), None)
            if job is None or n <= 0:
                continue
            tokens, hashes, salt = job
            upto = first + n  # the whole prefix up to here is available from the store
            stored.append(StoredPrefix(list(hashes[:upto]),
                                       list(tokens[:upto * self.block_size]), salt))
        return stored

    def finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        _trim(self._load_jobs)


# -- the worker half's bookkeeping ------------------------------------------------------

def leading(results: Sequence[str], good: tuple[str, ...]) -> int:
    """How many leading ``results`` are in ``good``."""
    return sum(1 for _ in takewhile(lambda r: r in good, results))


def job_counts(jobs: Sequence[BlockJob], results: Sequence[str],
               good: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """``(req_id, first, n)`` per job: ``n`` leading good results of its blocks, over
    ``results`` of the jobs' blocks concatenated in order."""
    out = []
    i = 0
    for job in jobs:
        out.append((job.req_id, job.first, leading(results[i:i + len(job.keys)], good)))
        i += len(job.keys)
    return out


def failed_blocks(jobs: Sequence[BlockJob], results: Sequence[str]) -> set[int]:
    """Block ids of ``jobs`` (concatenated in order) whose load result is not "ok"."""
    ids = [b for job in jobs for b in job.block_ids]
    return {b for b, r in zip(ids, results, strict=True) if r != "ok"}
