"""The AFD engine core: continuous batching on the attention side, unsplit or split.

Pure core: no grpc, asyncio or etcd. The clock (for the timing stats only) is passed in.

:class:`AfdEngine` (the attention worker's engine, or the whole model when unsplit):

- ``add_request(request_id, prompt_ids, params, generator=None)``: queue a request.
  ValueError (naming the field) for an empty prompt, token ids outside the vocabulary,
  invalid sampling params, a duplicate id, or ``len(prompt) + max_tokens`` beyond
  ``max_model_len``.
- ``step() -> list[StepOutput]``: admit waiting requests (FIFO) whose whole KV capacity
  (prompt + max_tokens) fits the cache and whose prompt fits the step's token budget, run
  one forward pass over every running request (new ones prefill their whole prompt,
  running ones decode their last token), sample one token each, and report it. A
  finished request (``stop``: EOS or a stop token; ``length``: max_tokens) frees its KV in
  the same step. If the transport fails (:class:`AfdTransportError`) every request of the
  step ends with ``finish_reason="error"`` and the error text, and its KV is freed; the
  engine stays usable (``set_executor`` a fresh one once an FFN worker is back).
- ``abort(request_id) -> bool``: drop a waiting or running request and free its KV.

Batch layout: the step's tokens are rows ``[T, hidden]``, request after request in
admission order. With ``microbatches=2`` the requests are cut into two contiguous groups
of about equal token counts (fewer groups when there are fewer requests); each group runs
as its own forward pass, in the unsplit executor too, so both executors see the same
shapes.

Executors (the layer loop):

- :class:`UnsplitExecutor`: attention then FFN of every layer, microbatch after microbatch,
  in one process — the reference.
- :class:`SplitExecutor`: attention here, FFN across an :class:`AfdConnector`. Every
  microbatch sends layer 0, then the oldest outstanding ``(microbatch, layer)`` is received
  and that microbatch's next attention layer computed and sent. With two microbatches this
  is the ping-pong: while one microbatch's FFN runs remotely, the other's attention runs.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from workers.engines.afd.connector import (
    STAGE_ATTN_OUTPUT,
    AfdConnector,
    AfdContext,
    AfdTransportError,
)
from workers.engines.afd.kv_cache import KvCache
from workers.engines.afd.model import AttentionSide, FfnSide, SeqSlice
from workers.engines.afd.sampling import SamplingParams, sample

Clock = Callable[[], float]


@dataclass(frozen=True)
class Microbatch:
    """One forward pass's rows: ``seqs`` in row order, token ids and positions ``[T]``."""

    index: int
    seqs: tuple[SeqSlice, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class ExecStats:
    """Cumulative timings (seconds) and counts of an executor."""

    attn_compute_s: float = 0.0
    ffn_compute_s: float = 0.0
    send_s: float = 0.0
    recv_wait_s: float = 0.0
    layer_calls: int = 0
    steps: int = 0


class LayerExecutor:
    """Runs the decoder layers over a step's microbatches; returns the last hidden
    ``[T, hidden]`` of each microbatch, in order."""

    stats: ExecStats

    def run(self, attn: AttentionSide, kv: KvCache, mbs: Sequence[Microbatch],
            step: int) -> list[torch.Tensor]:
        raise NotImplementedError


class UnsplitExecutor(LayerExecutor):
    def __init__(self, ffn: FfnSide, clock: Clock = time.perf_counter) -> None:
        self.ffn = ffn
        self.clock = clock
        self.stats = ExecStats()

    def run(self, attn: AttentionSide, kv: KvCache, mbs: Sequence[Microbatch],
            step: int) -> list[torch.Tensor]:
        out = []
        cfg = attn.config
        for mb in mbs:
            h = attn.embed_tokens(mb.token_ids)
            for layer in range(cfg.num_layers):
                t0 = self.clock()
                h = attn.layers[layer].forward(h, mb.seqs, mb.positions, kv, cfg, attn.rope)
                t1 = self.clock()
                h = self.ffn.forward(layer, h)
                self.stats.attn_compute_s += t1 - t0
                self.stats.ffn_compute_s += self.clock() - t1
                self.stats.layer_calls += 1
            out.append(h)
        self.stats.steps += 1
        return out


class SplitExecutor(LayerExecutor):
    """Attention here, FFN behind ``connector`` (module docstring)."""

    def __init__(self, connector: AfdConnector, attention_id: int = 0,
                 recv_timeout: float = 30.0, clock: Clock = time.perf_counter) -> None:
        self.connector = connector
        self.attention_id = attention_id
        self.recv_timeout = recv_timeout
        self.clock = clock
        self.stats = ExecStats()

    def _attn_and_send(self, attn: AttentionSide, kv: KvCache, mb: Microbatch, layer: int,
                       h: torch.Tensor, step: int) -> AfdContext:
        t0 = self.clock()
        mid = attn.layers[layer].forward(h, mb.seqs, mb.positions, kv, attn.config, attn.rope)
        t1 = self.clock()
        ctx = AfdContext(self.attention_id, layer, mb.index, STAGE_ATTN_OUTPUT, step,
                         mb.num_tokens)
        self.connector.send_attn_output(mid, ctx)
        self.stats.attn_compute_s += t1 - t0
        self.stats.send_s += self.clock() - t1
        self.stats.layer_calls += 1
        return ctx

    def run(self, attn: AttentionSide, kv: KvCache, mbs: Sequence[Microbatch],
            step: int) -> list[torch.Tensor]:
        num_layers = attn.config.num_layers
        out: list[torch.Tensor | None] = [None] * len(mbs)
        pending: collections.deque[tuple[Microbatch, AfdContext]] = collections.deque()
        for mb in mbs:
            pending.append((mb, self._attn_and_send(attn, kv, mb, 0,
                                                    attn.embed_tokens(mb.token_ids), step)))
        while pending:
            mb, ctx = pending.popleft()
            t0 = self.clock()
            h = self.connector.recv_ffn_output(ctx, self.recv_timeout)
            self.stats.recv_wait_s += self.clock() - t0
            if ctx.layer + 1 < num_layers:
                pending.append((mb, self._attn_and_send(attn, kv, mb, ctx.layer + 1, h, step)))
            else:
                out[mb.index] = h
        self.stats.steps += 1
        return [h for h in out if h is not None]


@dataclass(frozen=True)
class StepOutput:
    """One request's result of one step. ``token`` is None only on an error or abort."""

    request_id: str
    token: int | None
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    logits: torch.Tensor | None = None  # [vocab], when the engine keeps logits


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is written

    @property
    def capacity(self) -> int:
        return len(self.prompt) + self.params.max_tokens


def partition(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut ``sizes`` (token counts, in order) into at most ``parts`` contiguous non-empty
    groups of about equal sums; returns ``(begin, end)`` index ranges."""
    n = len(sizes)
    parts = max(1, min(parts, n))
    total = sum(sizes)
    bounds = [0]
    acc = 0
    for i, s in enumerate(sizes):
        acc += s
        k = len(bounds)
        remaining_items = n - (i + 1)
        if k < parts and remaining_items >= parts - k and (
                acc >= total * k / parts or remaining_items == parts - k):
            bounds.append(i + 1)
    if bounds[-1] != n:
        bounds.append(n)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class AfdEngine:
    """Continuous batching over an executor (module docstring)."""

    def __init__(self, attn: AttentionSide, kv: KvCache, executor: LayerExecutor, *,
                 microbatches: int = 1, max_batch_tokens: int = 2048,
                 max_model_len: int | None = None, keep_logits: bool = False) -> None:
        if microbatches < 1:
            raise ValueError("microbatches must be >= 1")
        self.attn = attn
        self.kv = kv
        self.executor = executor
        self.microbatches = microbatches
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = min(max_model_len or attn.config.max_position_embeddings,
                                 attn.config.max_position_embeddings)
        self.keep_logits = keep_logits
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._ids: set[str] = set()
        self._step = 0

    # --- requests
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    generator: torch.Generator | None = None) -> None:
        params.validate()
        if request_id in self._ids:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        vocab = self.attn.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_ids has ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len {self.max_model_len}")
        if len(prompt_ids) > self.max_batch_tokens:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) exceeds max_batch_tokens "
                             f"{self.max_batch_tokens}")
        if not params.greedy and generator is None:
            raise ValueError("temperature > 0 needs a generator (seed the request)")
        self._waiting.append(_Request(request_id, list(prompt_ids), params, generator))
        self._ids.add(request_id)

    def abort(self, request_id: str) -> bool:
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        self._waiting = collections.deque(r for r in self._waiting if r.request_id != request_id)
        self._running = [r for r in self._running if r.request_id != request_id]
        self.kv.free(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def set_executor(self, executor: LayerExecutor) -> None:
        """Swap the executor (e.g. a new connector once an FFN worker is back)."""
        self.executor = executor

    # --- the step
    def _admit(self) -> None:
        budget = self.max_batch_tokens - len(self._running)
        while self._waiting:
            req = self._waiting[0]
            if len(req.prompt) > budget or not self.kv.can_allocate(req.capacity):
                break
            self._waiting.popleft()
            self.kv.allocate(req.request_id, req.capacity)
            self._running.append(req)
            budget -= len(req.prompt)

    def _microbatches(self, reqs: Sequence[_Request]) -> list[Microbatch]:
        pieces = []
        for r in reqs:
            if r.num_computed == 0:
                pieces.append((r, 0, r.prompt))
            else:
                pieces.append((r, r.num_computed, [r.output[-1]]))
        mbs = []
        for index, (b, e) in enumerate(partition([len(p[2]) for p in pieces],
                                                 self.microbatches)):
            seqs: list[SeqSlice] = []
            ids: list[int] = []
            pos: list[int] = []
            row = 0
            for r, start, toks in pieces[b:e]:
                seqs.append(SeqSlice(r.request_id, row, start, len(toks)))
                ids.extend(toks)
                pos.extend(range(start, start + len(toks)))
                row += len(toks)
            mbs.append(Microbatch(index, tuple(seqs), torch.tensor(ids, dtype=torch.int64),
                                  torch.tensor(pos, dtype=torch.int64)))
        return mbs

    def step(self) -> list[StepOutput]:
        self._admit()
        reqs = list(self._running)
        if not reqs:
            return []
        self._step += 1
        mbs = self._microbatches(reqs)
        try:
            hidden = self.executor.run(self.attn, self.kv, mbs, self._step)
        except AfdTransportError as e:
            return self._fail(reqs, e)
        by_id = {r.request_id: r for r in reqs}
        outputs = []
        for mb, h in zip(mbs, hidden, strict=True):
            last_rows = torch.tensor([s.row + s.num_tokens - 1 for s in mb.seqs])
            logits = self.attn.logits(h[last_rows])
            for s, row_logits in zip(mb.seqs, logits, strict=True):
                req = by_id[s.request_id]
                req.num_computed = s.start + s.num_tokens
                outputs.append(self._emit(req, row_logits))
        return outputs

    def _emit(self, req: _Request, logits: torch.Tensor) -> StepOutput:
        token = sample(logits, req.params, req.generator)
        req.output.append(token)
        p = req.params
        eos = self.attn.config.eos_token_id
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and eos is not None and token == eos):
            reason = "stop"
        elif len(req.output) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(req)
        return StepOutput(req.request_id, token, reason is not None, reason,
                          logits=logits if self.keep_logits else None)

    def _finish(self, req: _Request) -> None:
        self._running.remove(req)
        self._ids.discard(req.request_id)
        self.kv.free(req.request_id)

    def _fail(self, reqs: Sequence[_Request], err: AfdTransportError) -> list[StepOutput]:
        text = f"{type(err).__name__}: {err}"
        for r in reqs:
            self._finish(r)
        return [StepOutput(r.request_id, None, True, "error", error=text) for r in reqs]
