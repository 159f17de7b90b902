"""Remote image URLs (``--allow-remote-images``) against a local HTTP server.

A threaded HTTP server on 127.0.0.1 (port 0), started by the test, serves a PNG, bodies
over the byte cap (declared and streamed), a body that never finishes (its handler
blocks on a ``threading.Event`` until the test ends), a 404, redirects (to the PNG, to
``ftp:``, in a loop) and an HTML page. :mod:`services.frontend.remote_images` is driven
directly, then once through the pipeline's ``prepare`` (the tiny VLM's processor; no
engine): the fetched PNG becomes the job's image, and a failed fetch is a 400 naming
``messages[i].content[j].image_url.url``. Parse stays pure: without the flag a remote
URL is still refused. No vLLM; runtime a few seconds.
"""

from __future__ import annotations

import gzip
import io
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from PIL import Image

from protos import discovery_pb2
from services.common.config import ConfigError, load_config
from services.common.procs import free_port
from services.encoder.images import ImageLimits
from services.frontend.main import FrontendConfig
from services.frontend.models import ModelCatalog
from services.frontend.openai_schema import ApiError, ImagePart, parse_chat
from services.frontend.pipeline import Pipeline
from services.frontend.remote_images import (
    RemoteImageError,
    RemoteImageFetcher,
    RemoteImageLimits,
    fetch_parts,
)
from workers.model.tiny_vlm import ensure_tiny_vlm

CAP = 4096
FIELD = "messages[0].content[0].image_url.url"


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


class Site:
    """The test's HTTP server; ``release`` ends the never-finishing bodies."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.encodings: list[str] = []  # each request's Accept-Encoding
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # a body without Content-Length ends at close

            def log_message(self, *args: Any) -> None:
                pass

            def _head(self, status: int, ctype: str = "", length: int | None = None,
                      **headers: str) -> None:
                self.send_response(status)
                if ctype:
                    self.send_header("Content-Type", ctype)
                if length is not None:
                    self.send_header("Content-Length", str(length))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                site.encodings.append(self.headers.get("Accept-Encoding", ""))
                if path == "/cat.png":
                    self._head(200, "image/png", len(PNG))
                    self.wfile.write(PNG)
                elif path == "/octet":
                    self._head(200, "application/octet-stream")
                    self.wfile.write(PNG)
                elif path == "/big-declared":
                    self._head(200, "image/png", CAP + 1)
                    self.wfile.write(b"\0" * (CAP + 1))
                elif path == "/big-streamed":  # no Content-Length: the cap stops reading
                    self._head(200, "image/png")
                    try:
                        for _ in range(64):
                            self.wfile.write(b"\0" * CAP)
                    except OSError:
                        pass  # the client stopped reading: expected
                elif path == "/slow":
                    self._head(200, "image/png")
                    self.wfile.write(PNG[:10])
                    self.wfile.flush()
                    site.release.wait()  # never finishes while the test runs
                elif path == "/missing":
                    self._head(404, "text/plain", 9)
                    self.wfile.write(b"not found")
                elif path == "/redirect":
                    self._head(302, length=0, location="/cat.png")
                elif path == "/redirect-ftp":
                    self._head(302, length=0, location="ftp://127.0.0.1/cat.png")
                elif path == "/loop":
                    self._head(302, length=0, location="/loop")
                elif path == "/gzip":  # a gzip "bomb": tiny on the wire, CAP x 64 inflated
                    body = gzip.compress(b"\0" * (CAP * 64))
                    self._head(200, "image/png", len(body), **{"Content-Encoding": "gzip"})
                    self.wfile.write(body)
                elif path == "/page":
                    self._head(200, "text/html", 13)
                    self.wfile.write(b"<html></html>")
                else:
                    self._head(500)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    s = Site()
    yield s
    s.close()


def _closed_port() -> int:
    return free_port()  # outside the ephemeral range: nothing connects from it


async def test_fetch_outcomes(site: Site) -> None:
    seen: list[str] = []
    fetcher = RemoteImageFetcher(RemoteImageLimits(max_bytes=CAP, timeout_s=1.0,
                                                   max_redirects=2),
                                 lambda outcome, _s: seen.append(outcome))
    assert await fetcher.fetch(site.url("/cat.png"), FIELD) == PNG
    assert await fetcher.fetch(site.url("/octet"), FIELD) == PNG
    assert await fetcher.fetch(site.url("/redirect"), FIELD) == PNG
    cases = [
        ("/big-declared", "too_large", f"remote image over {CAP} bytes (Content-Length"),
        ("/big-streamed", "too_large", f"remote image over {CAP} bytes"),
        ("/slow", "timeout", "remote image timed out after 1.0 s"),
        ("/missing", "http_status", "remote image: HTTP 404 from http://127.0.0.1"),
        ("/redirect-ftp", "redirect", "redirect to a non-http(s) URL (ftp:) refused"),
        ("/loop", "redirect", "more than 2 redirects"),
        ("/page", "content_type", "content type 'text/html' is not an image"),
        ("/gzip", "content_encoding", "content encoding 'gzip' refused, only identity"),
    ]
    for path, outcome, words in cases:
        with pytest.raises(RemoteImageError) as info:
            await fetcher.fetch(site.url(path) + "?secret=1", FIELD)
        assert info.value.field == FIELD and info.value.outcome == outcome, path
        assert str(info.value).startswith(f"{FIELD}: ") and words in str(info.value), (
            path, str(info.value))
        assert "secret" not in str(info.value)  # the query is not echoed
    with pytest.raises(RemoteImageError) as info:
        await fetcher.fetch(f"http://127.0.0.1:{_closed_port()}/x.png", FIELD)
    assert info.value.outcome == "unreachable" and "unreachable" in str(info.value)
    assert seen == ["ok"] * 3 + [c[1] for c in cases] + ["unreachable"]
    assert set(site.encodings) == {"identity"}  # never asked for a compressed body


@pytest.mark.parametrize("url", [
    "http://[::1/x.png", "http://127.0.0.1:99999/x.png", "http://user:pw@127.0.0.1/x.png",
    "http:///x.png", "http://127.0.0.1/a\x00b.png"])
async def test_unusable_urls_are_bad_url_never_a_500(url: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    fetcher = RemoteImageFetcher(RemoteImageLimits(timeout_s=1.0),
                                 lambda outcome, _s: seen.append(outcome))
    with caplog.at_level(logging.DEBUG), pytest.raises(RemoteImageError) as info:
        await fetcher.fetch(url, FIELD)
    assert info.value.outcome == "bad_url" and info.value.field == FIELD, str(info.value)
    assert seen == ["bad_url"]
    assert "pw" not in str(info.value)


async def test_fetched_urls_never_reach_the_log(site: Site,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """httpx logs each request's URL at INFO (the frontend's default level)."""
    fetcher = RemoteImageFetcher(RemoteImageLimits(timeout_s=2.0))
    with caplog.at_level(logging.INFO):
        await fetcher.fetch(site.url("/cat.png") + "?X-Amz-Signature=s3cr3t", FIELD)
    assert "s3cr3t" not in caplog.text


async def test_fetch_parts_order_and_refusal(site: Site) -> None:
    fetcher = RemoteImageFetcher(RemoteImageLimits(max_bytes=CAP, timeout_s=2.0))
    parts = [ImagePart("a", PNG[:4]), ImagePart("b", b"", site.url("/cat.png"))]
    assert await fetch_parts(fetcher, parts) == [("a", PNG[:4]), ("b", PNG)]
    bad = [ImagePart("a", b"", site.url("/missing")), ImagePart("b", b"", site.url("/page"))]
    with pytest.raises(RemoteImageError) as info:
        await fetch_parts(fetcher, bad)
    assert info.value.field == "a"  # the first failing part, in prompt order
    # A failing part cancels the fetches still running (here one that never ends).
    seen: list[str] = []
    slow_fetcher = RemoteImageFetcher(RemoteImageLimits(max_bytes=CAP, timeout_s=60.0),
                                      lambda outcome, _s: seen.append(outcome))
    with pytest.raises(RemoteImageError) as info:
        await fetch_parts(slow_fetcher, [ImagePart("a", b"", site.url("/missing")),
                                         ImagePart("b", b"", site.url("/slow"))])
    assert info.value.field == "a" and sorted(seen) == ["cancelled", "http_status"]
    with pytest.raises(ValueError, match="b: remote image URLs are not supported"):
        await fetch_parts(None, parts)


def _body(url: str) -> dict[str, Any]:
    return {"model": "tiny-vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}]}


def test_parse_refuses_remote_urls_unless_allowed(site: Site) -> None:
    url = site.url("/cat.png")
    with pytest.raises(ApiError) as info:
        parse_chat(_body(url))
    assert info.value.param == FIELD and "remote image URLs are not supported" in \
        info.value.message
    req = parse_chat(_body(url), ImageLimits(remote_urls=True))
    assert req.images == (ImagePart(FIELD, b"", url),)  # parse stays pure: not fetched
    with pytest.raises(ApiError):  # other schemes stay refused
        parse_chat(_body("ftp://127.0.0.1/cat.png"), ImageLimits(remote_urls=True))


def test_frontend_flags() -> None:
    cfg = load_config(FrontendConfig, ["--allow-remote-images", "--remote-image-max-bytes",
                                       "1000", "--remote-image-timeout-s", "2.5"], {})
    assert cfg.allow_remote_images and cfg.remote_image_limits() == RemoteImageLimits(
        1000, 2.5)
    assert not load_config(FrontendConfig, [], {}).allow_remote_images  # off by default
    with pytest.raises(ConfigError, match="remote_image_timeout_s must be > 0, got 0.0"):
        load_config(FrontendConfig, ["--remote-image-timeout-s", "0"], {})


async def test_pipeline_fetches_then_checks(site: Site) -> None:
    vlm = ensure_tiny_vlm()
    catalog = ModelCatalog()
    catalog.update([discovery_pb2.InstanceRecord(
        instance_id="w", model="tiny-vlm", model_path=str(vlm), max_model_len=512,
        block_size=32, capabilities=["images"])])
    limits = ImageLimits(max_images=2, max_pixels=128 * 128, remote_urls=True)
    pipeline = Pipeline(catalog, lambda: None, image_limits=limits,
                        remote_images=RemoteImageLimits(max_bytes=CAP, timeout_s=2.0))
    try:
        job = await pipeline.prepare(parse_chat(_body(site.url("/redirect")), limits))
        assert job.mm is not None and [i.data for i in job.mm.images] == [PNG]
        for path, words in (("/missing", "HTTP 404"), ("/big-streamed", "over 4096 bytes")):
            with pytest.raises(ApiError) as info:
                await pipeline.prepare(parse_chat(_body(site.url(path)), limits))
            assert info.value.status == 400 and info.value.param == FIELD, path
            assert words in info.value.message, info.value.message
        reg = pipeline.metrics.registry
        assert reg.get_sample_value("kvmesh_frontend_remote_image_fetches_total",
                                    {"outcome": "ok"}) == 1
        assert reg.get_sample_value("kvmesh_frontend_remote_image_fetches_total",
                                    {"outcome": "http_status"}) == 1
        assert reg.get_sample_value("kvmesh_frontend_remote_image_fetch_seconds_count") == 3
    finally:
        await pipeline.close()
