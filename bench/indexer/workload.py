"""A seeded, replayable KV-event and query workload for indexer benchmarks.

Contracts:

- :func:`generate` is a pure function of its :class:`WorkloadConfig` (``random.Random(seed)``
  only): the same config gives the same events and queries, byte for byte.
- Prompts are a shared prefix drawn from a pool with Zipf popularity (rank r has weight
  ``1/r^zipf``; about ``nest_fraction`` of the pool extends an earlier prefix, so prefixes
  share prefixes) followed by a unique suffix of 1..``suffix_max`` blocks. Each request goes
  to a uniformly random worker.
- Events are what an engine would publish, per worker numbered from 0 without holes:
  ``stored`` carries the blocks the worker did not already hold (the leading held run is
  skipped) with ``parent`` = the block before them (None at the start of the prompt);
  after each request, with probability ``evict``, the worker evicts its oldest
  still-held unique suffix (``removed``, tail first). Eviction only ever drops a whole
  unique suffix, so every worker's holdings stay prefix-closed (no holes): "leading run"
  and "deepest node on the tree walk" mean the same thing, and indexers with either
  semantics must agree.
- Generation stops once the stored blocks (sum over ``stored`` events) reach
  ``total_blocks``.
- Queries: ``hit_fraction`` are a Zipf prefix plus a fresh suffix, ``replay_fraction`` replay
  a random earlier request's prompt, the rest are fresh prompts (miss at the first block).
  Each query carries its tokens, local hashes and chained hashes.
- Hashes are kvmesh's (:mod:`services.common.block_hash`): ``local`` = XXH3-64 seed 1337 over
  the LE u32 tokens, ``chained[i] = xxh3(chained[i-1] ‖ local[i])``.
- :func:`reference_matches` is the brute-force answer (per worker, the leading run of a
  query's chained hashes in the set of hashes it holds at the end), independent of any index.
"""

from __future__ import annotations

import bisect
import itertools
import random
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from services.common.block_hash import SEED, local_block_hash

VOCAB = 32000


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of :func:`generate` (see the module docstring)."""

    total_blocks: int = 10_000
    workers: int = 16
    block_size: int = 16
    prefixes: int = 128
    prefix_min: int = 4
    prefix_max: int = 48
    nest_fraction: float = 0.3
    suffix_max: int = 16
    zipf: float = 1.1
    evict: float = 0.3
    queries: int = 2000
    hit_fraction: float = 0.6
    replay_fraction: float = 0.25
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError on an impossible config."""
        if self.total_blocks < 1 or self.workers < 1 or self.block_size < 1:
            raise ValueError("total_blocks, workers and block_size must be >= 1")
        if self.prefixes < 1 or not 1 <= self.prefix_min <= self.prefix_max:
            raise ValueError("need prefixes >= 1 and 1 <= prefix_min <= prefix_max")
        if self.suffix_max < 1 or self.queries < 0 or self.zipf < 0:
            raise ValueError("need suffix_max >= 1, queries >= 0, zipf >= 0")
        for name in ("nest_fraction", "evict", "hit_fraction", "replay_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.hit_fraction + self.replay_fraction > 1.0:
            raise ValueError("hit_fraction + replay_fraction must be <= 1")


@dataclass(frozen=True)
class Event:
    """One engine event, neutral form: each side converts it to its own input."""

    worker: int
    event_id: int
    kind: str  # "stored" | "removed"
    hashes: tuple[int, ...]  # chained (sequence) hashes
    locals: tuple[int, ...]  # local (per-block) hashes; empty for "removed"
    parent: int | None = None  # chained hash of the block before, for "stored"


@dataclass(frozen=True)
class Query:
    """One FindMatches input: the prompt's tokens (full blocks) and both hash forms."""

    kind: str  # "hit" | "replay" | "miss"
    tokens: tuple[int, ...]
    locals: tuple[int, ...]
    hashes: tuple[int, ...]


@dataclass
class Workload:
    """Events in apply order, queries, and each worker's final holdings."""

    config: WorkloadConfig
    events: list[Event]
    queries: list[Query]
    held: dict[int, set[int]]
    stored_blocks: int
    removed_blocks: int


def chain(prev: int | None, local: int) -> int:
    """kvmesh's chained hash of a block after ``prev`` (None at the prompt start)."""
    if prev is None:
        return local
    return int(xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), seed=SEED))


@dataclass(frozen=True)
class _Prompt:
    tokens: tuple[int, ...]
    locals: tuple[int, ...]
    hashes: tuple[int, ...]


def _extend(rng: random.Random, base: _Prompt | None, blocks: int, block_size: int) -> _Prompt:
    tokens = list(base.tokens) if base else []
    locals_ = list(base.locals) if base else []
    hashes = list(base.hashes) if base else []
    prev = hashes[-1] if hashes else None
    population = range(VOCAB)
    for _ in range(blocks):
        block = rng.choices(population, k=block_size)
        local = local_block_hash(block)
        prev = chain(prev, local)
        tokens += block
        locals_.append(local)
        hashes.append(prev)
    return _Prompt(tuple(tokens), tuple(locals_), tuple(hashes))


def generate(cfg: WorkloadConfig) -> Workload:
    """The workload of ``cfg`` (see the module docstring)."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    bs = cfg.block_size
    pool: list[_Prompt] = []
    for _ in range(cfg.prefixes):
        n = rng.randint(cfg.prefix_min, cfg.prefix_max)
        if pool and rng.random() < cfg.nest_fraction:
            base = rng.choice(pool)
            pool.append(_extend(rng, base, max(1, n - len(base.hashes)), bs))
        else:
            pool.append(_extend(rng, None, n, bs))
    cum = list(itertools.accumulate(1.0 / (r + 1) ** cfg.zipf for r in range(len(pool))))

    def pick_prefix() -> _Prompt:
        return pool[bisect.bisect_right(cum, rng.random() * cum[-1])]

    held: dict[int, set[int]] = {w: set() for w in range(cfg.workers)}
    next_id = dict.fromkeys(range(cfg.workers), 0)
    suffixes: dict[int, deque[tuple[int, ...]]] = {w: deque() for w in range(cfg.workers)}
    events: list[Event] = []
    requests: list[_Prompt] = []
    stored = removed = 0

    def emit(w: int, kind: str, hashes: Sequence[int], locals_: Sequence[int] = (),
             parent: int | None = None) -> None:
        events.append(Event(w, next_id[w], kind, tuple(hashes), tuple(locals_), parent))
        next_id[w] += 1

    while stored < cfg.total_blocks:
        prefix = pick_prefix()
        prompt = _extend(rng, prefix, rng.randint(1, cfg.suffix_max), bs)
        requests.append(prompt)
        w = rng.randrange(cfg.workers)
        mine = held[w]
        k = 0
        while k < len(prompt.hashes) and prompt.hashes[k] in mine:
            k += 1
        new = prompt.hashes[k:]
        if new:  # always, as the suffix is fresh
            emit(w, "stored", new, prompt.locals[k:], prompt.hashes[k - 1] if k else None)
            mine.update(new)
            stored += len(new)
        suffixes[w].append(prompt.hashes[len(prefix.hashes):])
        if rng.random() < cfg.evict and len(suffixes[w]) > 1:
            victim = suffixes[w].popleft()
            emit(w, "removed", victim[::-1])
            mine.difference_update(victim)
            removed += len(victim)

    queries: list[Query] = []
    for _ in range(cfg.queries):
        u = rng.random()
        if u < cfg.hit_fraction:
            kind, p = "hit", _extend(rng, pick_prefix(), rng.randint(1, cfg.suffix_max), bs)
        elif u < cfg.hit_fraction + cfg.replay_fraction:
            kind, p = "replay", rng.choice(requests)
        else:
            n = rng.randint(cfg.prefix_min, cfg.prefix_max) + rng.randint(1, cfg.suffix_max)
            kind, p = "miss", _extend(rng, None, n, bs)
        queries.append(Query(kind, p.tokens, p.locals, p.hashes))
    return Workload(cfg, events, queries, held, stored, removed)


def reference_matches(held: dict[int, set[int]], hashes: Sequence[int]) -> dict[int, int]:
    """Brute force: worker → leading run of ``hashes`` it holds (workers with 0 omitted)."""
    out: dict[int, int] = {}
    for w, mine in held.items():
        n = 0
        for h in hashes:
            if h not in mine:
                break
            n += 1
        if n:
            out[w] = n
    return out
