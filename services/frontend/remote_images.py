"""Remote image URLs (``http://`` / ``https://``), fetched by the frontend when allowed.

Off by default: :func:`services.frontend.openai_schema.parse_chat` refuses remote URLs
unless ``ImageLimits.remote_urls`` (the frontend's ``--allow-remote-images``); then the
parse step (pure) keeps the URL in ``ImagePart.url`` and the pipeline fetches it here,
on the event loop (httpx, asynchronous), before the image checks. Opting in lets
clients make the frontend issue GET requests to any address it can reach (including
internal ones): enable it only where that is acceptable.

Contract:

- :class:`RemoteImageLimits`: ``max_bytes`` per image body (``--remote-image-max-bytes``),
  ``timeout_s`` for the whole fetch, redirects and body included
  (``--remote-image-timeout-s``), ``max_redirects``; ``validate()`` raises ValueError.
- :class:`RemoteImageFetcher(limits, on_fetch=None, transport=None)`; ``await
  fetch(url, field)`` returns the body's bytes, or raises :class:`RemoteImageError` (an
  :class:`~services.encoder.images.InputError` naming ``field``, with ``outcome``):
  ``too_large`` (a ``Content-Length`` over ``max_bytes``, or a streamed body past it:
  reading stops there), ``timeout`` (the total time limit), ``http_status`` (a final
  status other than 2xx), ``unreachable`` (connection or protocol failure),
  ``redirect`` (a redirect to a scheme other than http(s), without a ``Location``, or
  more than ``max_redirects``), ``content_type`` (a ``Content-Type`` that is neither
  ``image/*`` nor ``application/octet-stream``; a response without one is let through to
  the format check), ``content_encoding`` (anything but identity: the request asks for
  ``Accept-Encoding: identity`` and the raw body is counted, so a compressed "bomb"
  cannot inflate past ``max_bytes``), ``bad_url`` (a URL httpx refuses, not http(s),
  without a host, a port out of range, or with credentials; also any other failure of
  the client on a URL or hop). Redirects are followed by hand so that
  each hop is checked. The image format itself (PNG/JPEG), bytes and pixels are checked
  afterwards by the usual image checks (:func:`services.encoder.images.open_image`).
  Environment proxies are not used (``trust_env=False``), and httpx's INFO request log
  (it names whole URLs, query strings included) is silenced. ``on_fetch(outcome,
  seconds)`` is called once per fetch (``ok``, the error's outcome, or ``cancelled``),
  e.g. for metrics.
- :func:`fetch_parts(fetcher, parts)`: the ``(field, bytes)`` of each image part in
  order, remote ones fetched concurrently; the first error (in part order) is raised
  and the fetches still running are cancelled, and a remote part without a fetcher
  (remote URLs not allowed) is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from services.encoder.images import InputError

# httpx logs every request's full URL (credentials, signed query strings) at INFO.
logging.getLogger("httpx").setLevel(logging.WARNING)

SCHEMES = ("http", "https")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CONTENT_TYPES_OK = ("image/", "application/octet-stream")


@dataclass(frozen=True)
class RemoteImageLimits:
    """How the frontend fetches remote images (see the module docstring)."""

    max_bytes: int = 16 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3

    def validate(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"remote_image_max_bytes must be >= 1, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"remote_image_timeout_s must be > 0, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")


class RemoteImageError(InputError):
    """A remote image the frontend could not use; ``outcome`` says why."""

    def __init__(self, field: str, outcome: str, message: str) -> None:
        super().__init__(field, message)
        self.outcome = outcome


def is_remote(url: str) -> bool:
    """Whether ``url`` is an http(s) URL."""
    return url.split(":", 1)[0].lower() in SCHEMES


class RemoteImageFetcher:
    """See the module docstring."""

    def __init__(self, limits: RemoteImageLimits,
                 on_fetch: Callable[[str, float], None] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        limits.validate()
        self.limits = limits
        self._on_fetch = on_fetch
        self._transport = transport

    async def fetch(self, url: str, field: str) -> bytes:
        started = time.monotonic()
        outcome = "ok"
        try:
            _check_url(url, field)
            async with asyncio.timeout(self.limits.timeout_s):
                return await self._fetch(url, field)
        except RemoteImageError as exc:
            outcome = exc.outcome
            raise
        except TimeoutError as exc:
            outcome = "timeout"
            raise RemoteImageError(field, outcome, f"remote image timed out after "
                                   f"{self.limits.timeout_s} s ({_where(url)})") from exc
        except asyncio.CancelledError:  # the request went away, or an earlier part failed
            outcome = "cancelled"
            raise
        except Exception as exc:  # anything else httpx/anyio raise: a bad URL or hop
            outcome = "bad_url"
            raise RemoteImageError(field, outcome, f"remote image URL unusable "
                                   f"({_where(url)}): {type(exc).__name__}") from exc
        finally:
            if self._on_fetch is not None:
                self._on_fetch(outcome, time.monotonic() - started)

    async def _fetch(self, url: str, field: str) -> bytes:
        timeout = httpx.Timeout(self.limits.timeout_s)
        async with httpx.AsyncClient(follow_redirects=False, timeout=timeout,
                                     trust_env=False, transport=self._transport) as client:
            for _ in range(self.limits.max_redirects + 1):
                try:
                    _check_url(url, field)
                    # identity only: a compressed body would be inflated past the cap
                    # before it could be counted (a gzip bomb).
                    async with client.stream("GET", url, headers={
                            "Accept-Encoding": "identity"}) as resp:
                        if resp.status_code in _REDIRECTS:
                            url = self._next_hop(url, resp, field)
                            continue
                        return await self._body(url, resp, field)
                except httpx.TimeoutException as exc:
                    raise TimeoutError from exc
                except httpx.HTTPError as exc:  # connect, TLS, protocol, ...
                    raise RemoteImageError(field, "unreachable", f"remote image "
                                           f"unreachable ({_where(url)}): "
                                           f"{type(exc).__name__}: {exc}") from exc
        raise RemoteImageError(field, "redirect", f"remote image: more than "
                               f"{self.limits.max_redirects} redirects ({_where(url)})")

    @staticmethod
    def _next_hop(url: str, resp: httpx.Response, field: str) -> str:
        location = resp.headers.get("location")
        if not location:
            raise RemoteImageError(field, "redirect", f"remote image: HTTP "
                                   f"{resp.status_code} without a Location ({_where(url)})")
        target = urljoin(url, location)
        if not is_remote(target):
            raise RemoteImageError(field, "redirect", f"remote image: redirect to a non-"
                                   f"http(s) URL ({urlsplit(target).scheme or '?'}:) "
                                   f"refused ({_where(url)})")
        return target

    async def _body(self, url: str, resp: httpx.Response, field: str) -> bytes:
        if not 200 <= resp.status_code < 300:
            raise RemoteImageError(field, "http_status", f"remote image: HTTP "
                                   f"{resp.status_code} from {_where(url)}")
        kind = resp.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind and not kind.startswith(_CONTENT_TYPES_OK):
            raise RemoteImageError(field, "content_type", f"remote image: content type "
                                   f"{kind!r} is not an image ({_where(url)})")
        encoding = resp.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise RemoteImageError(field, "content_encoding", f"remote image: content "
                                   f"encoding {encoding!r} refused, only identity "
                                   f"({_where(url)})")
        cap = self.limits.max_bytes
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise RemoteImageError(field, "too_large", f"remote image over {cap} bytes "
                                   f"(Content-Length {declared}, {_where(url)})")
        chunks: list[bytes] = []
        total = 0
        async for chunk in resp.aiter_raw():  # the bytes as sent: nothing inflated
            total += len(chunk)
            if total > cap:  # stop reading: the rest is never downloaded
                raise RemoteImageError(field, "too_large", f"remote image over {cap} "
                                       f"bytes ({_where(url)})")
            chunks.append(chunk)
        return b"".join(chunks)


def _check_url(url: str, field: str) -> None:
    """RemoteImageError ``bad_url`` for a URL httpx would refuse, or one with
    credentials (they would travel to every redirect target)."""
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except Exception as exc:  # httpx.InvalidURL, ValueError for a bad port, ...
        raise RemoteImageError(field, "bad_url", f"remote image URL is malformed "
                               f"({_where(url)}): {type(exc).__name__}") from exc
    if parsed.scheme not in SCHEMES or not parsed.host:
        raise RemoteImageError(field, "bad_url", f"remote image URL must be http(s) with "
                               f"a host ({_where(url)})")
    if port is not None and not 0 < port < 65536:
        raise RemoteImageError(field, "bad_url", f"remote image URL port out of range "
                               f"({_where(url)})")
    if parsed.userinfo:
        raise RemoteImageError(field, "bad_url", "remote image URL must not carry "
                               f"credentials ({_where(url)})")


def _where(url: str) -> str:
    """The URL without its query and credentials, for messages (never raises)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
    except ValueError:  # e.g. an unbalanced IPv6 bracket
        return "an unparsable URL"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is no number or out of range
        port = ":?"
    return f"{parts.scheme}://{host}{port}{parts.path}"


async def fetch_parts(fetcher: RemoteImageFetcher | None,
                      parts: Sequence[Any]) -> list[tuple[str, bytes]]:
    """``(field, bytes)`` per image part (``.field``, ``.data``, ``.url``); see the
    module docstring."""
    for p in parts:
        if p.url and fetcher is None:
            raise InputError(p.field, "remote image URLs are not supported; send the image "
                                      "as a data: URL (data:image/png;base64,...)")
    if fetcher is None or not any(p.url for p in parts):
        return [(p.field, p.data) for p in parts]

    tasks = [asyncio.ensure_future(fetcher.fetch(p.url, p.field)) if p.url else None
             for p in parts]
    try:
        out: list[tuple[str, bytes]] = []
        for p, task in zip(parts, tasks, strict=True):  # in part order: the first error
            out.append((p.field, p.data if task is None else await task))
        return out
    finally:  # an earlier part failed (or the request was cancelled): stop the rest
        pending = [t for t in tasks if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
