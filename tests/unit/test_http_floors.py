"""bench.mesh_profile.http_floors: the floor servers, run as the bench runs them
(child processes on free loopback ports), all answer the same checked one-token
completion; the bare asyncio hop keeps its connection across requests and closes it on
a request it cannot parse."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.mesh_profile import http_floors


def test_the_floors_answer_alike_and_are_reported(tmp_path: Path) -> None:
    assert http_floors.main(["--pairs", "4", "--gap-ms", "0", "--out", str(tmp_path),
                             "--name", "f"]) == 0
    report = json.loads((tmp_path / "f.json").read_text())
    assert list(report["servers"]) == list(http_floors.KINDS)
    for kind, s in report["servers"].items():
        assert (s["ok"], s["errors"]) == (4, 0), kind
        assert s["completion_tokens"] == {"1": 4}, kind
    assert report["over_asyncio_p50_ms"]["asyncio-httptools"] == 0.0
    assert (tmp_path / "f.png").stat().st_size > 0


async def _bare_hop() -> tuple[asyncio.Server, int]:
    server = await asyncio.get_running_loop().create_server(
        http_floors._Hop, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_the_bare_hop_keeps_alive_and_closes_on_garbage() -> None:
    server, port = await _bare_hop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": [1, 2]}).encode()
        for _ in range(2):  # one connection, two requests
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: %d"
                         b"\r\n\r\n%s" % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            assert json.loads(await reader.readexactly(length)) == http_floors.ANSWER
        writer.write(b"NOT HTTP\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing sent
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_a_server_that_answers_wrongly_fails_the_bench(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    async def wrong(urls: dict[str, str], model: str, n: int, gap_s: float, seed: int = 0,
                    offset: int = 0) -> dict[str, object]:
        good = {"ok": n, "errors": 0, "first_errors": [], "p50_ms": 1.0}
        return {k: (good if k != "uvicorn-asgi" else
                    {**good, "ok": n - 1, "errors": 1,
                     "first_errors": ["usage.completion_tokens 2 != 1"]})
                for k in urls} | {"paired_diff_p50_ms": 0.0, "gap_ms": 0.0}
    monkeypatch.setattr(http_floors, "paced_pairs", wrong)
    with pytest.raises(RuntimeError, match="uvicorn-asgi.*completion_tokens 2"):
        http_floors.measure(1, 0.0)
