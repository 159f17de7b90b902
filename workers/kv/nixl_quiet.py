"""vLLM's NIXL connectors with NIXL's progress thread off (loaded inside EngineCore), and
optional per-request stage timestamps of the P->D handoff.

Select with ``nixl_kv_transfer_config(..., progress_thread=False)``, which sets
``kv_connector_module_path`` to this module; vLLM then imports it in the EngineCore
process and takes the class named by ``kv_connector`` from here.

Why: vLLM builds its NIXL agent with ``nixl_agent_config(num_threads=4,
capture_telemetry=True)`` (``nixl/base_worker.py``), so NIXL's progress thread is on, and
NIXL's Python API fixes its poll delay at 0 (``nixl_cu12/_api.py``: ``pthrDelay = 0``):
``nixlUcxSharedThread::run`` spins on ``poll(timeout=0)`` and keeps one core busy per
idle engine (measured: ~80-100 % per P or D, ~1 % with the thread off). vLLM polls
transfers and notifications itself every engine step (and push mode's writer thread
polls too), so the handoff does not need the thread.

Contract:

- Importing this module wraps ``base_worker.nixl_agent_config`` (once per process) so
  every NIXL agent built afterwards in this process has ``enable_prog_thread=False``;
  nothing else changes.
- ``NixlConnector`` / ``NixlPullConnector`` / ``NixlPushConnector``: vLLM's classes, so
  ``kv_connector`` keeps vLLM's names. Without ``KVMESH_PD_STAMPS`` in the EngineCore's
  environment they behave exactly as vLLM's (every hook is a plain pass-through), but for
  one cap on the pull side:
- **D loads at most what P holds** (``NixlPullConnector.get_num_new_matched_tokens``):
  vLLM 0.32's D asks to load its whole prompt from P (``_get_remote_prefill_token_count``)
  and then recomputes the last token. When the frontend sends P's sampled token as the
  first token, D's prompt is P's prompt + that token, one longer than the KV P holds
  (``remote_num_tokens``); uncapped, D would READ a block P never filled (or one more
  block than P sent) and cache it. Capped at ``remote_num_tokens``, D loads exactly P's
  tokens and its first step computes the last prompt token (P's), sampling the second.
  When D's prompt is P's (``remote_num_tokens`` = its length) the cap changes nothing;
  without ``remote_num_tokens`` vLLM's count stands.
- **Stage stamps** (``KVMESH_PD_STAMPS=<folder>``, a benchmark's opt-in,
  :mod:`workers.kv.stamps`): each EngineCore process appends one JSON object per line to
  ``<folder>/stamps-<pid>.jsonl``:
  ``{"t": time.time(), "ev": ..., "req": vLLM request id or null, "pid": ...}`` plus
  event fields. Only requests that are part of a handoff are stamped: D's
  (``kv_transfer_params.do_remote_prefill``) and P's (``do_remote_decode``).

  Scheduler side (the hooks vLLM's scheduler calls, ``v1/core/sched/scheduler.py``):
  ``d_seen`` / ``p_seen`` (first ``get_num_new_matched_tokens``; ``arrival`` = the
  request's ``arrival_time``, set by vLLM's input processor when the serving process
  handed it to the engine), ``d_admitted`` (``update_state_after_alloc``: blocks
  allocated, ``external`` tokens to load), ``d_recv_reported`` (``update_connector_output``
  lists it in ``finished_recving``), ``d_first_step_scheduled`` (the first
  ``build_connector_meta`` after that whose ``SchedulerOutput`` schedules tokens of it:
  the recompute of the last prompt token), ``d_first_step_done`` (the next
  ``update_connector_output``, called at the end of that step's ``update_from_output``,
  after its sampled token became an output; exact with synchronous scheduling),
  ``d_finished`` / ``p_finished`` (``request_finished``).

  Worker side: ``w_start_load`` (the request is in ``start_load_kv``'s ``reqs_to_recv``),
  ``w_handshake_start`` / ``w_handshake_done`` (``_nixl_handshake`` with a P,
  ``engine`` = its id; first contact only), ``w_read_posted`` (``_read_blocks``
  returned), ``w_poll`` (each ``get_transfer_results`` while a stamped READ is pending;
  ``pending`` = the request ids), ``w_xfer`` (NIXL's telemetry of a finished transfer:
  ``xfer_us``, ``post_us``, ``bytes``), ``w_recv_done`` (``finished_recving`` lists it).
  The READ itself finished between the last ``w_poll`` that still listed the request
  and its ``w_recv_done``. The worker-side wraps are on private methods of vLLM 0.32's
  NIXL worker; each is skipped when the method is missing.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPullConnector as _VllmPull,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPushConnector as _VllmPush,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

from workers.kv.stamps import handoff_role, stamp_writer

_QUIET_MARK = "_kvmesh_quiet"


def _install() -> None:
    original = base_worker.nixl_agent_config
    if original is None or getattr(original, _QUIET_MARK, False):
        return  # NIXL missing (vLLM then fails on its own) or already installed

    def quiet_config(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return original(*args, **kwargs)

    setattr(quiet_config, _QUIET_MARK, True)
    base_worker.nixl_agent_config = quiet_config


_install()


class _Stamped:
    """Stage stamps around vLLM's connector hooks (see the module docstring); a mixin
    placed before vLLM's connector class."""

    connector_worker: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stamp = stamp_writer()
        self._roles: dict[str, str] = {}  # scheduler: stamped live requests
        self._recv_reported: set[str] = set()  # D: load done, first step not scheduled
        self._in_first_step: set[str] = set()  # D: first step scheduled, not done
        self._pending_reads: set[str] = set()  # worker: READ started, not reported
        if self._stamp is not None and self.connector_worker is not None:
            self._wrap_worker(self.connector_worker)

    # -- worker internals (vLLM 0.32, private) -------------------------------------
    def _wrap_worker(self, worker: Any) -> None:
        stamp = self._stamp
        assert stamp is not None
        read_blocks = getattr(worker, "_read_blocks", None)
        if read_blocks is not None:
            def _read_blocks(*args: Any, **kwargs: Any) -> Any:
                posted = read_blocks(*args, **kwargs)
                req = kwargs.get("request_id", args[2] if len(args) > 2 else None)
                stamp("w_read_posted", req, posted=bool(posted))
                return posted

            worker._read_blocks = _read_blocks
        handshake = getattr(worker, "_nixl_handshake", None)
        if handshake is not None:
            def _nixl_handshake(*args: Any, **kwargs: Any) -> Any:
                engine = kwargs.get("expected_engine_id", args[3] if len(args) > 3 else None)
                stamp("w_handshake_start", None, engine=engine)
                try:
                    return handshake(*args, **kwargs)
                finally:
                    stamp("w_handshake_done", None, engine=engine)

            worker._nixl_handshake = _nixl_handshake
        xfer_stats = getattr(worker, "xfer_stats", None)
        record = getattr(xfer_stats, "record_transfer", None)
        if xfer_stats is not None and record is not None:
            def _record_transfer(res: Any) -> Any:
                if res is not None:
                    stamp("w_xfer", None, xfer_us=getattr(res, "xferDuration", None),
                          post_us=getattr(res, "postDuration", None),
                          bytes=getattr(res, "totalBytes", None))
                return record(res)

            xfer_stats.record_transfer = _record_transfer

    # -- scheduler side --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        result = super().get_num_new_matched_tokens(  # type: ignore[misc]
            request, num_computed_tokens)
        if self._stamp is not None and request.request_id not in self._roles:
            role = handoff_role(getattr(request, "kv_transfer_params", None))
            if role is not None:
                self._roles[request.request_id] = role
                self._stamp(f"{role}_seen", request.request_id,
                            arrival=getattr(request, "arrival_time", None),
                            prompt_tokens=getattr(request, "num_prompt_tokens", None),
                            matched=result[0] if isinstance(result, tuple) else None)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> Any:
        out = super().update_state_after_alloc(  # type: ignore[misc]
            request, blocks, num_external_tokens)
        if self._stamp is not None and self._roles.get(request.request_id) == "d":
            self._stamp("d_admitted", request.request_id, external=num_external_tokens)
        return out

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        if self._stamp is not None and self._recv_reported:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            for req in [r for r in self._recv_reported if r in scheduled]:
                self._recv_reported.discard(req)
                self._in_first_step.add(req)
                self._stamp("d_first_step_scheduled", req, tokens=scheduled[req])
        return meta

    def update_connector_output(self, connector_output: Any) -> Any:
        out = super().update_connector_output(connector_output)  # type: ignore[misc]
        if self._stamp is not None:
            for req in self._in_first_step:
                self._stamp("d_first_step_done", req)
            self._in_first_step.clear()
            for req in connector_output.finished_recving or ():
                if self._roles.get(req) == "d":
                    self._recv_reported.add(req)
                    self._stamp("d_recv_reported", req)
        return out

    def _finished(self, request: Any) -> None:
        role = self._roles.pop(request.request_id, None)
        self._recv_reported.discard(request.request_id)
        self._in_first_step.discard(request.request_id)
        if self._stamp is not None and role is not None:
            self._stamp(f"{role}_finished", request.request_id)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        out = super().request_finished(request, block_ids)  # type: ignore[misc]
        self._finished(request)
        return out

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        out = super().request_finished_all_groups(request, block_ids)  # type: ignore[misc]
        self._finished(request)
        return out

    # -- worker side -----------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._stamp is not None:
            meta = getattr(self, "_connector_metadata", None)
            for req in getattr(meta, "reqs_to_recv", None) or {}:
                self._pending_reads.add(req)
                self._stamp("w_start_load", req)
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        res = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        if self._stamp is not None and self._pending_reads:
            done = set(res.finished_recving or ()) | set(res.failed_recving or ())
            still = self._pending_reads - done
            if still:
                self._stamp("w_poll", None, pending=sorted(still))
            for req in self._pending_reads & done:
                self._stamp("w_recv_done", req, failed=req in (res.failed_recving or ()))
            self._pending_reads = still
        return res


def capped_match(result: Any, params: Any, num_computed_tokens: int) -> Any:
    """vLLM's ``(count, async)`` for D, capped at the ``remote_num_tokens`` P holds (see
    the module docstring); any other result, or no cap to apply, is returned as it is."""
    if not params or not params.get("do_remote_prefill"):
        return result
    held = params.get("remote_num_tokens")
    if not isinstance(held, int) or held <= 0 or not isinstance(result, tuple):
        return result
    count, is_async = result
    if not isinstance(count, int) or count <= held - num_computed_tokens:
        return result
    left = held - num_computed_tokens
    return (left, is_async) if left > 0 else (0, False)


class NixlPullConnector(_Stamped, _VllmPull):
    """vLLM's pull (READ) connector; NIXL agent without progress thread; stage stamps;
    D loads at most the tokens P holds."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return capped_match(
            super().get_num_new_matched_tokens(request, num_computed_tokens),
            getattr(request, "kv_transfer_params", None), num_computed_tokens)


class NixlPushConnector(_Stamped, _VllmPush):
    """vLLM's push (WRITE) connector; NIXL agent without progress thread; stage stamps."""


NixlConnector = NixlPullConnector
