"""Token sampling for the AFD engine: greedy, or temperature / top-k / top-p.

Pure: the random generator is passed in (a ``torch.Generator`` per request, seeded by the
caller), so a seeded request samples the same tokens on every run and in every split.

Contracts:

- :class:`SamplingParams` ``.validate()`` raises ValueError naming the field:
  ``temperature`` >= 0 (0 = greedy), ``top_p`` in (0, 1], ``top_k`` >= 0 (0 = off),
  ``max_tokens`` >= 1.
- :func:`sample` ``(logits [vocab], params, generator) -> token id``. Greedy is argmax
  (lowest id on ties) and ignores the generator. Otherwise the logits are divided by the
  temperature, cut to the ``top_k`` highest, then to the smallest set whose probability
  reaches ``top_p`` (the most likely token always stays), and one token is drawn with
  ``torch.multinomial(..., generator=generator)``; a sampled request without a generator
  is refused (ValueError), never silently unseeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """One token id from ``logits`` of ``[vocab]`` (module docstring)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs a torch.Generator")
    scaled = logits.to(torch.float32) / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop = before >= params.top_p
        drop[0] = False
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
