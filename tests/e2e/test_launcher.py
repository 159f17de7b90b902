"""``kvmesh up`` end to end, driven with the official openai client."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import openai
import pytest

from services.common.procs import free_port, port_open
from services.launcher.up import health
from tests.waiting import wait_for_sync

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    port = free_port()
    log_dir = tmp_path_factory.mktemp("up") / "logs"
    out = log_dir.parent / "launcher.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.launcher.cli", "up", "--model", "tiny", "--http-port",
             str(port), "--log-dir", str(log_dir), "--kv-cache-gib", "0.25",
             "--max-model-len", "1024"],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        )
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        assert proc.poll() is None, out.read_text()
        return b"kvmesh is serving" in out.read_bytes()

    try:
        wait_for_sync(serving, 300, lambda: f"'kvmesh is serving'; output: {out.read_text()}",
                      interval_s=0.5)
        yield url, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def read_until(stream: IO[bytes], marker: bytes, timeout_s: float) -> bytes:
    """Reads ``stream`` until a line contains ``marker``; returns everything read. Fails
    when the stream ends first or ``timeout_s`` passes (a reader thread does the blocking
    reads, so the deadline holds even while no line arrives)."""
    lines: queue.Queue[bytes] = queue.Queue()

    def pump() -> None:
        for line in iter(stream.readline, b""):
            lines.put(line)
        lines.put(b"")  # end of stream

    threading.Thread(target=pump, daemon=True).start()
    seen = b""
    deadline = time.monotonic() + timeout_s
    while marker not in seen:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {marker!r} within {timeout_s}s; output: "
                                 f"{seen.decode(errors='replace')}") from None
        assert line, f"output ended before {marker!r}: {seen.decode(errors='replace')}"
        seen += line
    return seen


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_against_the_launched_mesh(launched: tuple[str, Path]) -> None:
    url, out = launched
    assert f"curl {url}/v1/chat/completions" in out.read_text()
    assert "prefill + decode workers, pull KV handoff" in out.read_text()
    c = client(url)
    models = [m.id for m in c.models.list()]
    assert models == ["tiny-llama"]
    chat = c.chat.completions.create(model="tiny-llama", max_tokens=5, temperature=0,
                                     messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens <= 5
    assert chat.usage.prompt_tokens_details is not None
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny-llama", max_tokens=5, temperature=0, stream=True,
        messages=[{"role": "user", "content": "hello"}]) if ch.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    comp = c.completions.create(model="tiny-llama", prompt="one two three", max_tokens=4,
                                temperature=0)
    assert comp.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-llama", prompt="one two three", max_tokens=4, temperature=0, stream=True))
    assert streamed == comp.choices[0].text


def test_openai_client_sees_errors(launched: tuple[str, Path]) -> None:
    c = client(launched[0])
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert "gpt-17" in nf.value.message
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny-llama", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)
    assert health(launched[0])[0] == 200


def test_kvmesh_chat_prints_the_streamed_answer(launched: tuple[str, Path]) -> None:
    res = subprocess.run([sys.executable, "-m", "services.launcher.cli", "chat",
                          "--url", launched[0],
                          "--max-tokens", "6", "hello"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    bad = subprocess.run([sys.executable, "-m", "services.launcher.cli", "chat",
                          "--url", launched[0],
                          "--model", "nope", "hello"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and "nope" in bad.stderr


def test_ctrl_c_stops_everything_it_started(tmp_path: Path) -> None:
    port = free_port()
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.launcher.cli", "up", "--model", "tiny", "--http-port",
         str(port), "--log-dir", str(log_dir), "--kv-cache-gib", "0.25", "--mode", "agg"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert proc.stdout is not None
    try:
        read_until(proc.stdout, b"Press Ctrl-C", 300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    pids = [int(p.read_text()) for p in log_dir.glob("*.pid")]
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 0
    assert not port_open("127.0.0.1", port)
    assert {p.stem for p in log_dir.glob("*.pid")} == {"etcd", "redis", "indexer", "router",
                                                       "agg-0", "frontend"}
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(
            f"/proc/{pid}/status").read_text().lower(), pid
