"""The one load client both systems get: closed loop and open loop, ``/v1/completions``.

Contracts:

- :func:`body(model, i, words, max_tokens)` is request ``i``'s JSON: the text prompt of
  :func:`bench.mesh_profile.run.prompt_text` (a head of 5/6 of ``words`` words shared by
  every request, then words of its own), ``max_tokens``, ``ignore_eos``, temperature 0,
  not streamed. Both systems get byte-identical bodies for the same ``i``.
- :func:`check_response(status, payload, max_tokens)` is None for a fair answer (HTTP
  200 with ``usage.completion_tokens == max_tokens``), else a one-line reason. A request
  that fails the check is counted under ``errors`` (with its reason), not under ``ok``,
  and its latency is not in the percentiles: a side that answers fewer tokens cannot look
  faster.
- :func:`closed_loop(url, model, n, concurrency, ...)`: ``concurrency`` clients (one
  connection each), each sending its next request when its last one is done, ``n`` in all;
  latency = send → complete response. :func:`open_loop(url, model, n, rate, ...)`: ``n``
  requests with Poisson arrivals at ``rate`` per second (seeded), each on its own task,
  whatever is in flight. Both return :func:`summary`: ``requests``, ``ok``, ``errors``,
  ``first_errors`` (up to 3 distinct), ``completion_tokens`` (value → count over
  answers), ``wall_s``, ``req_per_s`` (ok / wall), ``p50_ms``, ``p99_ms``, ``mean_ms``
  (NaN when none was ok) and, for the open loop, ``offered_rps``.
- :func:`paced_pairs(urls, model, n, gap_s)`: the issue's "at 100 req/s" latency, one
  request at a time, both systems in one sequence: ``n`` rounds, each sending one
  request to every side in a random order (seeded), every request ``gap_s`` after the
  previous answer (10 ms: each process sleeps about as long as at 100 req/s),
  each side over one keep-alive connection of the lean client
  (:class:`bench.router_overhead.lean.LeanHttp`, a few µs per request: httpx would add
  hundreds). Request ``i`` is the same for every side: ``router_overhead``'s 64 token
  ids for ``offset + i`` (a 32-token head shared by all), ``max_tokens`` 1,
  ``ignore_eos``, temperature 0, so no tokenizer runs. Returns per side :func:`summary`
  (its ``wall_s`` and ``req_per_s`` over both sides' time) plus ``p90_ms``, and
  ``paired_diff_p50_ms``: the median over rounds where both answered of (first side −
  second side), in ``urls``' order: the machine's drift, large here, moves both alike.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from bench.mesh_profile.run import prompt_text, run_clients
from bench.router_overhead.lean import LeanHttp, LeanHttpError
from bench.router_overhead.run import prompt as token_prompt


def body(model: str, i: int, words: int, max_tokens: int) -> dict[str, Any]:
    """See the module docstring."""
    return {"model": model, "prompt": prompt_text(i, words), "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": False}


def check_response(status: int, payload: Any, max_tokens: int) -> str | None:
    """See the module docstring."""
    if status != 200:
        detail = str(payload)[:160] if payload is not None else ""
        return f"HTTP {status} {detail}".strip()
    if not isinstance(payload, dict):
        return "response is not a JSON object"
    usage = payload.get("usage")
    got = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if got != max_tokens:
        return f"usage.completion_tokens {got!r} != {max_tokens}"
    return None


class _Tally:
    def __init__(self) -> None:
        self.lat: list[float] = []
        self.errors: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    async def one(self, http: httpx.AsyncClient, url: str, req: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            r = await http.post(f"{url}/v1/completions", json=req)
            dt = time.perf_counter() - t0
            try:
                payload: Any = r.json()
            except ValueError:
                payload = r.text[:160]
        except Exception as exc:  # noqa: BLE001 - counted, reported
            self.errors[f"{type(exc).__name__}: {exc}"[:200]] += 1
            return
        if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
            self.tokens[str(payload["usage"].get("completion_tokens"))] += 1
        why = check_response(r.status_code, payload, req["max_tokens"])
        if why is None:
            self.lat.append(dt)
        else:
            self.errors[why] += 1


def summary(n: int, lat: list[float], errors: Counter[str], tokens: Counter[str],
            wall_s: float) -> dict[str, Any]:
    """See the module docstring."""
    a = np.asarray(lat, dtype=float)

    def pct(q: float) -> float:
        return float(np.percentile(a, q) * 1e3) if a.size else math.nan

    return {"requests": n, "ok": len(lat), "errors": sum(errors.values()),
            "first_errors": [e for e, _ in errors.most_common(3)],
            "completion_tokens": dict(tokens), "wall_s": wall_s,
            "req_per_s": len(lat) / wall_s if wall_s > 0 else math.nan,
            "p50_ms": pct(50), "p99_ms": pct(99),
            "mean_ms": float(a.mean() * 1e3) if a.size else math.nan}


async def closed_loop(url: str, model: str, n: int, concurrency: int, words: int,
                      max_tokens: int, offset: int = 0,
                      timeout_s: float = 60.0) -> dict[str, Any]:
    """See the module docstring."""
    tally = _Tally()

    async def one(http: httpx.AsyncClient, i: int) -> None:
        await tally.one(http, url, body(model, offset + i, words, max_tokens))

    wall = await run_clients(n, concurrency, one, timeout_s)
    return summary(n, tally.lat, tally.errors, tally.tokens, wall)


async def open_loop(url: str, model: str, n: int, rate: float, words: int,
                    max_tokens: int, offset: int = 0, seed: int = 0,
                    timeout_s: float = 60.0) -> dict[str, Any]:
    """See the module docstring."""
    rng = random.Random(seed)
    tally = _Tally()
    tasks: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient(timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=512)) as http:
        start = time.perf_counter()
        t = 0.0
        for i in range(n):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                tally.one(http, url, body(model, offset + i, words, max_tokens))))
            t += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    out = summary(n, tally.lat, tally.errors, tally.tokens, wall)
    out["offered_rps"] = rate
    return out


@dataclass
class Paced:
    """:func:`paced_rounds`' outcome per side: each round's latency in seconds (None where
    the answer failed the check), the failures by reason, the answers' token counts."""

    lat: dict[str, list[float | None]]
    errors: dict[str, Counter[str]]
    tokens: dict[str, Counter[str]]
    wall_s: float


async def paced_rounds(urls: dict[str, str], model: str, n: int, gap_s: float,
                       seed: int = 0, offset: int = 0) -> Paced:
    """The rounds of :func:`paced_pairs` (see the module docstring), unsummarised."""
    rng = random.Random(seed)
    clients = {}
    for name, url in urls.items():
        host, _, port = url.removeprefix("http://").rpartition(":")
        clients[name] = LeanHttp(host, int(port))
    out = Paced({name: [] for name in urls}, {name: Counter() for name in urls},
                {name: Counter() for name in urls}, 0.0)
    start = time.perf_counter()
    try:
        for i in range(n):
            req = {"model": model, "prompt": token_prompt(offset + i), "max_tokens": 1,
                   "ignore_eos": True, "temperature": 0, "stream": False}
            order = list(clients.items())
            rng.shuffle(order)
            for name, http in order:
                await asyncio.sleep(gap_s)  # pacing: the gap between requests
                t0 = time.perf_counter()
                try:
                    raw = await http.post("/v1/completions", req)
                    dt = time.perf_counter() - t0
                    payload: Any = json.loads(raw)
                    why = check_response(200, payload, 1)
                    usage = payload.get("usage") if isinstance(payload, dict) else None
                    if isinstance(usage, dict):
                        out.tokens[name][str(usage.get("completion_tokens"))] += 1
                except LeanHttpError as exc:
                    why = f"HTTP {exc.status}"
                except Exception as exc:  # noqa: BLE001 - counted, reported
                    why = f"{type(exc).__name__}: {exc}"[:200]
                if why is None:
                    out.lat[name].append(dt)
                else:
                    out.errors[name][why] += 1
                    out.lat[name].append(None)
    finally:
        for http in clients.values():
            http.close()
    out.wall_s = time.perf_counter() - start
    return out


async def paced_pairs(urls: dict[str, str], model: str, n: int, gap_s: float,
                      seed: int = 0, offset: int = 0) -> dict[str, Any]:
    """See the module docstring."""
    got = await paced_rounds(urls, model, n, gap_s, seed, offset)
    out: dict[str, Any] = {}
    for name in urls:
        ok = [x for x in got.lat[name] if x is not None]
        out[name] = summary(n, ok, got.errors[name], got.tokens[name], got.wall_s)
        out[name]["p90_ms"] = float(np.percentile(ok, 90) * 1e3) if ok else math.nan
    first, second = list(urls)[:2]
    diffs = [a - b for a, b in zip(got.lat[first], got.lat[second], strict=True)
             if a is not None and b is not None]
    out["paired_diff_p50_ms"] = float(np.median(diffs) * 1e3) if diffs else math.nan
    out["gap_ms"] = gap_s * 1e3
    return out
