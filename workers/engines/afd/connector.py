"""The AFD connector: how hidden states cross between attention and FFN workers.

Method names follow vLLM's AFD plugin (``AFDConnectorBase``) for familiarity. One
*attention worker* (KV cache, embeddings, lm_head) and one *FFN worker* (post-attention
norm, MLP, residual; no KV, no request state) exchange, at every decoder layer of every
step, the hidden states of one microbatch: ``[num_tokens, hidden]`` float32, row-major.

Contract (every transport implements it; a transport object is one side of one pair of
endpoints, attention or FFN, and is used from one thread at a time):

- Attention side: ``send_attn_output(hidden, ctx)`` ships the attention output of
  ``ctx.layer`` for microbatch ``ctx.microbatch``; ``recv_ffn_output(ctx, timeout)``
  blocks until the FFN's answer for that same ``(layer, microbatch, step)`` arrives and
  returns it as a new tensor of the sent shape. Several microbatches may be in flight
  at once (at most :attr:`AfdTransportConfig.microbatches`), each with at most one
  outstanding layer.
- FFN side: ``recv_attn_output(timeout)`` blocks until some attention worker's hidden
  states arrive and returns ``(hidden, ctx)`` (``ctx.attention_id`` says whose: with
  2A1F several attention workers share one FFN worker); ``send_ffn_output(hidden, ctx)``
  answers it with the ctx it came with.
- Timeouts: a ``recv_*`` that sees nothing within ``timeout`` seconds raises
  :class:`AfdTimeout`; a peer known to be gone (closed, its process dead, a transport
  error) raises :class:`AfdPeerGone`. Both are :class:`AfdTransportError`; the caller
  ends the affected requests with that error, never waits forever.
- ``close()``: releases buffers and registrations; idempotent.
- Buffers are sized and registered once at construction (no per-step registration):
  one slot per ``(attention_id, microbatch)`` of ``max_tokens * hidden_size * 4`` bytes;
  ``num_tokens > max_tokens`` raises ValueError.

:class:`AfdContext` travels as a fixed 32-byte header (:func:`pack_context` /
:func:`unpack_context`), so transports need not pickle anything.
"""

from __future__ import annotations

import abc
import struct
from dataclasses import dataclass

import torch

STAGE_ATTN_OUTPUT = 0  # attention -> FFN
STAGE_FFN_OUTPUT = 1  # FFN -> attention
_HEADER = struct.Struct("<IIIIQQ")  # attention_id, layer, microbatch, stage, step, num_tokens
HEADER_BYTES = 32
assert _HEADER.size == HEADER_BYTES


class AfdTransportError(Exception):
    """The activation exchange failed; the affected requests end with this error."""


class AfdTimeout(AfdTransportError):
    """Nothing arrived within the timeout."""


class AfdPeerGone(AfdTransportError):
    """The peer closed or died."""


@dataclass(frozen=True)
class AfdContext:
    """What one activation message is: whose, which layer, microbatch, stage and step,
    and how many token rows (the token layout: rows are the microbatch's tokens in the
    attention worker's batch order)."""

    attention_id: int
    layer: int
    microbatch: int
    stage: int
    step: int
    num_tokens: int

    def answer(self) -> AfdContext:
        """The ctx of the FFN's reply to this attention output."""
        return AfdContext(self.attention_id, self.layer, self.microbatch,
                          STAGE_FFN_OUTPUT, self.step, self.num_tokens)


def pack_context(ctx: AfdContext) -> bytes:
    return _HEADER.pack(ctx.attention_id, ctx.layer, ctx.microbatch, ctx.stage, ctx.step,
                        ctx.num_tokens)


def unpack_context(data: bytes) -> AfdContext:
    """Inverse of :func:`pack_context`; ValueError on a header of the wrong size."""
    if len(data) != HEADER_BYTES:
        raise ValueError(f"AFD header is {len(data)} bytes, expected {HEADER_BYTES}")
    return AfdContext(*_HEADER.unpack(data))


@dataclass(frozen=True)
class AfdTransportConfig:
    """Sizes every transport pre-registers: ``hidden_size`` floats per token row, at most
    ``max_tokens`` rows per message, ``microbatches`` in flight per attention worker,
    ``attention_workers`` sharing the FFN worker (1 for 1A1F, 2 for 2A1F)."""

    hidden_size: int
    max_tokens: int
    microbatches: int = 2
    attention_workers: int = 1

    def slot_bytes(self) -> int:
        return self.max_tokens * self.hidden_size * 4


class AfdConnector(abc.ABC):
    """One side of an attention/FFN pair (module docstring)."""

    # attention side
    def send_attn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        raise NotImplementedError

    def recv_ffn_output(self, ctx: AfdContext, timeout: float) -> torch.Tensor:
        raise NotImplementedError

    # FFN side
    def recv_attn_output(self, timeout: float) -> tuple[torch.Tensor, AfdContext]:
        raise NotImplementedError

    def send_ffn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def close(self) -> None:
        """Release buffers and registrations; idempotent."""
