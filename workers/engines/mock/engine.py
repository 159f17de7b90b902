"""The mock engine: :class:`MockEngine` runs the simulated core on an asyncio step loop.

No model runs: the :class:`~workers.engines.mock.scheduler.Scheduler` decides each step's
work and its modelled duration, the loop sleeps that long (the duration is already
divided by ``speedup_ratio``) and streams the sampled tokens. Many mock engines can share
one process and one event loop (:mod:`workers.fleet`).

Contract, method by method (see :mod:`workers.engines.base` for the interface):

- ``MockEngine(config, event_sink=None, clock=time.monotonic)``: stores the config;
  touches nothing else. ``event_sink`` receives each step's KV events as a list of dicts
  in vLLM's decoded form (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``); a
  worker passes :meth:`workers.kv.event_relay.KvEventRelay.submit` (relay started with
  ``start(zmq_input=False)``). ``set_event_sink`` replaces it later.
- ``start()``: validates the config, builds the core and starts the step loop.
- ``info``: ``EngineInfo("mock", model, model_path, block_size, max_model_len,
  kv_layout="mock:bs=<block_size>:bpb=<kv_bytes_per_block>", handoff)`` where handoff is
  ``{"mode": "mock", "engine_id": ..., "tp_size": 1}`` when ``config.handoff == "mock"``,
  else empty (no P/D handoff). Two mock engines can hand off iff their layouts match.
- ``generate(request)``: validates first (empty prompt, ``max_tokens < 1``,
  ``prompt + max_tokens > max_model_len``, a prompt that can never fit in the KV cache,
  a duplicate live id -> :class:`EngineError`), then streams one :class:`EngineOutput`
  per generated token, except that outputs which are already waiting when the consumer
  asks for the next one are merged into one (as vLLM's ``RequestOutputCollector`` does
  for a consumer that lags: token ids and text concatenated, the first ``queue_s`` /
  ``prefill_s``, the latest counts, finish and ``kv_transfer_params``; a consumer that
  keeps up, e.g. at any modelled step time, still gets one per token; with
  ``request.output_interval`` N > 1 the consumer is woken only for the first output with
  tokens, the finished one, one with ``kv_transfer_params``, or once N tokens wait, and
  gets what waits merged: the same tokens in fewer outputs): deterministic
  token ids, as a greedy model's (token n is a hash of
  the engine seed, the request's sampling seed and every token before it: equal prompts
  give equal tokens on every mock engine with the same seed, so P's first token equals
  D's, and re-sending prompt + the tokens generated so far continues the same sequence,
  as request migration needs), ``text`` = ``" w<id>"`` per token (or "" when
  ``token_text`` is off), cumulative ``completion_tokens``, ``cached_tokens`` (prefix-cache
  hit, last prompt token never counted; on a handoff's decode side: the prompt minus one,
  received or local), ``queue_s``/``prefill_s`` on the first token. Finish: "length" at
  ``max_tokens``/``max_model_len``, "stop" on ``stop_token_ids`` or ``eos_token_id``
  (unless ``ignore_eos``; with the default ``eos_token_id=None`` requests always run to
  ``max_tokens``). Stop *strings* and temperature are ignored.
  Optional sampling features (``serves``): ``min_tokens`` is served (before that many
  outputs a stop token is never sampled, the next candidate is), and ``min_p`` (it only
  drops tokens less likely than the top one, which a greedy model never picks: a no-op
  here, as for greedy vLLM). Refused by the worker (INVALID_ARGUMENT ``sampling.<field>
  is not served by engine mock``), as the mock has no token distribution to draw them
  from: ``logprobs``, ``prompt_logprobs``, ``logit_bias`` and ``structured`` (no model,
  no tokenizer to constrain).
  Handoff (a simulation; no KV data moves anywhere): ``kv_transfer_params`` with
  ``do_remote_decode`` (the prefill side, called with ``max_tokens=1``) runs normally and
  its final output carries ``{"do_remote_prefill": True, "remote_engine_id": <this
  engine>, "remote_request_id", "remote_block_ids", "tp_size": 1}``; its blocks are freed
  at once (they stay in its prefix cache). With ``do_remote_prefill`` (the decode side) the
  engine allocates the prompt's blocks, waits the simulated transfer time of the blocks it
  does not hold (``kv_bytes_per_block`` · blocks / ``transfer_bandwidth``), caches them
  (``BlockStored``), then decodes. If the consumer stops early the request is aborted and
  its blocks freed.
- ``abort(request_id)``: ends a live request's stream with ``finish_reason="abort"``;
  False when unknown.
- ``load()``: running, waiting (incl. receiving KV), used fraction of blocks, total blocks.
- ``counters()``: the core's cumulative counters
  (:data:`workers.engines.mock.scheduler.COUNTERS`).
- ``modelled_tpot()``: the core's ``modelled_tpot`` history as a list (timing-model TPOT
  per finished request; no wall clock in it).
- ``reset_prefix_cache()``: False while any block is in use; else forgets every cached
  block and announces ``AllBlocksCleared``.
- ``shutdown()``: stops the loop and ends live streams with "abort". Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.periodic import cancel_and_wait
from workers.engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
)
from workers.engines.mock.scheduler import Scheduler, SchedulerConfig, SimRequest, StepOutput
from workers.engines.mock.timing import make_timing

log = logging.getLogger(__name__)

EventSink = Callable[[list[dict[str, Any]]], None]
DEFAULT_VOCAB = 32000
# A busy loop that fell behind its modelled schedule catches up by at most this much.
MAX_CATCHUP_S = 0.05


@dataclass
class MockEngineConfig:
    """How to build a mock engine (all sizes in tokens/blocks/bytes)."""

    model_name: str = "mock"
    model_path: str = ""  # reported in info (a tokenizer folder for the frontend)
    num_blocks: int = 4096
    block_size: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    timing: str = "poly"  # poly | zero | table | table:PATH
    speedup_ratio: float = 1.0
    seed: int = 0
    vocab_size: int = 0  # 0: model_path's config.json vocab_size, else 32000
    eos_token_id: int | None = None
    kv_bytes_per_block: int = 4 << 20
    transfer_bandwidth: float = 25e9  # bytes/s
    handoff: str = ""  # "mock": P/D handoff by simulated transfer; "" / "none": none
    engine_id: str = ""  # default: fresh per engine
    token_text: bool = True

    def validate(self) -> None:
        """Raise ValueError for a config the core cannot run."""
        if self.handoff not in ("", "none", "mock"):
            raise ValueError(f"mock engine handoff must be mock or none, got {self.handoff!r}")
        if self.vocab_size < 0:
            raise ValueError("vocab_size must be >= 0")
        make_timing(self.timing)  # raises for an unknown spec or a bad table
        self.scheduler_config(1).validate()

    def resolved_vocab_size(self) -> int:
        if self.vocab_size:
            return self.vocab_size
        cfg = Path(self.model_path, "config.json") if self.model_path else None
        if cfg is not None and cfg.is_file():
            with contextlib.suppress(ValueError, OSError):
                vocab = json.loads(cfg.read_text()).get("vocab_size")
                if isinstance(vocab, int) and vocab > 0:
                    return vocab
        return DEFAULT_VOCAB

    def scheduler_config(self, vocab_size: int, engine_id: str = "mock") -> SchedulerConfig:
        return SchedulerConfig(
            num_blocks=self.num_blocks, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            timing=make_timing(self.timing), speedup_ratio=self.speedup_ratio,
            kv_bytes_per_block=self.kv_bytes_per_block,
            transfer_bandwidth=self.transfer_bandwidth, vocab_size=vocab_size,
            eos_token_id=self.eos_token_id, seed=self.seed, engine_id=engine_id)


class _Stream:
    """One request's outputs for its single consumer: an unbounded FIFO that wakes the
    consumer as ``asyncio.Queue`` does (``put`` resolves the waiting ``get``'s future),
    without the queue's bookkeeping. With ``interval`` > 1 (``EngineRequest.output_interval``)
    the consumer is woken only for the first output with tokens, one with more than
    tokens (finished, or with ``kv_transfer_params``), or once ``interval`` tokens wait;
    ``get`` returns everything waiting, merged."""

    __slots__ = ("items", "_loop", "_waiter", "_interval", "_tokens", "_ready", "_passed")

    def __init__(self, interval: int = 1) -> None:
        self.items: deque[StepOutput] = deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._interval = interval
        self._tokens = 0  # tokens waiting in items
        self._ready = False  # the consumer may take items now
        self._passed = False  # an output with tokens was made ready

    def put(self, out: StepOutput) -> None:
        self.items.append(out)
        if not self._ready:
            self._tokens += len(out.token_ids)
            if (self._interval <= 1 or out.finished or self._tokens >= self._interval
                    or (out.token_ids and not self._passed)
                    or out.kv_transfer_params is not None):
                self._ready = True
        if out.token_ids:
            self._passed = True
        if self._ready:
            waiter, self._waiter = self._waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def get(self) -> StepOutput:
        """The waiting outputs, merged up to a finished one (see ``_merge_waiting``)."""
        while not self._ready:
            self._waiter = self._loop.create_future()
            await self._waiter
        first = self.items.popleft()
        out = first if first.finished or not self.items else _merge_waiting(first, self.items)
        if not self.items:
            self._ready = False
            self._tokens = 0
        return out


def _merge_waiting(first: StepOutput, waiting: deque[StepOutput]) -> StepOutput:
    """``first`` merged with the outputs ``waiting`` behind it (taken from it), up to a
    finished one (see ``generate`` in the module docstring)."""
    ids = list(first.token_ids)
    out = first
    queue_s, prefill_s, params = first.queue_s, first.prefill_s, first.kv_transfer_params
    while not out.finished and waiting:
        out = waiting.popleft()
        ids.extend(out.token_ids)
        queue_s = queue_s if queue_s is not None else out.queue_s
        prefill_s = prefill_s if prefill_s is not None else out.prefill_s
        params = out.kv_transfer_params if out.kv_transfer_params is not None else params
    return dataclasses.replace(out, token_ids=ids, queue_s=queue_s, prefill_s=prefill_s,
                               kv_transfer_params=params)


class MockEngine(Engine):
    """A simulated engine; see the module docstring for each method's contract."""

    # min_p never changes a greedy pick; min_tokens suppresses stop tokens (see generate).
    serves = frozenset({"min_tokens", "min_p"})

    def __init__(self, config: MockEngineConfig | None = None, *,
                 event_sink: EventSink | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MockEngineConfig()
        self._sink = event_sink
        self._clock = clock
        self._core: Scheduler | None = None
        self._info: EngineInfo | None = None
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Where KV events go from now on (None: dropped)."""
        self._sink = sink

    @property
    def core(self) -> Scheduler:
        """The simulated core (tests and benchmarks read its state)."""
        if self._core is None:
            raise RuntimeError("MockEngine used before start()")
        return self._core

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("MockEngine.info before start()")
        return self._info

    async def start(self) -> None:
        if self._core is not None:
            raise RuntimeError("MockEngine.start() called twice")
        if self._closed:
            raise RuntimeError("MockEngine.start() after shutdown()")
        cfg = self.config
        cfg.validate()
        engine_id = cfg.engine_id or f"mock-{uuid.uuid4().hex[:12]}"
        self._core = Scheduler(cfg.scheduler_config(cfg.resolved_vocab_size(), engine_id))
        handoff: dict[str, Any] = {}
        if cfg.handoff == "mock":
            handoff = {"mode": "mock", "engine_id": engine_id, "tp_size": 1}
        self._info = EngineInfo(
            engine="mock", model=cfg.model_name, model_path=cfg.model_path,
            block_size=cfg.block_size, max_model_len=cfg.max_model_len,
            kv_layout=f"mock:bs={cfg.block_size}:bpb={cfg.kv_bytes_per_block}",
            handoff=handoff)
        self._task = asyncio.create_task(self._run(), name=f"mock-engine-{engine_id}")

    async def shutdown(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._core is not None:
            now = self._clock()
            for rid in list(self._streams):
                self._deliver(self._core.abort(rid, now))
            self._emit()

    # -- the step loop -------------------------------------------------------------------

    async def _run(self) -> None:
        core = self.core
        planned_end: float | None = None  # end of the previous step while busy
        while True:
            now = self._clock()
            batch = core.schedule(now)
            if batch.empty:
                self._emit()
                planned_end = None
                ready = core.next_ready_at()
                self._wake.clear()
                timeout = None if ready is None else ready - now
                if timeout is not None and timeout <= 0:
                    await asyncio.sleep(0)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            base = now if planned_end is None else max(planned_end, now - MAX_CATCHUP_S)
            end = base + batch.duration_s
            await asyncio.sleep(max(0.0, end - self._clock()))
            planned_end = end
            for out in core.complete(batch, self._clock()):
                self._deliver(out)
            self._emit()

    def _deliver(self, out: StepOutput | None) -> None:
        if out is None:
            return
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)

    def _emit(self) -> None:
        if self._core is None:
            return
        events = self._core.drain_events()
        if events and self._sink is not None:
            try:
                self._sink(events)
            except Exception:  # a broken sink must not stop the engine
                log.exception("KV event sink failed")

    # -- requests ------------------------------------------------------------------------

    def _check(self, request: EngineRequest) -> None:
        cfg = self.config
        n_prompt = len(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens
        if n_prompt == 0:
            raise EngineError("the prompt is empty")
        if max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {max_tokens}")
        if n_prompt + max_tokens > cfg.max_model_len:
            raise EngineError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
                f"{n_prompt + max_tokens} exceeds max_model_len ({cfg.max_model_len})")
        if -(-(n_prompt + max_tokens) // cfg.block_size) > cfg.num_blocks:
            raise EngineError(f"prompt + max_tokens need more KV blocks than the engine has "
                              f"({cfg.num_blocks} of {cfg.block_size} tokens)")
        if request.request_id in self._streams:
            raise EngineError(f"request id {request.request_id!r} is already running")

    def _text(self, ids: list[int]) -> str:
        if not self.config.token_text:
            return ""
        if len(ids) == 1:  # the usual output: one token
            return f" w{ids[0]}"
        return "".join(f" w{t}" for t in ids)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        core = self.core
        if self._closed:
            raise EngineError("the engine is shut down")
        self._check(request)
        params = request.kv_transfer_params or {}
        s = request.sampling
        rid = request.request_id
        sim = SimRequest(
            request_id=rid, prompt=list(request.prompt_token_ids), max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos, stop_token_ids=tuple(s.stop_token_ids),
            sampling_seed=s.seed, min_tokens=s.min_tokens,
            remote_prefill=bool(params.get("do_remote_prefill")),
            remote_decode=bool(params.get("do_remote_decode")), cache_salt=request.cache_salt)
        stream = _Stream(request.output_interval)
        self._streams[rid] = stream
        done = False
        try:
            core.add(sim, self._clock())
            self._wake.set()
            while True:
                out = await stream.get()
                done = out.finished
                yield EngineOutput(
                    token_ids=out.token_ids, text=self._text(out.token_ids),
                    finished=out.finished, finish_reason=out.finish_reason,
                    prompt_tokens=out.num_prompt, completion_tokens=out.num_output,
                    cached_tokens=out.cached_tokens, queue_s=out.queue_s,
                    prefill_s=out.prefill_s, kv_transfer_params=out.kv_transfer_params)
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            if not done and self._core is not None:
                self._core.abort(rid, self._clock())
                self._emit()

    async def abort(self, request_id: str) -> bool:
        if self._core is None or request_id not in self._streams:
            return False
        out = self._core.abort(request_id, self._clock())
        self._deliver(out)
        self._emit()
        return out is not None

    def load(self) -> EngineLoad:
        if self._core is None:
            return EngineLoad()
        running, waiting, usage, total = self._core.load()
        return EngineLoad(num_running=running, num_waiting=waiting, kv_usage=usage,
                          kv_total_blocks=total)

    def counters(self) -> dict[str, int]:
        return dict(self._core.counters) if self._core is not None else {}

    def modelled_tpot(self) -> list[tuple[str, float]]:
        """(request id, modelled TPOT s) of recently finished requests, oldest first."""
        return list(self._core.modelled_tpot) if self._core is not None else []

    async def reset_prefix_cache(self) -> bool:
        if self._core is None:
            return False
        ok = self._core.reset_prefix_cache()
        self._emit()
        return ok
