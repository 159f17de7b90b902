"""TTFT of KV reuse through an engine's KV connector: a miss (compute + save), then a hit.

Shared by :mod:`bench.store.run` (kvmesh's store connector, with and without L1) and
:mod:`bench.store.mooncake_vllm` (vLLM's ``MooncakeStoreConnector``), so both sides are
measured the same way.

Contract of :class:`ReuseProbe` (``rng`` seeded by the caller; ``vocab`` bounds the ids,
:func:`vocab_of` gives a model's):

- ``tokens(n)``: ``n`` random prompt token ids in ``[vocab[0], vocab[1])``.
- ``await first_token(engine, tokens)`` → :class:`Sample`: wall time to the first output
  token (``max_tokens=1``, greedy), the request's ``cached_tokens`` (prefix cache plus
  connector hits, as vLLM counts them) and the first token id.
- ``await miss_then_hit(engine, name, prefixes, reps, result, settle_s)``: for each prefix
  length L and rep: a fresh L-token prefix + a 16-token suffix after a prefix-cache
  reset (``<name>_miss``: computed and saved), ``settle_s`` for asynchronous saves, a
  reset, the same prefix + a new suffix (``<name>_hit``: loaded). Medians of the
  TTFTs go to ``result[<name>_miss][L]`` / ``result[<name>_hit][L]``, the hit's
  ``cached_tokens`` (last rep) to ``result[<name>_hit_tokens][L]``. One extra rep per L
  repeats the miss's exact prompt after the reset (a hit of the whole prefix) and checks
  that its greedy first token equals the computed one: ``result[<name>_same_first]``.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIX = 16


def vocab_of(model_path: str | Path) -> tuple[int, int]:
    """Token ids to draw prompts from: [100, min(20000, vocab_size)) (small models: [3, ...))."""
    size = int(json.loads(Path(model_path, "config.json").read_text())["vocab_size"])
    return (100, min(20000, size)) if size > 200 else (3, size)


@dataclass
class Sample:
    ttft_s: float
    cached_tokens: int
    first_token: int


class ReuseProbe:
    """See the module docstring."""

    def __init__(self, rng: random.Random, vocab: tuple[int, int] = (100, 20000)) -> None:
        self.rng = rng
        self.vocab = vocab

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*self.vocab) for _ in range(n)]

    async def first_token(self, engine: Any, tokens: list[int]) -> Sample:
        from workers.engines.base import EngineRequest, Sampling

        req = EngineRequest(f"ttft-{self.rng.random()}", tokens,
                            Sampling(max_tokens=1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        first: float | None = None
        cached, tok = 0, -1
        async for out in engine.generate(req):
            if first is None and out.token_ids:
                first = time.perf_counter() - t0
                tok = out.token_ids[0]
            cached = max(cached, out.cached_tokens)
        assert first is not None, "no token"
        return Sample(first, cached, tok)

    async def miss_then_hit(self, engine: Any, name: str, prefixes: list[int], reps: int,
                            result: dict[str, Any], settle_s: float = 1.0) -> None:
        miss_key, hit_key = f"{name}_miss", f"{name}_hit"
        for key in (miss_key, hit_key, f"{name}_hit_tokens"):
            result.setdefault(key, {})
        same = True
        for n in prefixes:
            miss, hit = [], []
            for rep in range(reps + 1):
                prefix = self.tokens(n)
                first = prefix + self.tokens(SUFFIX)
                await engine.reset_prefix_cache()
                m = await self.first_token(engine, first)
                await asyncio.sleep(settle_s)  # asynchronous saves reach the store
                await engine.reset_prefix_cache()
                if rep == reps:  # the extra rep: the very same prompt, for fidelity
                    same &= (await self.first_token(engine, first)).first_token == m.first_token
                    continue
                h = await self.first_token(engine, prefix + self.tokens(SUFFIX))
                miss.append(m.ttft_s)
                hit.append(h.ttft_s)
                result[f"{name}_hit_tokens"][n] = h.cached_tokens
            result[miss_key][n] = statistics.median(miss)
            result[hit_key][n] = statistics.median(hit)
            print(f"{name} {n}: miss {result[miss_key][n] * 1e3:.0f} ms, hit "
                  f"{result[hit_key][n] * 1e3:.0f} ms "
                  f"({result[f'{name}_hit_tokens'][n]} cached tokens)", flush=True)
        result[f"{name}_same_first"] = same
