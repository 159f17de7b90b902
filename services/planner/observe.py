"""What the planner reads from the live mesh, turned into the core's :class:`Observations`.

Contract:

- :func:`traffic_from_metrics` (pure) parses one frontend's Prometheus text exposition
  into cumulative :class:`TrafficCounters`: requests = ``kvmesh_requests_total`` summed
  over labels (demand, incl. rejected); finished = those with outcome stop or length (the
  requests whose tokens the token totals count); ISL/OSL token totals =
  ``kvmesh_prompt_tokens_total`` / ``kvmesh_completion_tokens_total`` (or the ``_sum``
  of histograms of those names);
  TTFT = ``kvmesh_ttft_seconds`` ``_sum``/``_count``; ITL = ``kvmesh_itl_seconds``
  ``_sum``/``_count``. Missing metrics count as 0.
- :class:`MeshObserver` follows the ``worker`` and ``frontend`` components in etcd
  (:class:`InstanceWatcher`). ``collect()`` asks every live worker for ``GetLoad``
  concurrently (a worker that does not answer within the timeout is still counted as
  ready, with ``reported=False``) and scrapes every frontend's ``/metrics`` (the address
  in its record's ``http`` label, or the fixed ``metrics_urls``). A frontend whose scrape
  fails contributes its last good counters, so a missed scrape does not look like a
  counter reset; frontends that left discovery stop contributing. Traffic is ``None``
  when no frontend was ever scraped. With an ``api_key`` every scrape sends
  ``Authorization: Bearer <key>`` (a frontend with ``--metrics-auth`` answers 401
  without one). A failing URL logs one warning when it starts failing (a 401 says which
  setting gives the key; the key is never logged) and one line when it recovers; the
  failures in between are only counted (:attr:`MeshObserver.scrape_failures`).
  ``transport`` replaces httpx's network transport (tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from protos import discovery_pb2, worker_pb2, worker_pb2_grpc
from services.common.discovery import InstanceWatcher
from services.common.grpc_client import ChannelPool
from services.common.tls import MeshTls
from services.planner.core import Observations, TrafficCounters, WorkerLoad

log = logging.getLogger(__name__)

ROLE_NAMES = {
    discovery_pb2.WORKER_ROLE_AGG: "agg",
    discovery_pb2.WORKER_ROLE_PREFILL: "prefill",
    discovery_pb2.WORKER_ROLE_DECODE: "decode",
}

_SAMPLES = {
    "kvmesh_requests_total": "requests",
    "kvmesh_prompt_tokens_total": "input_tokens",
    "kvmesh_prompt_tokens_sum": "input_tokens",
    "kvmesh_completion_tokens_total": "output_tokens",
    "kvmesh_completion_tokens_sum": "output_tokens",
    "kvmesh_ttft_seconds_sum": "ttft_sum_s",
    "kvmesh_ttft_seconds_count": "ttft_count",
    "kvmesh_itl_seconds_sum": "itl_sum_s",
    "kvmesh_itl_seconds_count": "itl_count",
}


def traffic_from_metrics(text: str) -> TrafficCounters:
    """One frontend's cumulative counters from its ``/metrics`` text."""
    acc = dict.fromkeys({*_SAMPLES.values(), "finished"}, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _SAMPLES.get(sample.name)
            if key is not None:
                acc[key] += float(sample.value)
            if (sample.name == "kvmesh_requests_total"
                    and sample.labels.get("outcome") in ("stop", "length")):
                acc["finished"] += float(sample.value)
    return TrafficCounters(**acc)


def add_traffic(items: Sequence[TrafficCounters]) -> TrafficCounters:
    """Field-wise sum."""
    return TrafficCounters(*(sum(getattr(t, f.name) for t in items)
                             for f in dataclasses.fields(TrafficCounters)))


@dataclass(frozen=True)
class Snapshot:
    """One collection: the core's observations plus the raw worker records."""

    observations: Observations
    records: dict[str, discovery_pb2.InstanceRecord]


class MeshObserver:
    """Reads workers' load and frontends' traffic; see the module docstring."""

    def __init__(self, etcd_endpoint: str, namespace: str, timeout_s: float = 2.0,
                 metrics_urls: Sequence[str] = (), tls: MeshTls | None = None,
                 api_key: str = "", transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._workers = InstanceWatcher(etcd_endpoint, namespace, "worker", tls=tls)
        self._frontends = InstanceWatcher(etcd_endpoint, namespace, "frontend", tls=tls)
        self._timeout = timeout_s
        self._fixed_urls = list(metrics_urls)
        self._pool = ChannelPool(tls, "worker")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(timeout=timeout_s, headers=headers, transport=transport)
        self._has_key = bool(api_key)
        self._last_traffic: dict[str, TrafficCounters] = {}
        self._failing: dict[str, int] = {}  # url → scrapes failed in a row
        self.scrape_failures = 0

    async def start(self) -> None:
        """Loads the first discovery snapshots."""
        await self._workers.start()
        await self._frontends.start()

    async def close(self) -> None:
        await self._workers.close()
        await self._frontends.close()
        await self._pool.close()
        await self._http.aclose()

    async def _load(self, rec: discovery_pb2.InstanceRecord) -> WorkerLoad:
        role = ROLE_NAMES.get(rec.role, "agg")
        stub = worker_pb2_grpc.WorkerStub(self._pool.get(rec.address))
        try:
            rep = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=self._timeout)
        except grpc.RpcError:
            return WorkerLoad(rec.instance_id, role, reported=False)
        return WorkerLoad(rec.instance_id, role, rep.num_running, rep.num_waiting,
                          rep.kv_usage, rep.active_requests)

    def metrics_urls(self) -> list[str]:
        """The frontends' ``/metrics`` URLs (fixed ones, else from discovery)."""
        if self._fixed_urls:
            return list(self._fixed_urls)
        out = []
        for rec in self._frontends.instances().values():
            if rec.http_address:
                out.append(f"http://{rec.http_address}/metrics")
        return sorted(out)

    async def _scrape(self, url: str) -> None:
        try:
            resp = await self._http.get(url)
            resp.raise_for_status()
            self._last_traffic[url] = traffic_from_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.scrape_failures += 1
            n = self._failing[url] = self._failing.get(url, 0) + 1
            if n > 1:
                return
            hint = ""
            if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
                hint = (" (the frontend's /metrics wants an API key: "
                        + ("the planner's was refused" if self._has_key else
                           "set --frontend-api-key / KVMESH_FRONTEND_API_KEY or "
                           "KVMESH_API_KEY") + ")")
            log.warning("scraping %s failed: %s%s; later failures in a row are only "
                        "counted", url, exc, hint)
            return
        n = self._failing.pop(url, 0)
        if n:
            log.info("scraping %s works again after %d failures", url, n)

    async def collect(self) -> Snapshot:
        """Workers' loads and the frontends' summed counters, now."""
        records = self._workers.instances()
        urls = self.metrics_urls()
        loads, _ = await asyncio.gather(
            asyncio.gather(*(self._load(r) for r in records.values())),
            asyncio.gather(*(self._scrape(u) for u in urls)))
        await self._pool.keep_only({r.address for r in records.values()})
        for gone in set(self._last_traffic) - set(urls):
            del self._last_traffic[gone]
        known = [self._last_traffic[u] for u in urls if u in self._last_traffic]
        traffic = add_traffic(known) if known else None
        return Snapshot(Observations(tuple(loads), traffic), records)
