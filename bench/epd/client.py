"""HTTP side of the EPD benchmark: the images, the request bodies, one timed streaming chat
request, and an open-loop load of them.

Contracts:

- :func:`png(seed, size)` is a deterministic random-noise RGB PNG (distinct seeds give
  distinct images, hence distinct content hashes at E).
- :func:`chat_body` is a streaming ``/v1/chat/completions`` body: ``max_tokens``,
  ``temperature`` 0, ``ignore_eos``, usage included; the user turn starts with a per-request
  nonce (``Request <i>.``: no two prompts share a prefix beyond the chat template's first
  tokens, so the prefix cache never skips an image's prefill) and, for an image request,
  one ``image_url`` part with a ``data:image/png;base64`` URL.
- :func:`timed_chat` sends one body over its own connection and returns a
  :class:`~bench.epd.report.Timed` (``sent_s`` given by the caller; TTFT to the first SSE
  chunk with non-empty ``delta.content``; each such chunk's arrival; usage's
  ``completion_tokens``). A non-200 status, an SSE error event, a stream without
  ``[DONE]`` or a transport error is the request's ``error``; it never raises.
- :func:`run_load` sends the requests at their offsets (seconds from the start, open
  loop: a slow request does not delay the next one) and returns their Timed in order and
  the wall time from the first send to the last answer.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from bench.epd.report import Timed


def png(seed: int, size: int = 96) -> bytes:
    """A deterministic random-noise PNG of ``size`` x ``size`` pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclass(frozen=True)
class Planned:
    """One request of the load: when (seconds after the start), which kind, which image."""

    index: int
    offset_s: float
    kind: str
    image: int | None = None


def chat_body(model: str, plan: Planned, images: Sequence[str], text: str,
              max_tokens: int) -> dict[str, Any]:
    """The request body of ``plan`` (see the module docstring)."""
    parts: list[dict[str, Any]] = []
    if plan.kind == "image":
        assert plan.image is not None
        parts.append({"type": "image_url", "image_url": {"url": images[plan.image]}})
    parts.append({"type": "text", "text": f"Request {plan.index}. {text}"})
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": parts}]}


async def timed_chat(client: httpx.AsyncClient, body: dict[str, Any], kind: str,
                     sent_s: float, image: int | None = None) -> Timed:
    """One timed streaming chat request (see the module docstring)."""
    out = Timed(kind=kind, sent_s=sent_s, image=image)
    t0 = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:1000]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                now = time.perf_counter() - t0
                if data == "[DONE]":
                    out.total_s, done = now, True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"SSE error event: {json.dumps(event['error'])[:1000]}"
                    return out
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        if out.ttft_s is None:
                            out.ttft_s = now
                        out.chunk_s.append(now)
                usage = event.get("usage")
                if usage:
                    out.completion_tokens = usage.get("completion_tokens")
        if not done:
            out.error = "stream ended without data: [DONE]"
        elif out.ttft_s is None:
            out.error = "no chunk with text"
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run_load(url: str, model: str, plan: Sequence[Planned], images: Sequence[str],
                   text: str, max_tokens: int, timeout_s: float) -> tuple[list[Timed], float]:
    """The open-loop load (see the module docstring)."""
    limits = httpx.Limits(max_connections=len(plan) + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(p: Planned) -> Timed:
            await asyncio.sleep(max(0.0, start + p.offset_s - time.perf_counter()))
            sent = time.perf_counter() - start
            return await timed_chat(client, chat_body(model, p, images, text, max_tokens),
                                    p.kind, sent, p.image)
        results = await asyncio.gather(*(one(p) for p in plan))
        return list(results), time.perf_counter() - start
