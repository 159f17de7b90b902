"""The AFD engines behind the worker's :class:`~workers.engines.base.Engine` interface.

Kind ``"afd"`` (:func:`workers.engines.create_engine`), one class per role:

- :class:`AfdAttentionEngine` (``--afd-role attention``): embeddings, attention, KV
  cache, lm_head and sampling of :class:`~workers.engines.afd.engine.AfdEngine`, whose
  FFN runs on an FFN worker across the transport (``shm``: shared memory on this host).
  The core's ``step()`` loop runs in one thread of its own (torch with
  ``threads`` intra-op threads, 1 by default: on 2 shared cores two threads made steps
  ~15x slower); requests reach it through a command queue and their tokens come back
  to asyncio with ``call_soon_threadsafe``. The FFN side answers the core's split
  executor; ``microbatches`` = 2 is the ping-pong.
- :class:`AfdFfnEngine` (``--afd-role ffn``): the FFN side
  (:class:`~workers.engines.afd.ffn_server.FfnServer`) serving up to
  ``attention_workers`` attention workers on the transport endpoint; no KV, no request
  state. ``generate`` refuses every request (EngineError): the router never sends it one
  (its record has no ``generate`` capability, :data:`AFD_FFN`).

Engine contract, per method (on top of :mod:`workers.engines.base`'s):

- ``start()``: loads the model side (only its own tensors), starts the thread. The
  attention engine then tries to pair: it connects to the FFN's endpoint (retrying,
  0.5 s per try); ``wait_paired(timeout)`` tells when it is.
- ``generate``: tokens in (``prompt_token_ids``), token ids and text out (the model
  folder's tokenizer decodes; stop strings are applied here, vLLM's way). Refused with
  EngineError naming the field: ``prompt + max_tokens`` beyond ``max_model_len``, a
  prompt longer than the step budget ``max_batch_tokens``, a prompt id outside the
  vocabulary, ``presence_penalty`` / ``frequency_penalty`` / ``repetition_penalty``
  other than their no-op values; the optional features (:attr:`serves`) are none.
  ``temperature`` unset is 1.0 (OpenAI's default); a sampled request without a seed
  gets a random one. While no FFN is paired a request is refused at once with
  :class:`AfdUnavailable` (an EngineUnavailableError: the worker answers UNAVAILABLE;
  the worker also leaves etcd meanwhile, :mod:`workers.engines.afd.worker`); when the
  FFN goes away mid-request (a transport error ends the step), every request of the
  step and every queued one ends with :class:`AfdUnavailable` naming the error, their
  KV freed, and the engine pairs again as soon as an FFN listens on the endpoint.
  Closing the iterator early aborts the request in the core (KV freed).
- ``abort(request_id)``: aborts (KV freed); False when unknown.
- ``load()``: running (admitted into the core), waiting (queued, not yet admitted),
  ``kv_usage`` = used KV token slots / capacity, ``kv_total_blocks`` = capacity /
  ``block_size``.
- ``counters()``: ``afd_steps``, ``afd_layer_messages``, ``afd_transport_errors``,
  ``afd_pairings`` (attention); ``afd_ffn_messages``, ``afd_ffn_batches``,
  ``afd_ffn_dropped`` (FFN).
- ``metrics_collector``: the :class:`~workers.engines.afd.observe.AfdMetrics` of the
  worker (the worker's ``/metrics`` serves it).
- ``wait_dead()``: returns when the engine thread died of an unexpected error.
- ``shutdown()``: stops the thread, closes the transport; idempotent.

Each request gets an ``afd.generate`` span (under the worker's gRPC span) with the AFD
times of the steps it took part in: ``kvmesh.afd.steps``, ``.attention_compute_s``,
``.transfer_s``, ``.wait_s``, ``.round_trip_s``, ``.overlap_ratio``, ``.tpot_s``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.telemetry import tracer
from workers.engines.afd.connector import (
    STAGE_FFN_OUTPUT,
    AfdConnector,
    AfdContext,
    AfdTimeout,
    AfdTransportConfig,
    AfdTransportError,
)
from workers.engines.afd.engine import AfdEngine, SplitExecutor, StepOutput
from workers.engines.afd.kv_cache import KvCache
from workers.engines.afd.observe import (
    AfdMetrics,
    TimedAttentionConnector,
    TimedFfnConnector,
    TimedFfnSide,
)
from workers.engines.afd.sampling import SamplingParams
from workers.engines.afd.textout import TextStream
from workers.engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineUnavailableError,
)

log = logging.getLogger(__name__)

TRANSPORTS = ("shm", "nixl")
_IDLE_POLL_S = 0.2  # the engine thread's wait for work (and its FFN liveness probe)


class AfdUnavailable(EngineUnavailableError):
    """No FFN worker is paired, or it went away mid-request (the message says which)."""


def endpoint_name(namespace: str, ffn_id: str) -> str:
    """The transport endpoint of FFN worker ``ffn_id`` in ``namespace`` (shm: the
    ``/dev/shm`` file and abstract socket name)."""
    return f"{namespace}.{ffn_id}"


@dataclass(frozen=True)
class AfdEngineConfig:
    """Settings shared by both roles (both sides of a pair need equal transport sizes)."""

    model_path: str
    model_name: str
    role: str  # attention | ffn
    endpoint: str  # the transport endpoint (endpoint_name)
    transport: str = "shm"
    attention_id: int = 0
    attention_workers: int = 1
    microbatches: int = 2
    max_batch_tokens: int = 512  # per step; the transport's slot rows
    max_model_len: int = 2048
    block_size: int = 32
    kv_cache_gib: float = 0.25
    threads: int = 1
    recv_timeout_s: float = 10.0
    ffn_id: str = ""

    def transport_config(self, hidden_size: int) -> AfdTransportConfig:
        return AfdTransportConfig(hidden_size, self.max_batch_tokens, self.microbatches,
                                  self.attention_workers)


def _kv_tokens(cfg: AfdEngineConfig, layers: int, kv_heads: int, head_dim: int) -> int:
    per_token = layers * kv_heads * head_dim * 2 * 4  # K and V, float32
    return max(cfg.max_model_len, min(int(cfg.kv_cache_gib * (1 << 30)) // per_token, 1 << 22))


def _info(cfg: AfdEngineConfig, max_model_len: int, layout: str) -> EngineInfo:
    return EngineInfo(engine="afd", model=cfg.model_name, model_path=cfg.model_path,
                      block_size=cfg.block_size, max_model_len=max_model_len,
                      kv_layout=layout)


def _connect_attention(cfg: AfdEngineConfig, tcfg: AfdTransportConfig) -> AfdConnector:
    """One try at the FFN's endpoint (AfdTimeout when nobody listens yet)."""
    if cfg.transport != "shm":
        raise ValueError(f"afd transport {cfg.transport!r} is not served by the worker")
    from workers.engines.afd.transport_local import ShmAttentionConnector

    return ShmAttentionConnector(cfg.endpoint, cfg.attention_id, tcfg, connect_timeout=0.5)


@dataclass
class _Stream:
    """One request's state on the asyncio side."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    totals: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    admitted: bool = False

    def put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))


class AfdAttentionEngine(Engine):
    """The attention worker's engine (module docstring)."""

    serves: frozenset[str] = frozenset()

    def __init__(self, config: AfdEngineConfig, worker_id: str = "") -> None:
        if config.role != "attention":
            raise ValueError("AfdAttentionEngine needs role attention")
        self.config = config
        self.metrics_collector = AfdMetrics(worker_id or config.model_name, "attention")
        self._info: EngineInfo | None = None
        self._core: AfdEngine | None = None
        self._tokenizer: Any = None
        self._tcfg: AfdTransportConfig | None = None
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread's view, by request id
        self._live: set[str] = set()  # asyncio side's view
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._conn: AfdConnector | None = None
        self._paired = threading.Event()
        self._pair_listeners: list[Callable[[bool], None]] = []
        self._dead: asyncio.Future[str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counts = collections.Counter[str]()
        self._last_error = ""
        self._tracer = tracer("worker")

    # --- Engine
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("engine not started")
        return self._info

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from workers.engines.afd.model import load_attention_side, load_config

        cfg = self.config
        torch.set_num_threads(cfg.threads)
        mcfg = load_config(cfg.model_path)
        attn = await asyncio.to_thread(load_attention_side, cfg.model_path, mcfg)
        self._tokenizer = await asyncio.to_thread(
            AutoTokenizer.from_pretrained, cfg.model_path, local_files_only=True)
        kv = KvCache(mcfg, _kv_tokens(cfg, mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim))
        self._tcfg = cfg.transport_config(mcfg.hidden_size)
        # The executor is replaced once paired; until then no step runs.
        self._core = AfdEngine(attn, kv, SplitExecutor(_NotPaired(), cfg.attention_id),
                               microbatches=cfg.microbatches,
                               max_batch_tokens=cfg.max_batch_tokens,
                               max_model_len=cfg.max_model_len)
        layout = (f"afd:llama:float32:l{mcfg.num_layers}:kvh{mcfg.num_kv_heads}:"
                  f"d{mcfg.head_dim}:h{mcfg.hidden_size}")
        self._info = _info(cfg, self._core.max_model_len, layout)
        self._loop = asyncio.get_running_loop()
        self._dead = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="afd-attention", daemon=True)
        self._thread.start()

    async def wait_paired(self, timeout_s: float) -> bool:
        """True once paired with an FFN worker (False when ``timeout_s`` passed)."""
        return await asyncio.to_thread(self._paired.wait, timeout_s)

    @property
    def paired(self) -> bool:
        return self._paired.is_set()

    def on_pairing(self, listener: Callable[[bool], None]) -> None:
        """``listener(paired)`` runs on the event loop at every pairing change."""
        self._pair_listeners.append(listener)

    def _check(self, request: EngineRequest) -> tuple[SamplingParams, torch.Generator | None]:
        core = self._core
        if core is None or self._stop.is_set():
            raise EngineError("the AFD engine is not running")
        s = request.sampling
        n = len(request.prompt_token_ids)
        if n + s.max_tokens > core.max_model_len:
            raise EngineError(f"prompt ({n} tokens) + max_tokens ({s.max_tokens}) = "
                              f"{n + s.max_tokens} exceeds max_model_len ({core.max_model_len})")
        if n > core.max_batch_tokens:
            raise EngineError(f"prompt ({n} tokens) exceeds the AFD step budget "
                              f"(--afd-max-batch-tokens {core.max_batch_tokens})")
        vocab = core.attn.config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"token_ids has ids outside the vocabulary [0, {vocab}): "
                              f"{bad[:5]}")
        for name, noop in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                           ("repetition_penalty", 1.0)):
            value = getattr(s, name)
            if value is not None and value != noop:
                raise EngineError(f"sampling.{name} is not served by engine afd")
        temperature = 1.0 if s.temperature is None else s.temperature
        params = SamplingParams(temperature=temperature,
                                top_p=1.0 if s.top_p is None else s.top_p,
                                top_k=max(0, s.top_k or 0), max_tokens=s.max_tokens,
                                stop_token_ids=tuple(s.stop_token_ids),
                                ignore_eos=s.ignore_eos)
        try:
            params.validate()
        except ValueError as exc:
            raise EngineError(f"sampling: {exc}") from exc
        gen = None
        if not params.greedy:
            seed = s.seed if s.seed is not None else random.SystemRandom().getrandbits(62)
            gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
        return params, gen

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True,
                                          clean_up_tokenization_spaces=False))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        params, gen = self._check(request)
        rid = request.request_id
        if rid in self._live:
            raise EngineError(f"request id {rid!r} is already running")
        if not self._paired.is_set():
            raise AfdUnavailable(f"no AFD FFN worker paired (endpoint {self.config.endpoint!r}"
                                 f"{': ' + self._last_error if self._last_error else ''})")
        assert self._loop is not None
        stream = _Stream(rid, self._loop)
        text = TextStream(self._decode, request.sampling.stop)
        ids: list[int] = []
        done = False
        t_start = time.perf_counter()
        t_first: float | None = None
        span = self._tracer.start_span("afd.generate", attributes={
            "kvmesh.request_id": rid, "kvmesh.afd.transport": self.config.transport,
            "kvmesh.afd.microbatches": self.config.microbatches,
            "kvmesh.afd.ffn_id": self.config.ffn_id})
        self._live.add(rid)
        self._cmds.put(("add", (stream, list(request.prompt_token_ids), params, gen)))
        try:
            while True:
                kind, value = await stream.items.get()
                if kind == "error":
                    if isinstance(value, ValueError):
                        raise EngineError(str(value))
                    raise AfdUnavailable(str(value))
                out: StepOutput = value
                assert out.token is not None
                ids.append(out.token)
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                delta, stopped = text.push(ids)
                finished = out.finished or stopped
                reason = "stop" if stopped else out.finish_reason
                if finished and not stopped:
                    delta += text.flush(ids)
                done = finished
                if finished and stopped and not out.finished:
                    self._cmds.put(("abort", rid))  # a stop string: free its KV now
                if finished and len(ids) > 1:
                    tpot = (now - t_first) / (len(ids) - 1)
                    self.metrics_collector.tpot.observe(tpot)
                    stream.totals["tpot_s"] = tpot
                yield EngineOutput(
                    token_ids=[out.token], text=delta, finished=finished,
                    finish_reason=reason if finished else None,
                    prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(ids),
                    queue_s=stream.totals.get("queue_s") if len(ids) == 1 else None)
                if finished:
                    return
        finally:
            self._live.discard(rid)
            if not done:
                self._cmds.put(("abort", rid))
            t = stream.totals
            rt = t.get("round_trip_s", 0.0)
            span.set_attributes({
                "kvmesh.afd.steps": int(t.get("steps", 0)),
                "kvmesh.afd.attention_compute_s": t.get("attention_compute_s", 0.0),
                "kvmesh.afd.transfer_s": t.get("transfer_s", 0.0),
                "kvmesh.afd.wait_s": t.get("wait_s", 0.0),
                "kvmesh.afd.round_trip_s": rt,
                "kvmesh.afd.overlap_ratio": (max(0.0, 1 - t.get("wait_s", 0.0) / rt)
                                             if rt > 0 else 0.0),
                "kvmesh.afd.tpot_s": t.get("tpot_s", 0.0),
                "kvmesh.afd.e2e_s": time.perf_counter() - t_start})
            span.end()

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._live:
            return False
        self._cmds.put(("abort", request_id))
        return True

    def load(self) -> EngineLoad:
        core = self._core
        if core is None:
            return EngineLoad()
        running = core.num_running
        return EngineLoad(num_running=running,
                          num_waiting=max(0, len(self._streams) - running),
                          kv_usage=core.kv.used_tokens / core.kv.max_tokens,
                          kv_total_blocks=core.kv.max_tokens // max(1, self.config.block_size))

    def counters(self) -> dict[str, int]:
        snap = self.metrics_collector.snapshot()
        return {"afd_steps": self._counts["steps"], "afd_layer_messages": snap.messages,
                "afd_transport_errors": self._counts["errors"],
                "afd_pairings": self._counts["pairings"]}

    async def wait_dead(self) -> str:
        if self._dead is None:
            return await super().wait_dead()
        return await asyncio.shield(self._dead)

    async def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None

    # --- the engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._loop_once()
        except BaseException as exc:  # noqa: BLE001 - reported through wait_dead
            log.exception("AFD engine thread died")
            self._fail_all(f"AFD engine thread died: {exc!r}")
            self._resolve_dead(f"AFD engine thread died: {exc!r}")
        finally:
            self._set_conn(None, "")

    def _loop_once(self) -> None:
        core = self._core
        assert core is not None
        self._drain(block=not (core.has_unfinished() and self._conn is not None))
        if self._conn is None:
            self._try_pair()
            return
        if not core.has_unfinished():
            self._probe()
            return
        stats = core.executor.stats
        before = (stats.attn_compute_s, self.metrics_collector.snapshot())
        outs = core.step()
        self._account(outs, before)
        errors = [o for o in outs if o.finish_reason == "error"]
        for o in outs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue
            if o.finish_reason == "error":
                self._streams.pop(o.request_id, None)
                stream.put("error", f"AFD FFN worker gone mid-request: {o.error}")
            else:
                stream.put("token", o)
                if o.finished:
                    self._streams.pop(o.request_id, None)
        if errors:
            self._counts["errors"] += 1
            self.metrics_collector.transport_errors.inc()
            self._lost(errors[0].error or "transport error")

    def _account(self, outs: list[StepOutput], before: tuple[float, Any]) -> None:
        """Adds the step's times to the metrics and to each request's span totals."""
        core = self._core
        assert core is not None
        self._counts["steps"] += 1
        attn = core.executor.stats.attn_compute_s - before[0]
        self.metrics_collector.add_compute(attn)
        now, prev = self.metrics_collector.snapshot(), before[1]
        delta = {"steps": 1, "attention_compute_s": attn,
                 "transfer_s": now.transfer_s - prev.transfer_s,
                 "wait_s": now.wait_s - prev.wait_s,
                 "round_trip_s": now.round_trip_s - prev.round_trip_s}
        for o in outs:
            stream = self._streams.get(o.request_id)
            if stream is not None:
                for k, v in delta.items():
                    stream.totals[k] += v

    def _drain(self, block: bool) -> None:
        t0 = time.perf_counter()
        try:
            cmd = self._cmds.get(timeout=_IDLE_POLL_S) if block else self._cmds.get_nowait()
        except queue.Empty:
            if block:
                self.metrics_collector.add_no_work(time.perf_counter() - t0)
            return
        if block:
            self.metrics_collector.add_no_work(time.perf_counter() - t0)
        while True:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple[str, Any]) -> None:
        core = self._core
        assert core is not None
        kind, value = cmd
        if kind == "add":
            stream, prompt, params, gen = value
            if self._conn is None:
                stream.put("error", f"no AFD FFN worker paired: {self._last_error}")
                return
            try:
                core.add_request(stream.request_id, prompt, params, gen)
            except ValueError as exc:
                stream.put("error", exc)
                return
            self._streams[stream.request_id] = stream
        elif kind == "abort":
            core.abort(value)
            self._streams.pop(value, None)

    def _try_pair(self) -> None:
        assert self._tcfg is not None
        try:
            conn = _connect_attention(self.config, self._tcfg)
        except AfdTimeout as exc:
            self._last_error = str(exc)
            return
        except (AfdTransportError, ValueError, OSError) as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            log.warning("AFD pairing with %s failed: %s", self.config.endpoint, exc)
            self._stop.wait(0.5)
            return
        timed = TimedAttentionConnector(conn, self.metrics_collector)
        assert self._core is not None
        self._core.set_executor(SplitExecutor(timed, self.config.attention_id,
                                              recv_timeout=self.config.recv_timeout_s))
        self._counts["pairings"] += 1
        self._set_conn(timed, "")
        log.info("AFD attention %d paired with the FFN at %s", self.config.attention_id,
                 self.config.endpoint)

    def _probe(self) -> None:
        """While idle: a zero-timeout receive tells whether the FFN is still there."""
        conn = self._conn
        assert conn is not None
        ctx = AfdContext(self.config.attention_id, 0, 0, STAGE_FFN_OUTPUT, 1 << 62, 0)
        try:
            conn.recv_ffn_output(ctx, 0.0)
        except AfdTimeout:
            return
        except AfdTransportError as exc:
            self._lost(f"{type(exc).__name__}: {exc}")

    def _lost(self, reason: str) -> None:
        log.warning("AFD FFN at %s lost: %s", self.config.endpoint, reason)
        self._set_conn(None, reason)
        self._fail_all(f"AFD FFN worker gone: {reason}")

    def _fail_all(self, reason: str) -> None:
        core = self._core
        for rid, stream in list(self._streams.items()):
            if core is not None:
                core.abort(rid)
            stream.put("error", reason)
        self._streams.clear()

    def _set_conn(self, conn: AfdConnector | None, reason: str) -> None:
        old, self._conn = self._conn, conn
        if old is not None and old is not conn:
            with contextlib.suppress(Exception):
                old.close()
        if conn is None:
            self._last_error = reason or self._last_error
            changed = self._paired.is_set()
            self._paired.clear()
        else:
            changed = not self._paired.is_set()
            self._paired.set()
        if changed and self._loop is not None:
            for listener in self._pair_listeners:
                with contextlib.suppress(RuntimeError):  # the loop closed
                    self._loop.call_soon_threadsafe(listener, conn is not None)

    def _resolve_dead(self, reason: str) -> None:
        loop, fut = self._loop, self._dead
        if loop is not None and fut is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, reason)


def _settle(fut: asyncio.Future[str], reason: str) -> None:
    if not fut.done():
        fut.set_result(reason)


class _NotPaired(AfdConnector):
    """The executor's connector before the first pairing (never used: no step runs)."""

    def send_attn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        raise AfdTimeout("no AFD FFN worker paired")

    def close(self) -> None:
        pass


class AfdFfnEngine(Engine):
    """The FFN worker's engine (module docstring): serves layer messages, no requests."""

    serves: frozenset[str] = frozenset()

    def __init__(self, config: AfdEngineConfig, worker_id: str = "") -> None:
        if config.role != "ffn":
            raise ValueError("AfdFfnEngine needs role ffn")
        self.config = config
        self.metrics_collector = AfdMetrics(worker_id or config.model_name, "ffn")
        self._info: EngineInfo | None = None
        self._server: Any = None
        self._conn: AfdConnector | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._dead: asyncio.Future[str] | None = None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("engine not started")
        return self._info

    async def start(self) -> None:
        from workers.engines.afd.ffn_server import FfnServer
        from workers.engines.afd.model import load_config, load_ffn_side

        cfg = self.config
        if cfg.transport != "shm":
            raise ValueError(f"afd transport {cfg.transport!r} is not served by the worker")
        from workers.engines.afd.transport_local import ShmFfnConnector

        torch.set_num_threads(cfg.threads)
        mcfg = load_config(cfg.model_path)
        ffn = await asyncio.to_thread(load_ffn_side, cfg.model_path, mcfg)
        self._conn = ShmFfnConnector(cfg.endpoint, cfg.transport_config(mcfg.hidden_size))
        timed = TimedFfnConnector(self._conn, self.metrics_collector)
        self._server = FfnServer(TimedFfnSide(ffn, timed), timed)
        self._info = _info(cfg, min(cfg.max_model_len, mcfg.max_position_embeddings),
                           f"afd-ffn:llama:float32:l{mcfg.num_layers}:h{mcfg.hidden_size}")
        loop = asyncio.get_running_loop()
        self._dead = loop.create_future()
        dead = self._dead

        def run() -> None:
            try:
                self._server.run(self._stop.is_set, poll_s=_IDLE_POLL_S)
            except BaseException as exc:  # noqa: BLE001 - reported through wait_dead
                log.exception("AFD FFN server died")
                reason = f"AFD FFN server died: {exc!r}"
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, dead, reason)

        self._thread = threading.Thread(target=run, name="afd-ffn", daemon=True)
        self._thread.start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        raise EngineError("this is an AFD FFN worker: it serves attention workers' layers, "
                          "not requests (send requests to an afd_attention worker)")
        yield EngineOutput()  # pragma: no cover - makes this an async generator

    async def abort(self, request_id: str) -> bool:
        return False

    def counters(self) -> dict[str, int]:
        stats = self._server.stats if self._server is not None else None
        if stats is None:
            return {}
        return {"afd_ffn_messages": stats.messages, "afd_ffn_batches": stats.batches,
                "afd_ffn_dropped": stats.dropped}

    async def wait_dead(self) -> str:
        if self._dead is None:
            return await super().wait_dead()
        return await asyncio.shield(self._dead)

    async def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def create_afd_engine(config: AfdEngineConfig, worker_id: str = "") -> Engine:
    """The engine of ``config.role``."""
    if config.role == "attention":
        return AfdAttentionEngine(config, worker_id)
    if config.role == "ffn":
        return AfdFfnEngine(config, worker_id)
    raise ValueError(f"afd role must be attention or ffn, got {config.role!r}")


class AfdEngineKind(Engine):
    """Registry entry for kind ``"afd"``: ``create_engine("afd", config=...)`` returns the
    role's engine (this class is never instantiated itself)."""

    def __new__(cls, config: AfdEngineConfig, worker_id: str = "") -> Any:  # type: ignore[misc]
        return create_afd_engine(config, worker_id)
