"""Mooncake-format traces and the prompts they stand for (pure).

Contract:

- :func:`load_trace` reads JSON lines ``{"timestamp": ms, "input_length", "output_length",
  "hash_ids"}`` into :class:`TraceRequest`; ``limit`` keeps the first N. A malformed line
  raises ValueError naming the line.
- :class:`PromptMaker` turns a request into token ids deterministically: each hash id is
  one block of ``block_tokens`` tokens drawn from a generator seeded by (seed, hash id), so
  equal hash ids give equal blocks and therefore equal prefixes (what prefix caching and
  KV routing see); the prompt is the concatenation of its blocks cut to the request's
  (scaled) input length. ``token_scale`` shrinks lengths for small models (e.g. 1/16 maps
  512-token trace blocks to 32 tokens); ``max_input`` caps prompts.
- :func:`schedule` gives each request's send time in seconds: ``timestamp / 1000 /
  speedup``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests, in file order."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                req = TraceRequest(float(d["timestamp"]), int(d["input_length"]),
                                   int(d["output_length"]), tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({exc})") from None
            if req.input_length < 1 or req.output_length < 0 or not req.hash_ids:
                raise ValueError(f"{path}:{n}: empty input or hash_ids")
            out.append(req)
    return out


@dataclass
class PromptMaker:
    """Deterministic token ids for trace requests (see the module docstring)."""

    trace_block: int = 512
    token_scale: float = 1.0
    vocab: int = 700
    seed: int = 0
    max_input: int | None = None
    max_output: int | None = None

    @property
    def block_tokens(self) -> int:
        return max(1, round(self.trace_block * self.token_scale))

    def _block(self, hash_id: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + hash_id)
        return [rng.randrange(3, self.vocab) for _ in range(self.block_tokens)]

    def input_len(self, req: TraceRequest) -> int:
        n = max(1, round(req.input_length * self.token_scale))
        return min(n, self.max_input) if self.max_input else n

    def output_len(self, req: TraceRequest) -> int:
        n = max(1, round(req.output_length * self.token_scale))
        return min(n, self.max_output) if self.max_output else n

    def tokens(self, req: TraceRequest) -> list[int]:
        """The prompt's token ids."""
        n = self.input_len(req)
        out: list[int] = []
        for h in req.hash_ids:
            if len(out) >= n:
                break
            out.extend(self._block(h))
        while len(out) < n:  # the trace's input is longer than its blocks: pad uniquely
            out.extend(self._block(-1 - len(out)))
        return out[:n]


def schedule(trace: list[TraceRequest], speedup: float) -> list[float]:
    """Send times in seconds from the start of the replay."""
    if speedup <= 0:
        raise ValueError("speedup must be > 0")
    t0 = trace[0].timestamp_ms if trace else 0.0
    return [(r.timestamp_ms - t0) / 1000.0 / speedup for r in trace]
