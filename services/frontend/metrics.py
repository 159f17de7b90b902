"""The frontend's Prometheus metrics (served at ``GET /metrics``).

One registry per frontend (several frontends may share a process in tests). Contract:
each ``observe_*`` call records one event; names follow ``kvmesh_<what>_<unit>``.

| metric | meaning |
|---|---|
| ``kvmesh_requests_total{path,outcome}`` | requests by path (agg, disagg; ``none`` when \
rejected or never routed) and outcome (the finish reason; ``rejected``: admission control; \
``cancelled``: the client went away first; ``error``: it got an error) |
| ``kvmesh_frontend_migrations_total{stage}`` | requests moved to another worker after a \
worker failure, by the failed stage (agg, prefill, decode, timeout) |
| ``kvmesh_admission_rejections_total{reason}`` | admission rejections by reason |
| ``kvmesh_frontend_encodes_total{outcome}`` | images sent to an encoder (EPD), by outcome \
(``hit``: from its embedding cache, ``miss``: encoded) |
| ``kvmesh_frontend_encode_fallbacks_total{reason}`` | requests whose images the LM worker \
encoded itself, by reason (``no_encoder``, ``not_ec_consumer``, or the encoder's \
failure: ``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ...) |
| ``kvmesh_frontend_encode_seconds`` | the Encode call (queue, encode and cache lookups) |
| ``kvmesh_frontend_remote_image_fetches_total{outcome}`` | remote image URLs fetched \
(``--allow-remote-images``), by outcome (``ok``, ``too_large``, ``timeout``, \
``http_status``, ``unreachable``, ``redirect``, ``content_type``) |
| ``kvmesh_frontend_remote_image_fetch_seconds`` | one remote image fetch, any outcome |
| ``kvmesh_frontend_auth_failures_total{api}`` | requests refused for a missing or bad API \
key (401 / UNAUTHENTICATED), by API (http, grpc) |
| ``kvmesh_prompt_tokens_total`` | prompt tokens (usage) of finished requests |
| ``kvmesh_completion_tokens_total`` | completion tokens (usage) of finished requests |
| ``kvmesh_itl_seconds`` | chunk gap / tokens in the chunk, one sample per token |
| ``kvmesh_ttft_seconds{path}`` | time to first token seen by the frontend |
| ``kvmesh_prefill_seconds{mode}`` | the remote prefill call on P |
| ``kvmesh_kv_transfer_seconds{mode}`` | D call until its first token (READ/WRITE + D's step) |
| ``kvmesh_kv_transfer_blocks_total{mode}`` | blocks P held for D |
| ``kvmesh_prefill_hit_tokens_total`` / ``kvmesh_decode_hit_tokens_total`` | prefix hits on P / D |
| ``kvmesh_predicted_overlap_tokens_total`` | overlap the router predicted |
| ``kvmesh_actual_cached_tokens_total`` | tokens the engine actually reused |
| ``kvmesh_frontend_predicted_cached_tokens{path,source}`` | router's prediction, per request |
| ``kvmesh_frontend_actual_cached_tokens{path,source}`` | engine's ``cached_tokens``, per request |
| ``kvmesh_frontend_cached_tokens_abs_error{path,source}`` | ``|predicted − actual|`` |
| ``kvmesh_gc_*``, ``python_gc_*`` | the process's garbage collector \
(:func:`~services.common.gc_heap.register_gc_metrics`) |

The prediction is blocks · block_size on the worker whose hits the client's
``cached_tokens`` counts (P when disaggregated, else the worker); ``source`` is where it
came from (``indexer`` or ``history``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.common.gc_heap import register_gc_metrics

_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25,
                0.5, 1, 2.5)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def observe_many(hist: Histogram, amount: float, n: int) -> None:
    """Records ``n`` observations of ``amount`` at once: what ``n`` calls of
    ``hist.observe(amount)`` record (the bucket and count grow by ``n``, the sum by
    ``amount · n``), with one lock per series instead of ``2n`` (a whole answer's ITL is
    one gap spread over all its tokens)."""
    if n <= 0:
        return
    hist._raise_if_not_observable()
    hist._sum.inc(amount * n)
    for i, bound in enumerate(hist._upper_bounds):
        if amount <= bound:
            hist._buckets[i].inc(n)
            break


class FrontendMetrics:
    """Counters and histograms of one frontend."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry = CollectorRegistry()
        register_gc_metrics(r)
        self.requests = Counter("kvmesh_requests", "Requests by path and outcome",
                                ["path", "outcome"], registry=r)
        self.rejections = Counter("kvmesh_admission_rejections",
                                  "Requests rejected by admission control", ["reason"],
                                  registry=r)
        self.auth_failures = Counter("kvmesh_frontend_auth_failures",
                                     "Requests refused for a missing or bad API key, by API",
                                     ["api"], registry=r)
        self.encodes = Counter("kvmesh_frontend_encodes", "Images sent to an encoder, by "
                               "outcome (hit, miss)", ["outcome"], registry=r)
        self.encode_fallbacks = Counter("kvmesh_frontend_encode_fallbacks",
                                        "Requests whose images the worker encoded itself, "
                                        "by reason", ["reason"], registry=r)
        self.encode_seconds = Histogram("kvmesh_frontend_encode_seconds",
                                        "The encoder's Encode call", buckets=_BUCKETS,
                                        registry=r)
        self.remote_fetches = Counter("kvmesh_frontend_remote_image_fetches",
                                      "Remote image URLs fetched, by outcome", ["outcome"],
                                      registry=r)
        self.remote_fetch_seconds = Histogram("kvmesh_frontend_remote_image_fetch_seconds",
                                              "One remote image fetch", buckets=_BUCKETS,
                                              registry=r)
        self.migrations = Counter("kvmesh_frontend_migrations",
                                  "Requests migrated after a worker failure, by stage",
                                  ["stage"], registry=r)
        self.prompt_tokens = Counter("kvmesh_prompt_tokens",
                                     "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("kvmesh_completion_tokens",
                                         "Completion tokens of finished requests", registry=r)
        self.itl = Histogram("kvmesh_itl_seconds",
                             "Inter-token latency (chunk gap / tokens in the chunk)",
                             buckets=_ITL_BUCKETS, registry=r)
        self.ttft = Histogram("kvmesh_ttft_seconds", "Time to first token", ["path"],
                              buckets=_BUCKETS, registry=r)
        self.prefill = Histogram("kvmesh_prefill_seconds", "Remote prefill on P", ["mode"],
                                 buckets=_BUCKETS, registry=r)
        self.transfer = Histogram("kvmesh_kv_transfer_seconds",
                                  "D call until its first token", ["mode"], buckets=_BUCKETS,
                                  registry=r)
        self.first_token = Counter("kvmesh_pd_first_token",
                                   "Pull-mode disaggregated requests by the worker whose "
                                   "token went out first: prefill (P's sampled token) or "
                                   "decode (D recomputed it)", ["source"], registry=r)
        self.blocks = Counter("kvmesh_kv_transfer_blocks", "Blocks P held for D", ["mode"],
                              registry=r)
        self.p_hit = Counter("kvmesh_prefill_hit_tokens", "Prefix-cache hits on P",
                             registry=r)
        self.d_hit = Counter("kvmesh_decode_hit_tokens", "Prefix-cache hits on D",
                             registry=r)
        self.predicted = Counter("kvmesh_predicted_overlap_tokens",
                                 "Overlap the router predicted", registry=r)
        self.actual = Counter("kvmesh_actual_cached_tokens", "Tokens the engine reused",
                              registry=r)
        labels = ["path", "source"]
        self.predicted_tokens = Histogram(
            "kvmesh_frontend_predicted_cached_tokens",
            "Cached prompt tokens the router predicted, per request", labels,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.actual_tokens = Histogram(
            "kvmesh_frontend_actual_cached_tokens",
            "Cached prompt tokens the engine reported, per request", labels,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.cached_error = Histogram(
            "kvmesh_frontend_cached_tokens_abs_error",
            "|predicted - actual| cached prompt tokens, per request", labels,
            buckets=_TOKEN_BUCKETS, registry=r)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: the same child, without the label
        checks and the lock on later calls (no child of these metrics is ever removed)."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def observe_cache_prediction(self, path: str, source: str, predicted: int,
                                 actual: int) -> None:
        """Records one finished request's predicted and actual cached tokens (totals and
        per-request histograms)."""
        self.predicted.inc(predicted)
        self.actual.inc(actual)
        self.child(self.predicted_tokens, path, source).observe(predicted)
        self.child(self.actual_tokens, path, source).observe(actual)
        self.child(self.cached_error, path, source).observe(abs(predicted - actual))

    def observe_chunk_gap(self, gap_s: float, tokens: int) -> None:
        """One streamed chunk of ``tokens`` tokens arrived ``gap_s`` after the previous
        one: ``tokens`` ITL observations of ``gap_s / tokens``."""
        if tokens <= 0:
            return
        observe_many(self.itl, max(gap_s, 0.0) / tokens, tokens)

    def observe_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """A finished request's usage."""
        self.prompt_tokens.inc(max(prompt_tokens, 0))
        self.completion_tokens.inc(max(completion_tokens, 0))

    def observe_remote_fetch(self, outcome: str, seconds: float) -> None:
        """One remote image fetch ended (``ok`` or why not)."""
        self.remote_fetches.labels(outcome).inc()
        self.remote_fetch_seconds.observe(max(seconds, 0.0))

    def observe_rejection(self, reason: str) -> None:
        """A request admission control rejected."""
        self.requests.labels("none", "rejected").inc()
        self.rejections.labels(reason or "unknown").inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return bytes(generate_latest(self.registry))
