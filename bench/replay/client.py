"""The replay's HTTP side: one streamed OpenAI completion per trace request.

Contract of :func:`send`: POSTs ``/v1/completions`` with the token-id prompt,
``max_tokens`` = the request's output length, ``ignore_eos``, ``temperature`` 0, streaming
with ``include_usage``, and fills a :class:`~bench.replay.stats.Result`: TTFT = send →
first chunk carrying text, E2E = send → ``[DONE]``, tokens from the usage chunk
(``prompt_tokens_details.cached_tokens`` when the server reports it). HTTP 503/429 →
``rejected``; any other failure → ``error`` with the message. Never raises (except
cancellation).
"""

from __future__ import annotations

import json
import time

import httpx

from bench.replay.stats import Result


async def send(client: httpx.AsyncClient, url: str, model: str, token_ids: list[int],
               max_tokens: int, result: Result) -> Result:
    """One timed streaming completion (see the module docstring)."""
    body = {"model": model, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code in (429, 503):
                result.status = "rejected"
                result.error = (await resp.aread()).decode(errors="replace")[:200]
                return result
            if resp.status_code != 200:
                result.status = "error"
                result.error = f"HTTP {resp.status_code}: " + (
                    await resp.aread()).decode(errors="replace")[:200]
                return result
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.status = "error"
                    result.error = str(chunk["error"])[:200]
                    return result
                choices = chunk.get("choices") or []
                if result.ttft_s is None and any(c.get("text") for c in choices):
                    result.ttft_s = time.perf_counter() - t0
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
            result.e2e_s = time.perf_counter() - t0
            if not done:
                result.status = "error"
                result.error = "stream ended without [DONE]"
            elif result.ttft_s is None:
                result.ttft_s = result.e2e_s
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.status = "error"
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result
