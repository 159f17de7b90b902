"""AFD split against unsplit: torch.equal logits at every step, over the in-process
transport and over shared memory between two real processes; two microbatches; 2A1F with
FFN-side batching; the FFN process stopped or killed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.waiting import wait_for_sync
from workers.engines.afd.connector import AfdTransportConfig
from workers.engines.afd.engine import AfdEngine, LayerExecutor, SplitExecutor, UnsplitExecutor
from workers.engines.afd.ffn_server import FfnServer, serve_shm_ffn
from workers.engines.afd.kv_cache import KvCache
from workers.engines.afd.model import load_attention_side, load_ffn_side
from workers.engines.afd.sampling import SamplingParams
from workers.engines.afd.transport_local import (
    InProcessHub,
    ShmAttentionConnector,
    make_shm_connector_pair_name,
    shm_path,
)
from workers.model.tiny import ensure_tiny_model

PROMPTS = [[1, 5, 9, 33, 2, 17, 40], [1, 7, 8], list(range(3, 20))]
OTHER_PROMPTS = [[1, 50, 60, 70], list(range(100, 111))]
STEPS = 4
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def sides(tiny: Path):
    return load_attention_side(tiny), load_ffn_side(tiny)


def tcfg(microbatches: int = 2, attention_workers: int = 1) -> AfdTransportConfig:
    return AfdTransportConfig(128, MAX_TOKENS, microbatches, attention_workers)


def run(sides, executor: LayerExecutor, microbatches: int = 1,
        prompts: list[list[int]] = PROMPTS) -> list[dict[str, torch.Tensor]]:
    """Logits of every request at every step (prefill, then STEPS-1 decodes)."""
    attn, _ = sides
    eng = AfdEngine(attn, KvCache(attn.config, 1024), executor, microbatches=microbatches,
                    keep_logits=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        outs = eng.step()
        assert all(o.error is None for o in outs), outs
        steps.append({o.request_id: o.logits for o in outs if o.logits is not None})
        assert len(steps[-1]) == len(outs)
    assert eng.kv.used_tokens == 0
    return steps


def assert_equal_runs(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b) == STEPS
    for sa, sb in zip(a, b, strict=True):
        assert sa.keys() == sb.keys()
        for rid in sa:
            assert torch.equal(sa[rid], sb[rid]), f"request {rid} differs"


class ThreadFfn:
    """An FfnServer on the in-process hub, in a thread."""

    def __init__(self, sides, hub: InProcessHub, **kw) -> None:
        self.server = FfnServer(sides[1], hub.ffn(), **kw)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.server.run, args=(self._stop.is_set, 0.05))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()


@pytest.mark.parametrize("microbatches", [1, 2])
def test_split_in_process_equals_unsplit(sides, microbatches: int) -> None:
    """(b)/(c): split over the in-process transport == unsplit on the same microbatch
    shapes, and == unsplit with one microbatch (batch invariance)."""
    hub = InProcessHub(tcfg())
    ffn = ThreadFfn(sides, hub)
    try:
        split = run(sides, SplitExecutor(hub.attention(0)), microbatches)
    finally:
        ffn.stop()
    assert_equal_runs(split, run(sides, UnsplitExecutor(sides[1]), microbatches))
    assert_equal_runs(split, run(sides, UnsplitExecutor(sides[1]), 1))
    assert ffn.server.stats.messages == STEPS * 2 * microbatches


def test_two_microbatches_ping_pong_order(sides) -> None:
    """With two microbatches both are in flight at once: the attention side sends mb0's
    layer 0, computes and sends mb1's layer 0 while mb0's FFN runs, then receives mb0."""
    hub = InProcessHub(tcfg())
    seen: list[tuple[int, int]] = []
    ffn_conn = hub.ffn()
    ex = SplitExecutor(hub.attention(0))
    attn = sides[0]
    eng = AfdEngine(attn, KvCache(attn.config, 256), ex, microbatches=2)
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=1))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=1))

    def ffn_loop() -> None:
        server = FfnServer(sides[1], ffn_conn, max_batch_messages=1)
        for _ in range(4):
            h, ctx = ffn_conn.recv_attn_output(30)
            seen.append((ctx.layer, ctx.microbatch))
            ffn_conn.send_ffn_output(server.ffn.forward(ctx.layer, h), ctx.answer())

    t = threading.Thread(target=ffn_loop)
    t.start()
    outs = eng.step()
    t.join(timeout=30)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert seen[:2] == [(0, 0), (0, 1)] and sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_2a1f_with_ffn_side_batching(sides) -> None:
    """(d): two attention workers share one FFN server that batches their messages
    together; each equals its own unsplit run."""
    hub = InProcessHub(tcfg(microbatches=1, attention_workers=2))
    ffn = ThreadFfn(sides, hub, max_batch_messages=2, gather_s=1.0)
    results: dict[int, list[dict[str, torch.Tensor]]] = {}
    errors: list[BaseException] = []

    def attention(aid: int, prompts: list[list[int]]) -> None:
        try:
            results[aid] = run(sides, SplitExecutor(hub.attention(aid), attention_id=aid), 1,
                               prompts)
        except BaseException as e:  # noqa: BLE001 (re-raised in the test thread)
            errors.append(e)

    threads = [threading.Thread(target=attention, args=(0, PROMPTS)),
               threading.Thread(target=attention, args=(1, OTHER_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    ffn.stop()
    assert not errors, errors
    assert_equal_runs(results[0], run(sides, UnsplitExecutor(sides[1]), 1, PROMPTS))
    assert_equal_runs(results[1], run(sides, UnsplitExecutor(sides[1]), 1, OTHER_PROMPTS))
    assert ffn.server.stats.batch_sizes[2] > 0, ffn.server.stats  # batching happened


def test_silent_ffn_times_out_and_frees_kv(sides) -> None:
    """An FFN that never answers: AfdTimeout ends the step's requests, KV freed; the
    engine serves again once an FFN is back."""
    hub = InProcessHub(tcfg())
    attn = sides[0]
    eng = AfdEngine(attn, KvCache(attn.config, 256), SplitExecutor(hub.attention(0), 0, 0.2))
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=3))
    outs = eng.step()
    assert [(o.finish_reason, o.token) for o in outs] == [("error", None)]
    assert outs[0].error is not None and "AfdTimeout" in outs[0].error
    assert eng.kv.used_tokens == 0 and not eng.has_unfinished()
    hub2 = InProcessHub(tcfg())
    ffn = ThreadFfn(sides, hub2)
    try:
        eng.set_executor(SplitExecutor(hub2.attention(0)))
        eng.add_request("b", PROMPTS[0], SamplingParams(max_tokens=1))
        assert [o.finish_reason for o in eng.step()] == ["length"]
    finally:
        ffn.stop()


# ------------------------------------------------------------------ shared memory, 2 processes


def start_ffn_process(tiny: Path, name: str, microbatches: int = 2) -> mp.process.BaseProcess:
    proc = mp.get_context("spawn").Process(
        target=serve_shm_ffn, args=(str(tiny), name, 128, MAX_TOKENS, microbatches, 1),
        kwargs={"threads": 1}, daemon=True)
    proc.start()
    return proc


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = make_shm_connector_pair_name()
    yield name
    shm_path(name).unlink(missing_ok=True)  # left behind when the FFN process is killed


@pytest.fixture
def ffn_process(tiny: Path, shm_name: str) -> Iterator[mp.process.BaseProcess]:
    proc = start_ffn_process(tiny, shm_name)
    yield proc
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=30)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_split_shm_two_processes_equals_unsplit(sides, shm_name: str, ffn_process,
                                                microbatches: int) -> None:
    conn = ShmAttentionConnector(shm_name, 0, tcfg(), connect_timeout=60)
    try:
        split = run(sides, SplitExecutor(conn), microbatches)
    finally:
        conn.close()
    assert_equal_runs(split, run(sides, UnsplitExecutor(sides[1]), microbatches))


def test_ffn_process_killed_mid_step_ends_requests_and_frees_kv(
        tiny: Path, sides, shm_name: str, ffn_process) -> None:
    """(e): the FFN process is stopped, then killed while the attention side waits in a
    step: the step's requests end with AfdPeerGone, their KV is freed, and the engine
    serves again once a new FFN process is up."""
    attn = sides[0]
    eng = AfdEngine(attn, KvCache(attn.config, 256),
                    SplitExecutor(ShmAttentionConnector(shm_name, 0, tcfg(), 60)),
                    microbatches=2)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(o.error is None for o in eng.step())  # prefill went through
    os.kill(ffn_process.pid, signal.SIGSTOP)
    outs: list = []
    stepper = threading.Thread(target=lambda: outs.extend(eng.step()))
    stepper.start()
    os.kill(ffn_process.pid, signal.SIGKILL)
    ffn_process.join(timeout=30)
    stepper.join(timeout=30)
    assert not stepper.is_alive(), "the attention side hung on a dead FFN"
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"]
    assert all(o.finish_reason == "error" and "AfdPeerGone" in (o.error or "") for o in outs)
    assert eng.kv.used_tokens == 0 and len(eng.kv) == 0 and not eng.has_unfinished()
    # a dead peer is seen at once by a new step too
    eng.add_request("late", PROMPTS[1], SamplingParams(max_tokens=1))
    assert [o.finish_reason for o in eng.step()] == ["error"]

    proc = start_ffn_process(tiny, shm_name)
    try:
        eng.set_executor(SplitExecutor(ShmAttentionConnector(shm_name, 0, tcfg(), 60)))
        eng.add_request("again", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
        toks = [o.token for o in eng.step() + eng.step()]
        ref = AfdEngine(attn, KvCache(attn.config, 256), UnsplitExecutor(sides[1]))
        ref.add_request("again", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
        assert toks == [o.token for o in ref.step() + ref.step()]
    finally:
        proc.kill()
        proc.join(timeout=30)
    wait_for_sync(lambda: not proc.is_alive(), 30, "the second FFN process to exit")
