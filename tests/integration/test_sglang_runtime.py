"""A real SGLang 0.5.23 CPU server (``.sglvenv``, ``make sglang``) on the tiny random Llama:
it starts from :func:`server_command`, answers ``/health``, and greedy ``/generate`` gives
the same tokens streamed and not streamed. Skipped when ``.sglvenv`` is not built."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.procs import Child, free_port, spawn
from tests.waiting import wait_for
from workers.engines.sglang.engine import mapped_shm_files
from workers.engines.sglang.server import ServerSpec, server_command, sglang_python

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sglang_python(REPO) is None,
                       reason="no SGLang runtime: run `make sglang` to build .sglvenv"),
]


@pytest.fixture()
def server(tiny_model: str, tmp_path: Path) -> Iterator[tuple[str, Child]]:
    port = free_port()
    argv, env = server_command(
        ServerSpec(model_path=tiny_model, port=port, role="agg", max_total_tokens=2048), REPO)
    child = spawn("sglang-agg", argv, tmp_path, env={**os.environ, **env})
    shm: set[str] = set()
    try:
        yield f"http://127.0.0.1:{port}", child
    finally:
        shm |= mapped_shm_files(child.pid)
        child.stop()
        for path in shm:  # SGLang's load-snapshot file (the engine unlinks it likewise)
            with contextlib.suppress(OSError):
                os.unlink(path)
    assert not child.alive()


async def test_greedy_generate_streamed_equals_non_streamed(server: tuple[str, Child]) -> None:
    url, child = server
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def healthy() -> bool:
            if not child.alive():
                raise AssertionError(f"SGLang exited before /health:\n{child.log_tail()}")
            try:
                return (await client.get("/health")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_for(healthy, timeout_s=600, what=lambda: f"SGLang /health\n{child.log_tail()}",
                       interval_s=0.5)
        body = {"input_ids": list(range(1, 41)),
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
        plain = (await client.post("/generate", json=body)).raise_for_status().json()
        assert len(plain["output_ids"]) == 8
        assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        assert plain["meta_info"]["prompt_tokens"] == 40

        chunks = []
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: "):]))
        assert chunks, "the stream sent no data"
        last = chunks[-1]
        # Cumulative output: the last chunk holds every token; the earlier ones are prefixes.
        assert last["output_ids"] == plain["output_ids"]
        assert all(last["output_ids"][: len(c["output_ids"])] == c["output_ids"] for c in chunks)
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        # The second request reused the first one's full page (page size 32) from the cache.
        assert last["meta_info"]["cached_tokens"] == 32
