"""``kvmesh up`` end to end, driven with the official openai client: on vLLM (tiny model),
with ``--epd`` (E/P/D on the tiny VLM: an image chat through the encoder, which is
restarted after a SIGKILL), with ``--afd --afd-attention 2`` (2A1F on the tiny model:
both attention workers serve, a SIGKILLed FFN worker is restarted and paired again), and
as a supervisor on mock workers (a killed child comes back, Redis keeps its data across
a restart, children die with a SIGKILLed ``kvmesh up``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
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

import aetcd
import grpc
import openai
import pytest
from aetcd.rpc import KVStub, RangeRequest
from openai.types.chat import ChatCompletionMessageParam
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError

from protos import discovery_pb2, router_pb2, router_pb2_grpc
from services.common.discovery import etcd_client, instances_prefix, read_instance_records
from services.common.etcd_auth import permission_denied
from services.common.grpc_client import channel
from services.common.procs import free_port, port_open
from services.common.redis_conn import redis_client
from services.common.tls import MeshTls
from services.launcher.up import STATUS_FILE, health
from tests.faults.table import FaultTable
from tests.waiting import wait_for, wait_for_sync

pytestmark = [pytest.mark.slow]


@contextlib.contextmanager
def kvmesh_up(log_dir: Path, *flags: str, timeout_s: float,
              env: dict[str, str] | None = None) -> Iterator[
        tuple[subprocess.Popen[bytes], str, Path]]:
    """Runs ``kvmesh up FLAGS --http-port P --log-dir LOG_DIR`` until it says it serves;
    yields (process, base URL, file of its output); afterwards SIGINTs (then SIGKILLs) it
    if it still runs."""
    port = free_port()
    out = log_dir.parent / "launcher.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.launcher.cli", "up", *flags, "--http-port",
             str(port), "--log-dir", str(log_dir)],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})},
        )

    def serving() -> bool:
        assert proc.poll() is None, out.read_text()
        return b"kvmesh is serving" in out.read_bytes()

    try:
        wait_for_sync(serving, timeout_s,
                      lambda: f"'kvmesh is serving'; output: {out.read_text()}", interval_s=0.2)
        yield proc, f"http://127.0.0.1:{port}", out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log_dir = tmp_path_factory.mktemp("up") / "logs"
    with kvmesh_up(log_dir, "--model", "tiny", "--kv-cache-gib", "0.25", "--max-model-len",
                   "1024", timeout_s=300) as (_, url, out):
        yield url, out


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


E2E_KEY = "sk-e2e-launcher"


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
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


# --- EPD: ``kvmesh up --epd`` (E/P/D on the tiny VLM), images over HTTP, E supervised.

def _png_url(seed: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _scrape(url: str) -> dict[str, float]:
    """``url``'s Prometheus samples, ``name{k=v,...}`` (labels sorted) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}":
            float(s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def _group(pgid: int) -> set[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.add(int(stat.parent.name))
    return out


async def _encoders(mesh: Supervised) -> list[discovery_pb2.InstanceRecord]:
    return await read_instance_records(mesh.address("etcd"), "kvmesh", "encoder", mesh.tls("admin"))


@pytest.mark.vllm
async def test_kvmesh_up_epd_serves_images_through_a_supervised_encoder(
        tmp_path: Path) -> None:
    """``kvmesh up --epd``: E/P/D on tiny-vlm with mTLS. An image chat over HTTP is 200
    with completion tokens and E encoded it (E's /metrics: one miss, one vision encoder
    run; the frontend counts no fallback); the same image again is an E cache hit and
    text never reaches E. A SIGKILLed encoder is restarted with its process group gone
    (no orphaned EngineCore), registers anew, and encodes the next image."""
    log_dir = tmp_path / "logs"
    with kvmesh_up(log_dir, "--epd", "--kv-cache-gib", "0.25", "--max-model-len", "1024",
                   timeout_s=600) as (proc, url, out):
        mesh = Supervised(proc, url, log_dir, out)
        assert "E/P/D: 1 encoder (embeddings over NIXL), prefill + decode workers" in \
            out.read_text()
        assert {"encoder-0", "prefill-0", "decode-0"} <= set(mesh.status())
        (enc,) = await _encoders(mesh)
        assert enc.metrics_address and enc.pid == int(mesh.status()["encoder-0"]["pid"])
        c = client(url)
        assert [m.id for m in c.models.list()] == ["tiny-idefics3"]

        def chat(image_seed: int | None) -> int:
            parts: list[dict[str, object]] = [{"type": "text", "text": "Describe it."}]
            if image_seed is not None:
                parts.insert(0, {"type": "image_url",
                                 "image_url": {"url": _png_url(image_seed)}})
            resp = c.chat.completions.create(
                model="tiny-idefics3", max_tokens=6, temperature=0,
                messages=[{"role": "user", "content": parts}],  # type: ignore[misc,list-item]
            )
            assert resp.usage is not None
            return resp.usage.completion_tokens

        def e_counts(rec: discovery_pb2.InstanceRecord) -> tuple[float, float, float]:
            m = _scrape(f"http://{rec.metrics_address}/metrics")
            return (m["kvmesh_encoder_cache_misses_total{}"],
                    m["kvmesh_encoder_cache_hits_total{}"], m["kvmesh_encoder_encodes_total{}"])

        def fallbacks() -> float:
            return sum(v for k, v in _scrape(f"{url}/metrics").items()
                       if k.startswith("kvmesh_frontend_encode_fallbacks_total{"))

        assert chat(1) >= 1
        assert e_counts(enc) == (1, 0, 1)  # E encoded the image
        assert chat(1) >= 1 and chat(None) >= 1
        assert e_counts(enc) == (1, 1, 1)  # a cache hit; the text never reached E
        assert fallbacks() == 0

        old = int(mesh.status()["encoder-0"]["pid"])
        assert len(_group(old)) >= 2, "the encoder and its EngineCore"
        os.kill(old, signal.SIGKILL)
        wait_for_sync(lambda: mesh.status()["encoder-0"]["pid"] != str(old)
                      and mesh.status()["encoder-0"]["state"] == "running", 30,
                      lambda: f"encoder-0 restarted; {mesh.status()}")
        assert mesh.status()["encoder-0"]["last_exit"] == "SIGKILL"
        wait_for_sync(lambda: not _group(old), 30,
                      lambda: f"encoder's old process group gone, left: {_group(old)}")
        new = int(mesh.status()["encoder-0"]["pid"])
        recs: list[discovery_pb2.InstanceRecord] = []

        async def registered_anew() -> bool:
            nonlocal recs
            recs = await _encoders(mesh)
            return [r.pid for r in recs] == [new]
        await wait_for(registered_anew, 300, lambda: f"only pid {new} registered: {recs}",
                       interval_s=0.5)
        assert chat(2) >= 1
        assert e_counts(recs[0]) == (1, 0, 1)
        assert fallbacks() == 0


# --- AFD: ``kvmesh up --afd --afd-attention 2`` (2A1F on the tiny model over shm).

async def _worker_records(mesh: Supervised) -> list[discovery_pb2.InstanceRecord]:
    return await read_instance_records(mesh.address("etcd"), "kvmesh", "worker", mesh.tls("admin"))


def _afd_steps(rec: discovery_pb2.InstanceRecord) -> float:
    """An AFD attention worker's engine steps so far (its /metrics)."""
    return sum(v for k, v in _scrape(f"http://{rec.metrics_address}/metrics").items()
               if k.startswith("kvmesh_engine_afd_steps_total{"))


async def test_kvmesh_up_afd_serves_2a1f_and_restarts_a_killed_ffn(tmp_path: Path) -> None:
    """``kvmesh up --afd --afd-attention 2``: one FFN worker and two attention workers of
    the afd engine (tiny model, shm), with mTLS. A streamed chat through the openai
    client equals the whole answer; concurrent requests are served by both attention
    workers (each one's engine steps grow); the FFN's record has no ``generate``. A SIGKILLed
    FFN worker is restarted by the supervisor, both attention workers pair again and
    re-register (newer records), and the mesh serves the same greedy answer."""
    from services.common.discovery import AFD_ATTENTION, AFD_FFN

    log_dir = tmp_path / "logs"
    with kvmesh_up(log_dir, "--afd", "--afd-attention", "2", "--model", "tiny",
                   "--kv-cache-gib", "0.05", "--max-model-len", "1024",
                   timeout_s=300) as (proc, url, out):
        mesh = Supervised(proc, url, log_dir, out)
        assert {"afd-ffn-0", "afd-attention-0", "afd-attention-1"} <= set(mesh.status())
        recs = await _worker_records(mesh)
        attn = sorted((r for r in recs if AFD_ATTENTION in r.capabilities),
                      key=lambda r: r.instance_id)
        (ffn,) = [r for r in recs if list(r.capabilities) == [AFD_FFN]]
        assert len(attn) == 2 and ffn.pid == int(mesh.status()["afd-ffn-0"]["pid"])
        c = client(url)
        assert [m.id for m in c.models.list()] == ["tiny-llama"]
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "a b c d"}]
        whole = c.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                          messages=messages)
        pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny-llama", max_tokens=8, temperature=0, stream=True,
            messages=messages) if ch.choices]
        assert "".join(pieces) == whole.choices[0].message.content
        assert whole.usage is not None and whole.usage.completion_tokens >= 1

        # 2A1F: concurrent requests (the router balances in-flight load) reach both
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                     timeout=120)

        async def both_served() -> bool:
            await asyncio.gather(*(aclient.completions.create(
                model="tiny-llama", prompt=f"p{i} q{i} r{i}", max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True}) for i in range(4)))
            return all(_afd_steps(r) > 0 for r in attn)
        await wait_for(both_served, 120,
                       lambda: f"both attention workers to serve; {mesh.status()}",
                       interval_s=0.2)

        before = {r.instance_id: r.started_at_ms for r in attn}
        old = int(mesh.status()["afd-ffn-0"]["pid"])
        os.kill(old, signal.SIGKILL)

        def restarted() -> dict[str, str] | None:
            row = mesh.status()["afd-ffn-0"]
            return row if row["pid"] != str(old) and row["state"] == "running" else None

        row = wait_for_sync(restarted, 30, lambda: f"afd-ffn-0 restarted; {mesh.status()}")
        assert row is not None and row["restarts"] == "1" and row["last_exit"] == "SIGKILL"
        assert f"afd-ffn-0 (pid {old}) exited (SIGKILL)" in mesh.out.read_text()
        new = int(row["pid"])
        seen: list[discovery_pb2.InstanceRecord] = []

        async def paired_again() -> bool:
            """The new FFN registered, and both attention workers left etcd and came
            back (records newer than before the kill)."""
            nonlocal seen
            seen = await _worker_records(mesh)
            fresh = {r.instance_id for r in seen if AFD_ATTENTION in r.capabilities
                     and r.started_at_ms > before.get(r.instance_id, 1 << 62)}
            return fresh == set(before) and [r.pid for r in seen
                                             if list(r.capabilities) == [AFD_FFN]] == [new]
        await wait_for(paired_again, 120, lambda: f"re-paired and registered: {seen}",
                       interval_s=0.5)
        wait_for_sync(lambda: int(str(health(url)[1].get("workers", 0))) >= 2, 30,
                      "the frontend to list both attention workers again", interval_s=0.2)
        again = c.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                          messages=messages)
        assert again.choices[0].message.content == whole.choices[0].message.content
        assert {r["restarts"] for n, r in mesh.status().items() if n != "afd-ffn-0"} == {"0"}
# --- supervision, on mock workers (no vLLM): one launched mesh for the three tests below,
# the last of which SIGKILLs its ``kvmesh up``.

class Supervised:
    """A running ``kvmesh up --engine mock --mode agg`` and where to look at it."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log_dir: Path,
                 out: Path) -> None:
        self.proc, self.url, self.log_dir, self.out = proc, url, log_dir, out

    def status(self) -> dict[str, dict[str, str]]:
        """``status.tsv``: name → column → value."""
        head, *rows = (self.log_dir / STATUS_FILE).read_text().splitlines()
        cols = head.split("\t")
        return {r.split("\t")[0]: dict(zip(cols, r.split("\t"), strict=True)) for r in rows}

    def address(self, name: str) -> str:
        return self.status()[name]["address"]

    def tls(self, stem: str = "admin") -> MeshTls:
        """A certificate of the mesh, from the folder ``kvmesh up`` printed."""
        printed = next(line for line in self.out.read_text().splitlines()
                       if "internal gRPC: mTLS, certificates in " in line)
        return MeshTls.load(printed.split("certificates in ", 1)[1].strip(), stem)


def gone(pid: int) -> bool:
    """No such process (or only its zombie, left for whoever reaps orphans here)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    log_dir = tmp_path_factory.mktemp("supervised") / "logs"
    # with an API key: kvmesh up itself must use it, and only its frontend may hold it
    with kvmesh_up(log_dir, "--engine", "mock", "--model", "tiny", "--mode", "agg",
                   timeout_s=120, env={"KVMESH_API_KEYS": E2E_KEY}) as (proc, url, out):
        yield Supervised(proc, url, log_dir, out)


async def worker_pids(etcd: str, tls: MeshTls) -> set[int]:
    return {r.pid for r in await read_instance_records(etcd, "kvmesh", "worker", tls)}


def complete(url: str) -> str:
    comp = client(url, E2E_KEY).completions.create(model="tiny-llama", prompt="one two three",
                                          max_tokens=4, temperature=0)
    assert comp.choices[0].finish_reason == "length"
    return comp.choices[0].text


async def test_a_killed_worker_is_restarted_and_the_mesh_serves(
        supervised: Supervised, fault_table: FaultTable) -> None:
    mesh = supervised
    before = complete(mesh.url)
    etcd = mesh.address("etcd")
    old = int(mesh.status()["agg-0"]["pid"])
    assert await worker_pids(etcd, mesh.tls()) == {old}
    os.kill(old, signal.SIGKILL)

    def restarted() -> dict[str, str] | None:
        row = mesh.status()["agg-0"]
        return row if row["pid"] != str(old) and row["state"] == "running" else None

    row = wait_for_sync(restarted, 30, lambda: f"agg-0 restarted; {mesh.status()}")
    assert row is not None and row["restarts"] == "1" and row["last_exit"] == "SIGKILL"
    new = int(row["pid"])
    assert int((mesh.log_dir / "agg-0.pid").read_text()) == new
    assert f"agg-0 (pid {old}) exited (SIGKILL)" in mesh.out.read_text()
    # The old record goes with its lease (SIGKILL: no revoke), the new one registers.
    pids: set[int] = set()

    async def only_new() -> bool:
        nonlocal pids
        pids = await worker_pids(etcd, mesh.tls())
        return pids == {new}
    await wait_for(only_new, 30, lambda: f"only pid {new} registered, got {pids}",
                   interval_s=0.2)
    after = complete(mesh.url)
    observed = (f"restarted once; {'same' if after == before else 'a different'} greedy "
                f"answer; kvmesh up {'running' if mesh.proc.poll() is None else 'gone'}")
    assert fault_table.record("kill -9 of a worker under kvmesh up",
                              "restarted once; same greedy answer; kvmesh up running",
                              observed), observed
    assert {r["restarts"] for n, r in mesh.status().items() if n != "agg-0"} == {"0"}


async def test_redis_keeps_its_data_across_a_restart(supervised: Supervised) -> None:
    mesh = supervised
    url = f"rediss://{mesh.address('redis')}"  # TLS and ACL users: the mesh has certificates
    r = redis_client(url, mesh.tls("admin"))
    try:
        await r.set("aof-probe", b"kept")  # answered: written to the AOF (in the page cache)
    finally:
        await r.aclose()
    old = int(mesh.status()["redis"]["pid"])
    os.kill(old, signal.SIGKILL)
    wait_for_sync(lambda: mesh.status()["redis"]["pid"] != str(old)
                  and mesh.status()["redis"]["state"] == "running", 30,
                  lambda: f"redis restarted; {mesh.status()}")
    value: object = None

    async def reloaded() -> bool:
        nonlocal value
        r = redis_client(url, mesh.tls("admin"))
        try:
            value = await r.get("aof-probe")
            return True
        except (RedisConnectionError, BusyLoadingError):
            return False  # not listening / still loading the AOF
        finally:
            await r.aclose()
    await wait_for(reloaded, 30, "the restarted redis to answer", interval_s=0.1)
    assert value == b"kept"
    assert mesh.status()["redis"]["restarts"] == "1"
    assert mesh.proc.poll() is None


# Hung once in CI (the suite ran into CI's 90-minute limit here; 12/12 and 6/6 repeated
# runs passed on this machine): a hang now fails this test, with its stack, within 5 min,
# and the etcd read, which had no deadline of its own, fails alone after one minute.
@pytest.mark.timeout(300)
async def test_the_launched_mesh_is_mtls_by_default(supervised: Supervised) -> None:
    """The router of a default ``kvmesh up`` refuses a plaintext client and a worker's
    certificate on Route; the certificates are where ``kvmesh up`` said."""
    mesh = supervised
    (rec,) = await asyncio.wait_for(read_instance_records(
        mesh.address("etcd"), "kvmesh", "router", mesh.tls("router")), timeout=60)
    route = router_pb2.RouteRequest(request_id="e2e-tls", model="tiny-llama", token_ids=[1])
    async with grpc.aio.insecure_channel(rec.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await router_pb2_grpc.RouterStub(ch).Route(route, timeout=5)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    async with channel(rec.address, mesh.tls("worker")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await router_pb2_grpc.RouterStub(ch).Route(route, timeout=5)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_each_child_holds_only_its_own_identity(supervised: Supervised) -> None:
    """Every child's KVMESH_TLS_DIR (read from its /proc environ) holds the CA certificate,
    its own certificate and key and its role's secrets: never the CA key, nor another
    role's key."""
    status = supervised.status()
    want = {
        "router": {"ca.pem", "router.pem", "router-key.pem", "events.key",
                   "redis-router.pass"},
        "agg-0": {"ca.pem", "worker-agg-0.pem", "worker-agg-0-key.pem",
                  "worker-agg-0.evkey", "redis-worker.pass"},
        "frontend": {"ca.pem", "frontend.pem", "frontend-key.pem"},
    }
    for name, files in want.items():
        raw = Path(f"/proc/{status[name]['pid']}/environ").read_bytes()
        env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
        folder = Path(env["KVMESH_TLS_DIR"])
        assert {f.name for f in folder.iterdir()} == files, name
        assert env["KVMESH_TLS_CERT"] == next(f[:-4] for f in files if f.endswith(".pem")
                                              and f != "ca.pem" and "-key" not in f)
        if name != "frontend":  # users' keys are the frontend's alone
            assert not [v for v in env if v.startswith("KVMESH_API_KEY")], name
        else:
            assert env["KVMESH_API_KEYS"] == E2E_KEY


async def test_the_launched_etcd_lets_a_worker_write_only_its_own_key(
        supervised: Supervised) -> None:
    """etcd is https with auth: a plaintext client gets nothing; agg-0 (its instance
    certificate, its worker id) is registered; its certificate may not put or delete
    another worker's key, the shared worker certificate none at all, and agg-0's record
    stays as it was."""
    mesh = supervised
    etcd = mesh.address("etcd")
    assert etcd.startswith("https://")
    host_port = etcd.removeprefix("https://")
    async with grpc.aio.insecure_channel(host_port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await KVStub(ch).Range(RangeRequest(key=b"/"), timeout=5)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    key = instances_prefix("kvmesh", "worker").encode()
    fake = discovery_pb2.InstanceRecord(instance_id="fake", component="worker",
                                        address="127.0.0.1:1").SerializeToString()
    for stem, keys in (("worker-agg-0", [b"fake"]), ("worker", [b"fake", b"agg-0"])):
        client = etcd_client(etcd, mesh.tls(stem))
        try:
            (kv,) = await client.get_prefix(key)
            assert kv.key == key + b"agg-0"
            for k in keys:
                for call in (client.put(key + k, fake), client.delete(key + k)):
                    with pytest.raises(aetcd.exceptions.ClientError) as refused:
                        await call
                    assert permission_denied(refused.value), (stem, k, refused.value)
            (still,) = await client.get_prefix(key)
            assert (still.key, still.value) == (kv.key, kv.value)
        finally:
            await client.close()


def test_children_die_with_a_sigkilled_kvmesh_up(supervised: Supervised,
                                                  fault_table: FaultTable) -> None:
    mesh = supervised
    pids = {name: int(row["pid"]) for name, row in mesh.status().items()}
    assert set(pids) == {"etcd", "redis", "indexer", "router", "agg-0", "frontend"}
    assert not any(gone(p) for p in pids.values()), pids
    os.kill(mesh.proc.pid, signal.SIGKILL)
    assert mesh.proc.wait(10) == -signal.SIGKILL
    for name, pid in pids.items():
        wait_for_sync(functools.partial(gone, pid), 30, f"{name} (pid {pid}) to exit")
    assert not port_open("127.0.0.1", int(mesh.url.rsplit(":", 1)[1]))
    fault_table.record("kill -9 of kvmesh up", f"all {len(pids)} children exit",
                       f"all {len(pids)} children exit", count=len(pids))  # else waits failed
