"""The FFN worker's loop: answer attention outputs with post-norm + MLP + residual.

Pure core (no grpc/asyncio); the clock is passed in for the stats only.

:class:`FfnServer` contract:

- ``serve_once(timeout) -> int``: wait up to ``timeout`` s for one attention output
  (:class:`AfdTimeout` propagates when none came), then take every further message that
  is already pending — or arrives within ``gather_s`` — up to ``max_batch_messages``.
  Messages at the same layer (from several attention workers, 2A1F, or several
  microbatches) are concatenated into one ``[sum tokens, hidden]`` batch, run through
  that layer's FFN, split back and answered each with its own ctx; messages at different
  layers run as separate batches. Returns how many messages were answered. An answer
  whose attention worker has left (:class:`AfdPeerGone` from ``send_ffn_output``) is
  counted in ``stats.dropped`` and skipped; the others are still answered.
- ``run(should_stop, poll_s)``: ``serve_once`` until ``should_stop()``; idle timeouts are
  not errors. Returns when the connector is closed (AfdPeerGone from recv) or on stop.

Because every projection is batch-invariant (see :mod:`workers.engines.afd.model`), a
message's answer does not depend on what it was batched with.

:func:`serve_shm_ffn` is a process entry point: load the FFN side of a model folder,
serve it on the shared-memory transport ``name`` forever (tests and the worker kill it).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.engines.afd.connector import (
    AfdConnector,
    AfdContext,
    AfdPeerGone,
    AfdTimeout,
    AfdTransportConfig,
)
from workers.engines.afd.model import FfnSide, load_ffn_side


@dataclass
class FfnStats:
    messages: int = 0
    batches: int = 0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    compute_s: float = 0.0
    dropped: int = 0


class FfnServer:
    """One FFN worker serving one connector (module docstring)."""

    def __init__(self, ffn: FfnSide, connector: AfdConnector, *, max_batch_messages: int = 8,
                 gather_s: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        if max_batch_messages < 1:
            raise ValueError("max_batch_messages must be >= 1")
        self.ffn = ffn
        self.connector = connector
        self.max_batch_messages = max_batch_messages
        self.gather_s = gather_s
        self.clock = clock
        self.stats = FfnStats()

    def serve_once(self, timeout: float) -> int:
        msgs = [self.connector.recv_attn_output(timeout)]
        deadline = time.monotonic() + self.gather_s
        while len(msgs) < self.max_batch_messages:
            try:
                msgs.append(self.connector.recv_attn_output(
                    max(0.0, deadline - time.monotonic())))
            except AfdTimeout:
                break
        by_layer: dict[int, list[tuple[torch.Tensor, AfdContext]]] = {}
        for hidden, ctx in msgs:
            by_layer.setdefault(ctx.layer, []).append((hidden, ctx))
        for layer, group in by_layer.items():
            t0 = self.clock()
            if len(group) == 1:
                outs = [self.ffn.forward(layer, group[0][0])]
            else:
                batch = torch.cat([h for h, _ in group])
                outs = list(torch.split(self.ffn.forward(layer, batch),
                                        [c.num_tokens for _, c in group]))
            self.stats.compute_s += self.clock() - t0
            self.stats.batches += 1
            self.stats.batch_sizes[len(group)] += 1
            for out, (_, ctx) in zip(outs, group, strict=True):
                try:
                    self.connector.send_ffn_output(out.contiguous(), ctx.answer())
                except AfdPeerGone:
                    self.stats.dropped += 1
        self.stats.messages += len(msgs)
        return len(msgs)

    def run(self, should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.2) -> None:
        while not should_stop():
            try:
                self.serve_once(poll_s)
            except AfdTimeout:
                continue
            except AfdPeerGone:
                return


def serve_shm_ffn(model_dir: str, name: str, hidden_size: int, max_tokens: int,
                  microbatches: int = 2, attention_workers: int = 1,
                  max_batch_messages: int = 8, gather_s: float = 0.0,
                  threads: int = 0) -> None:
    """Process entry point: the FFN side of ``model_dir`` on shared memory ``name``."""
    from workers.engines.afd.transport_local import ShmFfnConnector

    if threads:
        torch.set_num_threads(threads)
    ffn = load_ffn_side(model_dir)
    config = AfdTransportConfig(hidden_size, max_tokens, microbatches, attention_workers)
    conn = ShmFfnConnector(name, config)
    try:
        FfnServer(ffn, conn, max_batch_messages=max_batch_messages, gather_s=gather_s).run()
    finally:
        conn.close()
