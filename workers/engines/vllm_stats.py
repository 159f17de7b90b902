"""vLLM stats for :class:`workers.engines.vllm_engine.VllmEngine`, kept as plain numbers.

Contract:

- :class:`StatsRecorder` is a per-engine vLLM stat logger (``AsyncLLM(stat_loggers=
  [recorder.factory])``). ``record()`` runs on the event loop thread with the
  ``SchedulerStats`` and ``IterationStats`` EngineCore attaches to each step's outputs
  (also steps without outputs). It keeps the latest load (running, waiting + deferred,
  KV usage) and cumulative counters: prefix-cache queries/hits (tokens), preemptions,
  the KV connector's queries/hits (``connector_prefix_cache_stats``), prompt tokens
  loaded by KV transfer (``PrefillStats.num_external_cached_tokens``) and NIXL
  transfers/bytes/failures (``kv_connector_stats``: ``NixlKVConnectorStats.data``; failed
  transfers, failed handshakes and expired leases count as failures).
"""

from __future__ import annotations

from typing import Any


class StatsRecorder:
    """A vLLM per-engine stat logger that keeps the latest SchedulerStats.

    Duck-types ``vllm.v1.metrics.loggers.StatLoggerBase`` so this module imports no
    vllm at load time; vLLM only calls ``record``, ``log``, ``log_engine_initialized``
    and ``record_sleep_state``. Runs on the event loop thread (AsyncLLM's output handler).
    """

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.connector_queries = 0
        self.connector_hits = 0
        self.external_kv_tokens = 0
        self.kv_transfers = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_failures = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> StatsRecorder:
        return self

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = (
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
            pcs = scheduler_stats.prefix_cache_stats
            if pcs is not None:
                self.prefix_queries += pcs.queries
                self.prefix_hits += pcs.hits
            if (cps := scheduler_stats.connector_prefix_cache_stats) is not None:
                self.connector_queries += cps.queries
                self.connector_hits += cps.hits
            self._record_transfers(scheduler_stats.kv_connector_stats or {})
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
            self.external_kv_tokens += iteration_stats.prompt_token_stats.external_kv_transfer

    def _record_transfers(self, data: dict[str, Any]) -> None:
        """NIXL's per-step ``NixlKVConnectorStats.data`` (lists of observations)."""
        sizes = data.get("bytes_transferred") or []
        self.kv_transfers += len(sizes)
        self.kv_transfer_bytes += int(sum(sizes))
        for key in ("num_failed_transfers", "num_failed_handshakes", "num_kv_expired_reqs"):
            self.kv_transfer_failures += len(data.get(key) or [])

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass
