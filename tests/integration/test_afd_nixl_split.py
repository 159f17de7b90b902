"""AFD split over NIXL against unsplit: torch.equal logits at every step, with the FFN in
a process of its own (NIXL 1.5.1, UCX on loopback DRAM), on the tiny model.

As in ``test_afd_nixl.py`` every NIXL endpoint lives in a spawned child that ends with
``os._exit`` (NIXL may crash at interpreter exit); the unsplit reference runs here. The
pairing is the mesh's (:mod:`workers.engines.afd.worker`): only the FFN's ``info()`` is
relayed (here over a pipe, in the mesh through its etcd record); each attention endpoint
connects to it and announces itself in band, and the FFN server connects every attention
endpoint that announces (:meth:`NixlAfdConnector.wait_ready` is its acknowledgement).

- 1A1F: one and two microbatches (the ping-pong) over the same pair of processes, both
  equal to unsplit on the same microbatch shapes; before it, a forged announcement (one
  naming another agent) is refused with its reason and the FFN serves on;
- 2A1F: two attention processes announce to one FFN process, which batches their layers
  together; each equals its own unsplit run.
"""

from __future__ import annotations

import dataclasses
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_afd_nixl import CHILD_S, UCX_ENV, kids, recv
from workers.engines.afd.connector import AfdTransportConfig
from workers.engines.afd.engine import AfdEngine, LayerExecutor, UnsplitExecutor
from workers.engines.afd.kv_cache import KvCache
from workers.engines.afd.model import AttentionSide, load_attention_side, load_ffn_side
from workers.engines.afd.sampling import SamplingParams
from workers.model.tiny import ensure_tiny_model

PROMPTS = [[1, 5, 9, 33, 2, 17, 40], [1, 7, 8], list(range(3, 20))]
OTHER_PROMPTS = [[1, 50, 60, 70], list(range(100, 111))]
STEPS = 4
MAX_TOKENS = 64
HIDDEN = 128  # the tiny model's

Steps = list[dict[str, torch.Tensor]]


def run(attn: AttentionSide, executor: LayerExecutor, microbatches: int,
        prompts: list[list[int]]) -> Steps:
    """Logits of every request at every step (prefill, then STEPS-1 decodes)."""
    eng = AfdEngine(attn, KvCache(attn.config, 1024), executor, microbatches=microbatches,
                    keep_logits=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    steps: Steps = []
    while eng.has_unfinished():
        outs = eng.step()
        assert all(o.error is None for o in outs), outs
        steps.append({o.request_id: o.logits for o in outs if o.logits is not None})
        assert len(steps[-1]) == len(outs)
    assert eng.kv.used_tokens == 0
    return steps


def _ffn_child(conn: Connection, model: str, cfg: tuple[int, ...]) -> None:
    """The FFN endpoint: an FfnServer on NIXL until told to stop, then its stats."""
    code = 1
    try:
        os.environ.update(UCX_ENV)
        torch.set_num_threads(1)
        from workers.engines.afd.ffn_server import FfnServer
        from workers.engines.afd.transport_nixl import NixlAfdConnector

        ffn = load_ffn_side(model)
        nixl = NixlAfdConnector("ffn", AfdTransportConfig(*cfg))
        conn.send(nixl.info())
        server = FfnServer(ffn, nixl, max_batch_messages=4, gather_s=0.05)
        server.run(should_stop=conn.poll, poll_s=0.05)
        assert conn.recv() == "stop"
        st = server.stats
        conn.send({"messages": st.messages, "batch_sizes": dict(st.batch_sizes),
                   "dropped": st.dropped, "peers": nixl.peers()})
        nixl.close()
        code = 0
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


def _attn_child(conn: Connection, model: str, cfg: tuple[int, ...], attention_id: int,
                prompts: list[list[int]], microbatches: list[int], forge_first: bool) -> None:
    """An attention endpoint: pair in band, run the split engine, send the logits."""
    code = 1
    try:
        os.environ.update(UCX_ENV)
        torch.set_num_threads(1)
        from workers.engines.afd.engine import SplitExecutor
        from workers.engines.afd.transport_nixl import _HELLO, EndpointInfo, NixlAfdConnector

        attn = load_attention_side(model)
        nixl = NixlAfdConnector("attention", AfdTransportConfig(*cfg), attention_id)
        nixl.connect(conn.recv())
        refusal = ""
        if forge_first:  # an announcement naming another agent is refused, with the reason
            forged = dataclasses.replace(EndpointInfo.from_bytes(nixl.info()), agent="other")
            nixl._agent.send_notif(nixl._peers[-1].name, _HELLO + forged.to_bytes())
            try:
                nixl.wait_ready(CHILD_S)
            except ValueError as exc:
                refusal = str(exc)
        nixl.announce()
        if not nixl.wait_ready(CHILD_S):
            raise TimeoutError("the FFN did not acknowledge the announcement")
        out: dict[Any, Any] = {"refusal": refusal}
        for mb in microbatches:
            out[mb] = run(attn, SplitExecutor(nixl, attention_id, recv_timeout=CHILD_S), mb,
                          prompts)
        conn.send(out)
        assert conn.recv() == "close"
        nixl.close()
        conn.send("closed")
        code = 0
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(code)


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def sides(tiny: Path) -> tuple[Any, Any]:
    return load_attention_side(tiny), load_ffn_side(tiny)


def unsplit(sides: tuple[Any, Any], microbatches: int, prompts: list[list[int]]) -> Steps:
    return run(sides[0], UnsplitExecutor(sides[1]), microbatches, prompts)


def assert_equal_runs(a: Steps, b: Steps) -> None:
    assert len(a) == len(b) == STEPS
    for step, (sa, sb) in enumerate(zip(a, b, strict=True)):
        assert sa.keys() == sb.keys()
        for rid in sa:
            assert torch.equal(sa[rid], sb[rid]), f"request {rid} differs at step {step}"


def split_over_nixl(tiny: Path, cfg: tuple[int, ...],
                    attention: list[tuple[list[list[int]], list[int]]], forge_first: bool = False
                    ) -> tuple[list[dict[Any, Any]], dict[str, Any]]:
    """One FFN child and one attention child per ``(prompts, microbatches)``; their
    results (logits by microbatches, and ``refusal``) and the FFN's stats."""
    with kids() as k:
        f, _ = k.start(_ffn_child, str(tiny), cfg)
        attns = [k.start(_attn_child, str(tiny), cfg, aid, prompts, mbs, forge_first)[0]
                 for aid, (prompts, mbs) in enumerate(attention)]
        ffn_info = recv(f)
        for a in attns:
            a.send(ffn_info)
        results = [recv(a) for a in attns]
        for a in attns:
            a.send("close")
            assert recv(a) == "closed"
        f.send("stop")
        stats = recv(f)
    return results, stats


def test_split_over_nixl_equals_unsplit_one_and_two_microbatches(tiny: Path, sides) -> None:
    (got,), stats = split_over_nixl(tiny, (HIDDEN, MAX_TOKENS, 2, 1), [(PROMPTS, [1, 2])],
                                    forge_first=True)
    assert "refused" in got["refusal"] and "names agent other" in got["refusal"], got
    for mb in (1, 2):
        assert_equal_runs(got[mb], unsplit(sides, mb, PROMPTS))
    layers = sides[0].config.num_layers
    assert stats["messages"] == STEPS * layers * (1 + 2) and stats["dropped"] == 0, stats


def test_2a1f_over_nixl_equals_unsplit(tiny: Path, sides) -> None:
    results, stats = split_over_nixl(tiny, (HIDDEN, MAX_TOKENS, 1, 2),
                                     [(PROMPTS, [1]), (OTHER_PROMPTS, [1])])
    assert_equal_runs(results[0][1], unsplit(sides, 1, PROMPTS))
    assert_equal_runs(results[1][1], unsplit(sides, 1, OTHER_PROMPTS))
    layers = sides[0].config.num_layers
    assert stats["messages"] == 2 * STEPS * layers and stats["dropped"] == 0, stats
    assert sorted(stats["peers"]) == [0, 1]  # the FFN connected both announcements
