"""The SGLang engine: :class:`SglangEngine` drives a real SGLang 0.5.23 server, run as a
child process on loopback (its own venv, :mod:`workers.engines.sglang.server`), through
SGLang's native HTTP API.

Contract, method by method (see :mod:`workers.engines.base` for the interface):

- ``SglangEngine(config)``: stores a :class:`SglangEngineConfig`; touches nothing else.
- ``start()``: validates the config; RuntimeError when ``.sglvenv`` is missing
  (``make sglang``). Picks free loopback ports (HTTP; P: the bootstrap port), builds the
  command with :func:`~workers.engines.sglang.server.server_command` and starts it with
  :func:`services.common.procs.spawn` (the checkout first on ``PYTHONPATH``; its own
  process group, output to ``<log_dir>/sglang-<role>-<port>.log``, SIGTERM when this
  process dies). Then it polls
  ``GET /health`` until 200; the child exiting first, or ``start_timeout_s`` passing,
  raises RuntimeError with the tail of its log (the group is killed). Then it reads the
  KV capacity from ``GET /v1/loads`` and starts the load poller and the death watch.
- ``info``: ``EngineInfo("sglang", served name, model folder, page size, context length,
  kv_layout, handoff)``. ``kv_layout`` is :func:`sglang_kv_layout` (prefixed ``sglang|``,
  so never equal to a vLLM layout). ``handoff``: P ``{"mode": "sglang", "engine_id",
  "host", "port": bootstrap port, "tp_size": 1}``; D ``{"mode": "sglang", ...}`` with
  its own HTTP port (D has no bootstrap server; nobody connects to it); agg ``{}``.
- ``generate(request)``: checks the request first (:class:`EngineError`: empty prompt,
  prompt + max_tokens over the context, a duplicate live id, images, EC params, a
  ``seed`` with a non-greedy temperature, because SGLang applies per-request seeds only
  under ``--enable-deterministic-inference``; unserved optional features are refused by
  the worker servicer from :attr:`serves`). Then it streams ``POST /generate`` (``rid`` =
  the request id, ``input_ids``, :func:`sampling_params`, ``stream: true``,
  ``cache_salt``) and turns SGLang's events (cumulative ``output_ids`` and ``text``, or
  deltas when the server streams incrementally: :class:`StreamState` tells them apart)
  into :class:`EngineOutput` deltas with SGLang's ``prompt_tokens``,
  ``completion_tokens`` and ``cached_tokens``. Finish reasons: ``stop`` → "stop",
  ``length`` → "length", ``abort`` → "abort" when we aborted it; an abort we did not ask
  for is SGLang's refusal or failure: status 400 → :class:`EngineError`, on P/D →
  :class:`KvHandoffError` (the handoff failed: P or D gone, bootstrap or transfer
  timeout), else :class:`EngineUnavailableError`.
  **P/D (handoff mode "sglang", SGLang's bootstrap handshake)**: the frontend calls P and
  D at the same time (as in push mode) with the same request id; both derive the same
  ``bootstrap_room`` from it (:func:`bootstrap_room`). P's request carries its own
  bootstrap host/port; D's (``kv_transfer_params`` with ``do_remote_prefill``) carries P's
  from ``remote_host``/``remote_port`` (P's discovery record), its room from
  ``remote_request_id`` (else the request id). D streams every output token, the first
  one being the token P sampled (SGLang sends it with the KV). D's wait for P is bounded
  twice: SGLang's own (``SGLANG_DISAGGREGATION_*`` timeouts and heartbeat, set by
  :data:`DISAGG_ENV` unless the environment sets them) and ours: no first output within
  ``kv_handoff_timeout_s`` aborts the request and raises :class:`KvHandoffError` naming P.
  If the consumer stops early (``aclose()``, cancellation), ``POST /abort_request``
  (``rid``) is sent in the background and the HTTP stream is closed (SGLang aborts a
  request whose client went away too).
- ``abort(request_id)``: ``POST /abort_request`` for a live request; its stream ends with
  "abort". False for an unknown id.
- ``load()``: non-blocking: the last snapshot of ``GET /v1/loads`` (polled every
  ``load_poll_s`` in the background): ``num_running_reqs``; waiting = ``num_waiting_reqs``
  plus SGLang's disaggregation queues (bootstrap, in-flight, prealloc, transfer,
  retracted); ``token_usage``; ``kv_total_blocks`` = ``max_total_num_tokens`` / page.
- ``reset_prefix_cache()``: ``POST /flush_cache`` (SGLang refuses while requests run:
  False); SGLang then publishes AllBlocksCleared.
- ``wait_dead()``: the reason once the server process exits on its own (polled every
  :data:`DEATH_POLL_S`), its exit code and log tail; every live stream then fails with
  :class:`EngineDeadError`, as does every later ``generate``.
- ``shutdown()``: stops the pollers, closes the HTTP client, then SIGTERMs the child's
  process group by its pid (SIGKILL after :data:`STOP_GRACE_S`) and unlinks SGLang's
  ``/dev/shm`` load-snapshot files the group mapped (:func:`mapped_shm_files`; SGLang's
  own SIGKILL teardown leaves them). Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.common.periodic import Periodic
from services.common.procs import Child, free_port, spawn
from workers.engines.base import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineUnavailableError,
    KvHandoffError,
    Sampling,
)

log = logging.getLogger(__name__)

ROLES = ("agg", "prefill", "decode")
HANDOFF_MODE = "sglang"
# The optional sampling features mapped faithfully onto SGLang's sampling params.
SERVED = frozenset({"min_tokens", "min_p", "skip_special_tokens",
                    "spaces_between_special_tokens"})
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
DEATH_POLL_S = 0.5
STOP_GRACE_S = 10.0
# SGLang's own bounds on a P/D handoff (its defaults: 300 s waits, 5 s x 2 heartbeats).
DISAGG_ENV = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1.0",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3",
}
_REPO = Path(__file__).resolve().parents[3]


@dataclass
class SglangEngineConfig:
    """How to run the SGLang server (fields of :class:`~workers.engines.sglang.server.
    ServerSpec` plus what this adapter needs)."""

    model_path: str
    served_model_name: str | None = None  # default: the model folder's name
    role: str = "agg"
    page_size: int = 32  # = kvmesh's block size
    max_model_len: int = 0  # 0: the model's context length
    max_total_tokens: int = 0  # KV pool in tokens (0: SGLang's default)
    dtype: str = "float32"
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # HTTP (0: a free one)
    bootstrap_port: int = 0  # P: SGLang's bootstrap server (0: a free one)
    transfer_backend: str = "nixl"
    kv_events_endpoint: str = ""  # "" = no KV events (e.g. an EventEndpoints' ipc path)
    kv_events_replay_endpoint: str = ""
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # for the child, over DISAGG_ENV
    start_timeout_s: float = 900.0
    kv_handoff_timeout_s: float = 30.0  # D: longest wait for P's KV (its first output)
    load_poll_s: float = 0.5
    log_dir: str = ""  # "" = a fresh temporary folder
    repo_root: str = ""  # "" = this checkout

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    def validate(self) -> None:
        """Raise ValueError for a config this adapter cannot run."""
        if not Path(self.model_path, "config.json").is_file():
            raise ValueError(f"no model folder (config.json) at {self.model_path!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.max_model_len < 0 or self.max_total_tokens < 0:
            raise ValueError("max_model_len and max_total_tokens must be >= 0")
        if not self.kv_handoff_timeout_s > 0 or not self.start_timeout_s > 0:
            raise ValueError("kv_handoff_timeout_s and start_timeout_s must be positive")


def bootstrap_room(request_id: str) -> int:
    """SGLang's ``bootstrap_room`` of a request: the first 8 bytes of SHA-256 of its id,
    as a non-negative 63-bit int (P and D compute the same room independently)."""
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _model_config(model_path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(model_path, "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def sglang_kv_layout(model_path: str, dtype: str, page_size: int) -> str:
    """``sglang|arch|dtype|kv=<dtype>|mha|L<layers>|KVH<kv heads>|D<head size>|B<page>``
    from the model's config.json (the layout fields of :func:`workers.kv.layout.kv_layout`,
    prefixed with the engine: SGLang and vLLM KV pools are never interchangeable)."""
    cfg = _model_config(model_path)
    sub = cfg.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else cfg
    heads = int(text.get("num_attention_heads") or 1)
    head_dim = int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads))
    arch = (cfg.get("architectures") or ["?"])[0]
    return "|".join(["sglang", str(arch), dtype, f"kv={dtype}",
                     "mla" if text.get("kv_lora_rank") else "mha",
                     f"L{text.get('num_hidden_layers', '?')}",
                     f"KVH{text.get('num_key_value_heads', heads)}", f"D{head_dim}",
                     f"B{page_size}"])


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 2}


def kv_pool_tokens(model_path: str, dtype: str, gib: float) -> int:
    """Tokens a KV pool of ``gib`` GiB holds for the model (K and V of every layer and KV
    head, ``dtype``): SGLang's ``--max-total-tokens`` for kvmesh's ``--kv-cache-gib``;
    0 (SGLang's default) when the model's config lacks the sizes."""
    cfg = _model_config(model_path)
    sub = cfg.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else cfg
    try:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
    per_token = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)
    return int(gib * (1 << 30)) // per_token


def sampling_params(s: Sampling) -> dict[str, Any]:
    """SGLang's ``sampling_params`` of a :class:`Sampling` (only fields it sets; None
    fields take SGLang's defaults). top_k 0 ("no limit") is SGLang's -1; ``seed`` is
    ``sampling_seed`` (checked by :func:`check_request`)."""
    out: dict[str, Any] = {"max_new_tokens": s.max_tokens}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                         ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty"),
                         ("repetition_penalty", "repetition_penalty"), ("min_p", "min_p")):
        value = getattr(s, ours)
        if value is not None:
            out[theirs] = value
    if s.top_k is not None:
        out["top_k"] = -1 if s.top_k <= 0 else s.top_k
    if s.seed is not None and s.seed != -1:
        out["sampling_seed"] = s.seed
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        out["ignore_eos"] = True
    if s.min_tokens:
        out["min_new_tokens"] = s.min_tokens
    if not s.skip_special_tokens:
        out["skip_special_tokens"] = False
    if not s.spaces_between_special_tokens:
        out["spaces_between_special_tokens"] = False
    return out


def check_request(request: EngineRequest, max_model_len: int, role: str) -> None:
    """Raises :class:`EngineError` for what this engine refuses (module docstring)."""
    n = len(request.prompt_token_ids)
    s = request.sampling
    if n == 0:
        raise EngineError("the prompt is empty")
    if s.max_tokens < 1:
        raise EngineError(f"max_tokens must be at least 1, got {s.max_tokens}")
    if max_model_len and n + s.max_tokens > max_model_len:
        raise EngineError(f"prompt ({n} tokens) + max_tokens ({s.max_tokens}) = "
                          f"{n + s.max_tokens} exceeds max_model_len ({max_model_len})")
    if request.images or request.image_uuids:
        raise EngineError("images are not served by the sglang engine (text only)")
    if request.ec_transfer_params:
        raise EngineError("ec_transfer_params are not served by the sglang engine")
    if s.seed is not None and s.seed != -1 and s.temperature != 0:
        raise EngineError("sampling.seed is not served by the sglang engine: SGLang applies "
                          "per-request seeds only under --enable-deterministic-inference")
    kv = request.kv_transfer_params or {}
    if kv.get("do_remote_prefill") and role != "decode":
        raise EngineError(f"kv_transfer_params['do_remote_prefill'] on a {role} worker")
    if kv.get("do_remote_decode") and role != "prefill":
        raise EngineError(f"kv_transfer_params['do_remote_decode'] on a {role} worker")
    if role == "decode" and not kv.get("do_remote_prefill"):
        raise EngineError("an SGLang decode worker cannot prefill locally: the request "
                          "needs kv_transfer_params with do_remote_prefill (P's bootstrap)")
    if role == "decode":
        for key in ("remote_host", "remote_port"):
            if not kv.get(key):
                raise EngineError(f"kv_transfer_params[{key!r}]: required (P's bootstrap "
                                  "server) with do_remote_prefill on an sglang engine")


def request_body(request: EngineRequest, role: str, bootstrap: tuple[str, int] | None
                 ) -> dict[str, Any]:
    """The ``POST /generate`` body; ``bootstrap``: P's own (P) or None (D reads P's from
    ``kv_transfer_params``; agg has none)."""
    body: dict[str, Any] = {"rid": request.request_id,
                            "input_ids": list(request.prompt_token_ids),
                            "sampling_params": sampling_params(request.sampling),
                            "stream": True}
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    kv = request.kv_transfer_params or {}
    if role == "prefill":
        assert bootstrap is not None
        body.update(bootstrap_host=bootstrap[0], bootstrap_port=bootstrap[1],
                    bootstrap_room=bootstrap_room(request.request_id))
    elif role == "decode":
        room_of = str(kv.get("remote_request_id") or request.request_id)
        body.update(bootstrap_host=str(kv["remote_host"]),
                    bootstrap_port=int(kv["remote_port"]),
                    bootstrap_room=bootstrap_room(room_of))
    return body


class StreamState:
    """Turns one request's SGLang stream events into :class:`EngineOutput` deltas.

    SGLang streams cumulative ``output_ids`` and ``text`` by default and deltas with
    ``--incremental-streaming-output``; an event whose ``output_ids`` are as many as its
    ``meta_info.completion_tokens`` is cumulative (the first event of a delta stream is
    both). A cumulative text that does not extend the text so far (a stop string trimmed
    at the end) adds no text."""

    def __init__(self, n_prompt: int) -> None:
        self.n_prompt = n_prompt
        self.ids = 0
        self.text = ""

    def delta(self, event: Mapping[str, Any]) -> EngineOutput:
        meta = event.get("meta_info") or {}
        ids = [int(t) for t in event.get("output_ids") or ()]
        completion = int(meta.get("completion_tokens", len(ids)))
        cumulative = len(ids) == completion and len(ids) >= self.ids
        new = ids[self.ids:] if cumulative else ids
        self.ids += len(new)
        text = event.get("text")
        piece = ""
        if isinstance(text, str):
            if not cumulative:
                piece, self.text = text, self.text + text
            elif text.startswith(self.text):
                piece, self.text = text[len(self.text):], text
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, Mapping) else reason
        finished = reason is not None
        return EngineOutput(
            token_ids=new, text=piece, finished=finished,
            finish_reason=_FINISH.get(str(kind), "abort") if finished else None,
            prompt_tokens=int(meta.get("prompt_tokens", self.n_prompt)),
            completion_tokens=self.ids, cached_tokens=int(meta.get("cached_tokens") or 0))


def abort_message(event: Mapping[str, Any]) -> tuple[int | None, str]:
    """(status code, message) of an SGLang abort finish reason or error event."""
    err = event.get("error")
    if isinstance(err, Mapping):
        code = err.get("code")
        return (int(code) if isinstance(code, int) else None), str(err.get("message", err))
    reason = (event.get("meta_info") or {}).get("finish_reason")
    if isinstance(reason, Mapping):
        code = reason.get("status_code")
        return (int(code) if isinstance(code, int) else None), str(
            reason.get("message") or reason)
    return None, str(reason)


def load_of(body: Mapping[str, Any], page_size: int) -> EngineLoad:
    """An :class:`EngineLoad` of a ``GET /v1/loads`` answer (summed over DP ranks)."""
    running = waiting = total = 0
    usage = 0.0
    loads = body.get("loads") or ()
    for rank in loads:
        running += int(rank.get("num_running_reqs") or 0)
        waiting += int(rank.get("num_waiting_reqs") or 0)
        disagg = rank.get("disaggregation") or {}
        if isinstance(disagg, Mapping):
            waiting += sum(int(disagg.get(k) or 0) for k in (
                "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
                "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs",
                "decode_retracted_queue_reqs"))
        usage = max(usage, float(rank.get("token_usage") or 0.0))
        total += int(rank.get("max_total_num_tokens") or 0)
    return EngineLoad(num_running=running, num_waiting=waiting,
                      kv_usage=min(max(usage, 0.0), 1.0), kv_total_blocks=total // page_size)


class SglangEngine(Engine):
    """A child SGLang server; see the module docstring for each method's contract."""

    serves = SERVED

    def __init__(self, config: SglangEngineConfig) -> None:
        self.config = config
        self._child: Child | None = None
        self._shm_files: set[str] = set()  # SGLang's load-snapshot files (see _kill)
        self._client: httpx.AsyncClient | None = None
        self._info: EngineInfo | None = None
        self._load = EngineLoad()
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self._bootstrap: tuple[str, int] | None = None
        self._dead: asyncio.Future[str] | None = None
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._handoff_timeouts = 0
        self._watch = Periodic("sglang-death-watch", self._check_alive, DEATH_POLL_S,
                               delay_first=True)
        self._poller = Periodic("sglang-load", self._poll_load, config.load_poll_s,
                                delay_first=True)
        self.start_seconds: float | None = None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("SglangEngine.info before start()")
        return self._info

    @property
    def log_path(self) -> Path | None:
        """The server's log file (None before start)."""
        return self._child.log_path if self._child is not None else None

    def server_spec(self, port: int, bootstrap_port: int) -> Any:
        """A's :class:`~workers.engines.sglang.server.ServerSpec` of this config."""
        from workers.engines.sglang.server import ServerSpec

        c = self.config
        extra = tuple(c.extra_args)
        if "--dtype" not in extra:
            extra = ("--dtype", c.dtype, *extra)
        return ServerSpec(
            model_path=c.model_path, port=port, role=c.role, page_size=c.page_size,
            host=c.host, seed=c.seed, context_length=c.max_model_len,
            max_total_tokens=c.max_total_tokens, bootstrap_port=bootstrap_port,
            transfer_backend=c.transfer_backend, kv_events_endpoint=c.kv_events_endpoint,
            kv_events_replay_endpoint=c.kv_events_replay_endpoint, extra_args=extra)

    async def start(self) -> None:
        if self._child is not None:
            raise RuntimeError("SglangEngine.start() called twice")
        if self._closed:
            raise RuntimeError("SglangEngine.start() after shutdown()")
        from workers.engines.sglang.server import server_command, sglang_python

        c = self.config
        c.validate()
        repo = Path(c.repo_root) if c.repo_root else _REPO
        if sglang_python(repo) is None:
            raise RuntimeError("SGLang is not installed: no working .sglvenv (run "
                               "`make sglang`, or set KVMESH_SGLANG_VENV)")
        self._dead = asyncio.get_running_loop().create_future()
        port = c.port or free_port()
        bport = (c.bootstrap_port or free_port()) if c.role == "prefill" else 0
        argv, env_add = server_command(self.server_spec(port, bport), repo)
        env = {**os.environ, **DISAGG_ENV, **env_add, **c.env}
        for key in DISAGG_ENV:  # the operator's environment wins over our defaults
            if key in os.environ and key not in c.env:
                env[key] = os.environ[key]
        # spawn() keeps our cwd: the launcher module is found through the path instead
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH"))
                                            if p)
        log_dir = Path(c.log_dir or tempfile.mkdtemp(prefix="kvmesh-sglang-"))
        t0 = time.monotonic()
        self._child = spawn(f"sglang-{c.role}-{port}", argv, log_dir, env)
        log.info("SGLang %s server pid %d on %s:%d, log %s", c.role, self._child.pid,
                 c.host, port, self._child.log_path)
        self._client = httpx.AsyncClient(base_url=f"http://{c.host}:{port}", trust_env=False,
                                         timeout=httpx.Timeout(30.0, read=None))
        try:
            await self._wait_healthy(t0 + c.start_timeout_s)
            self._shm_files |= mapped_shm_files(self._child.pid)
            self._load = load_of(await self._get_json("/v1/loads"), c.page_size)
        except BaseException:
            await self._kill()
            raise
        self.start_seconds = time.monotonic() - t0
        if c.role == "prefill":
            self._bootstrap = (c.host, bport)
        self._info = EngineInfo(
            engine="sglang", model=c.model_name, model_path=c.model_path,
            block_size=c.page_size, max_model_len=c.max_model_len or int(
                _model_config(c.model_path).get("max_position_embeddings") or 0),
            kv_layout=sglang_kv_layout(c.model_path, c.dtype, c.page_size),
            handoff=self._handoff(port, bport))
        self._watch.start()
        self._poller.start()
        log.info("SGLang engine ready in %.1fs: %s, %d KV blocks", self.start_seconds,
                 self._info, self._load.kv_total_blocks)

    def _handoff(self, port: int, bport: int) -> dict[str, Any]:
        c = self.config
        if c.role == "agg":
            return {}
        return {"mode": HANDOFF_MODE, "engine_id": f"sglang-{c.role}-{c.host}:{port}",
                "host": c.host, "port": bport if c.role == "prefill" else port,
                "tp_size": 1}

    def _tail(self) -> str:
        return self._child.log_tail(40) if self._child is not None else ""

    async def _wait_healthy(self, deadline: float) -> None:
        assert self._child is not None and self._client is not None
        while True:
            code = self._child.proc.poll()
            if code is not None:
                raise RuntimeError(f"the SGLang server exited with code {code} while "
                                   f"starting; its log ({self._child.log_path}) ends:\n"
                                   f"{self._tail()}")
            with contextlib.suppress(httpx.HTTPError):
                resp = await self._client.get("/health", timeout=10.0)
                if resp.status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the SGLang server did not become healthy within "
                                   f"{self.config.start_timeout_s}s; its log ends:\n"
                                   f"{self._tail()}")
            await asyncio.sleep(0.5)  # polling the child's health

    async def _get_json(self, path: str) -> Any:
        assert self._client is not None
        resp = await self._client.get(path, timeout=10.0)
        resp.raise_for_status()
        return resp.json()

    async def _poll_load(self) -> None:
        if self._client is None or self._is_dead():
            return
        self._load = load_of(await self._get_json("/v1/loads"), self.config.page_size)

    def _is_dead(self) -> bool:
        return self._dead is not None and self._dead.done()

    async def _check_alive(self) -> None:
        child = self._child
        if child is None or self._closed or self._dead is None or self._dead.done():
            return
        code = child.proc.poll()
        if code is not None:
            reason = f"the SGLang server (pid {child.pid}) exited with code {code}"
            log.error("%s; its log ends:\n%s", reason, self._tail())
            self._dead.set_result(reason)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)  # its scheduler processes too

    async def wait_dead(self) -> str:
        if self._dead is None:
            raise RuntimeError("SglangEngine.wait_dead() before start()")
        return await asyncio.shield(self._dead)

    def load(self) -> EngineLoad:
        return self._load

    def counters(self) -> dict[str, int]:
        return {"kv_handoff_timeouts": self._handoff_timeouts}

    async def reset_prefix_cache(self) -> bool:
        if self._client is None or self._is_dead():
            return False
        try:
            resp = await self._client.post("/flush_cache", timeout=30.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._live:
            return False
        self._aborted.add(request_id)
        await self._post_abort(request_id)
        return True

    async def _post_abort(self, request_id: str) -> None:
        if self._client is None or self._is_dead():
            return
        try:
            await self._client.post("/abort_request", json={"rid": request_id},
                                    timeout=10.0)
        except httpx.HTTPError as exc:
            log.warning("could not abort %s on SGLang: %r", request_id, exc)

    def _abort_later(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._post_abort(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _failure(self, request: EngineRequest, event: Mapping[str, Any]) -> Exception:
        """The error of an abort or error event we did not ask for."""
        code, message = abort_message(event)
        role = self.config.role
        if code == 400:
            return EngineError(f"SGLang refused the request: {message}")
        if role in ("prefill", "decode"):
            kv = request.kv_transfer_params or {}
            peer = (f"P at {kv.get('remote_host')}:{kv.get('remote_port')}"
                    if role == "decode" else "its decode worker")
            return KvHandoffError(f"KV handoff of {request.request_id!r} failed on the "
                                  f"SGLang {role} worker ({peer}): {message}")
        return EngineUnavailableError(f"SGLang aborted {request.request_id!r}: {message}")

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._client is None or self._info is None:
            raise RuntimeError("SglangEngine used before start() or after shutdown()")
        if self._dead is not None and self._dead.done():
            raise EngineDeadError(self._dead.result())
        role = self.config.role
        check_request(request, self._info.max_model_len, role)
        rid = request.request_id
        if rid in self._live:
            raise EngineError(f"request id {rid!r} is already running")
        body = request_body(request, role, self._bootstrap)
        remote = role == "decode"
        state = StreamState(len(request.prompt_token_ids))
        finished = False
        self._live.add(rid)
        bound: asyncio.Timeout | None = None
        try:
            # D: bounded until P's KV came (its first token). Nothing is yielded while
            # the bound is armed, so it can only ever cancel our own HTTP read.
            async with asyncio.timeout(self.config.kv_handoff_timeout_s if remote
                                       else None) as bound:
                async with self._client.stream("POST", "/generate", json=body) as resp:
                    if resp.status_code != 200:
                        detail = (await resp.aread()).decode(errors="replace")[:2000]
                        if resp.status_code == 400:
                            raise EngineError(f"SGLang refused the request: {detail}")
                        raise EngineUnavailableError(f"SGLang answered HTTP "
                                                     f"{resp.status_code}: {detail}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        event = json.loads(data)
                        if "error" in event:
                            raise self._failure(request, event)
                        out = state.delta(event)
                        if out.finished and out.finish_reason == "abort" and \
                                rid not in self._aborted:
                            raise self._failure(request, event)
                        if not (out.token_ids or out.finished):
                            continue  # nothing new (e.g. before the first token)
                        bound.reschedule(None)  # P's KV came: no more bound
                        yield out
                        if out.finished:
                            finished = True
                            return
            raise self._ended_early(rid)
        except TimeoutError:
            if bound is None or not bound.expired():
                raise
            self._handoff_timeouts += 1
            kv = request.kv_transfer_params or {}
            raise KvHandoffError(
                f"KV handoff timed out: remote prefill of {rid!r} from P at "
                f"{kv.get('remote_host')}:{kv.get('remote_port')} sent nothing within "
                f"{self.config.kv_handoff_timeout_s} s") from None
        except httpx.HTTPError as exc:
            if self._child is not None and self._child.proc.poll() is not None:
                await self._check_alive()
            if self._dead is not None and self._dead.done():
                raise EngineDeadError(self._dead.result()) from exc
            raise EngineUnavailableError(f"SGLang request {rid!r} failed: {exc!r}") from exc
        finally:
            self._live.discard(rid)
            self._aborted.discard(rid)
            if not finished and not self._closed:
                self._abort_later(rid)  # consumer gone, timeout or failure: free it

    def _ended_early(self, rid: str) -> Exception:
        if self._child is not None and self._child.proc.poll() is not None:
            return EngineDeadError(f"the SGLang server exited with code "
                                   f"{self._child.proc.returncode} during {rid!r}")
        return EngineUnavailableError(f"SGLang's stream of {rid!r} ended without finishing")

    async def _kill(self) -> None:
        child = self._child
        if child is None:
            return
        self._shm_files |= mapped_shm_files(child.pid)
        await asyncio.to_thread(_stop_group, child)
        for path in self._shm_files:  # SGLang's SIGKILL teardown skips the unlink
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._watch.stop()
        await self._poller.stop()
        for task in list(self._tasks):
            task.cancel()
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
        await self._kill()


SHM_PREFIX = "/dev/shm/sglang_loads_"


def mapped_shm_files(pgid: int) -> set[str]:
    """The SGLang load-snapshot files (``/dev/shm/sglang_loads_*``, one per server) that
    the processes of group ``pgid`` map now, from ``/proc/<pid>/maps``. SGLang tears its
    processes down with SIGKILL, which skips their unlink, so the engine unlinks them after
    stopping the group (each is named after the server's own IPC socket: no other server
    shares it)."""
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid pgrp ...: comm may hold spaces, split after ')'
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(SHM_PREFIX):
                        found.add(parts[5].rstrip("\n"))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _stop_group(child: Child) -> None:
    """SIGTERM to the child's process group (its pid), SIGKILL after STOP_GRACE_S; the
    group is signalled even when the leader is gone (SGLang's scheduler processes)."""
    pgid = child.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    with contextlib.suppress(Exception):
        child.proc.wait(STOP_GRACE_S)
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        child.proc.wait(5)
