"""HTTP side of the P/D overhead benchmark: one timed streaming completion, and /metrics.

Contracts:

- :func:`stream_completion` POSTs ``/v1/completions`` with ``"prompt"`` = the given token
  ids, ``stream: true`` and ``stream_options.include_usage``, over a fresh loopback
  connection opened *before* the clock starts. It returns a :class:`Sample`: ``ttft_s`` is
  the time from sending the request to the first SSE chunk whose choice carries non-empty
  text (None when no chunk had text), ``second_s`` the same to the second chunk with text
  (with P's token first, D's first token; None when there was none),
  ``first_chunk_s`` the time to the first data chunk
  of any kind, ``total_s`` the time to ``data: [DONE]``; ``sent_wall`` is ``time.time()``
  at the send (the host clock of the engines' stage stamps). A non-200 status, an SSE
  ``{"error": ...}`` event, a stream without ``[DONE]``, or a socket error/timeout is
  reported in ``Sample.error`` (the request never raises).
- :func:`fetch_metrics` GETs ``/metrics`` (Prometheus text) and flattens every sample to
  ``{"name{label=value,...}": value}``; :func:`metric_delta` subtracts two such snapshots.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Sample:
    """One timed request."""

    prompt_len: int
    sent_wall: float | None = None  # time.time() when the request was sent
    ttft_s: float | None = None
    second_s: float | None = None
    first_chunk_s: float | None = None
    total_s: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _host_port(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 80


def stream_completion(url: str, model: str, token_ids: list[int], max_tokens: int,
                      timeout_s: float) -> Sample:
    """One streaming completion, timed at the client (see the module docstring)."""
    sample = Sample(prompt_len=len(token_ids))
    body = json.dumps({
        "model": model, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    host, port = _host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.connect()
        sample.sent_wall = time.time()
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json",
                              "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            sample.error = f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:2000]}"
            return sample
        done = False
        parts: list[str] = []
        while not done:
            raw = resp.readline()
            if not raw:
                break
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter() - t0
            if data == "[DONE]":
                sample.total_s = now
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                sample.error = f"SSE error event: {json.dumps(event['error'])[:2000]}"
                return sample
            if sample.first_chunk_s is None:
                sample.first_chunk_s = now
            for choice in event.get("choices") or []:
                text = choice.get("text") or ""
                if text and sample.ttft_s is None:
                    sample.ttft_s = now
                elif text and sample.second_s is None:
                    sample.second_s = now
                parts.append(text)
            usage = event.get("usage")
            if usage:
                sample.prompt_tokens = usage.get("prompt_tokens")
                sample.completion_tokens = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                sample.cached_tokens = details.get("cached_tokens")
        sample.text = "".join(parts)
        if not done:
            sample.error = "stream ended without data: [DONE]"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return sample


def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model id of ``GET /v1/models``."""
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout_s) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def fetch_metrics(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Every sample of ``GET /metrics``, keyed ``name{k=v,...}`` (labels sorted)."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = float(s.value)
    return out


def metric_delta(before: dict[str, float], after: dict[str, float],
                 prefixes: tuple[str, ...]) -> dict[str, float]:
    """``after - before`` for the keys starting with one of ``prefixes`` (skipping
    histogram buckets and ``_created`` timestamps)."""
    out: dict[str, float] = {}
    for key, value in after.items():
        name = key.split("{", 1)[0]
        if not key.startswith(prefixes) or name.endswith(("_bucket", "_created")):
            continue
        delta = value - before.get(key, 0.0)
        if delta:
            out[key] = delta
    return out
