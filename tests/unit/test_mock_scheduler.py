"""Mock engine scheduler on a virtual clock: budget, chunking, preemption, cache hits,
simulated P→D reception, timing, determinism."""

from __future__ import annotations

import random

import pytest

from services.indexer.core import KvEvent, KvIndex
from workers.engines.mock.scheduler import Scheduler, SchedulerConfig, SimRequest, StepOutput
from workers.engines.mock.timing import PolynomialTiming, ZeroTiming
from workers.kv.event_translate import EventTranslator

BS = 4


def sched(**kw: object) -> Scheduler:
    base: dict[str, object] = {"num_blocks": 64, "block_size": BS, "max_num_seqs": 8,
                               "max_num_batched_tokens": 64, "max_model_len": 512,
                               "timing": ZeroTiming()}
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> SimRequest:
    return SimRequest(rid, prompt, max_tokens, **kw)  # type: ignore[arg-type]


def drain(s: Scheduler, now: float = 0.0, max_steps: int = 10_000) -> tuple[
        dict[str, list[StepOutput]], float]:
    """Runs steps on a virtual clock until nothing is left; outputs by request id."""
    outs: dict[str, list[StepOutput]] = {}
    for _ in range(max_steps):
        if not (s.has_work() or s.receiving):
            return outs, now
        b = s.schedule(now)
        if b.empty:
            nxt = s.next_ready_at()
            assert nxt is not None, "stuck: waiting work that can never be admitted"
            now = max(now, nxt)
            continue
        now += b.duration_s
        for o in s.complete(b, now):
            outs.setdefault(o.request_id, []).append(o)
        s.blocks.check()
    raise AssertionError("did not finish")


def test_chunked_prefill_under_the_token_budget() -> None:
    s = sched(max_num_batched_tokens=16)
    s.add(req("a", list(range(40)), max_tokens=2), 0.0)
    sizes = []
    while True:
        b = s.schedule(0.0)
        sizes.append([n for _, n in b.entries])
        outs = s.complete(b, 0.0)
        if outs and outs[-1].finished:
            break
    assert sizes == [[16], [16], [8], [1]]
    assert s.blocks.num_used == 0


def test_running_requests_go_first_and_share_the_budget() -> None:
    s = sched(max_num_batched_tokens=10)
    s.add(req("a", list(range(5)), max_tokens=5), 0.0)
    b = s.schedule(0.0)
    assert [(r.request_id, n) for r, n in b.entries] == [("a", 5)]
    s.complete(b, 0.0)
    s.add(req("b", list(range(100, 120)), max_tokens=5), 0.0)
    b = s.schedule(0.0)
    assert [(r.request_id, n) for r, n in b.entries] == [("a", 1), ("b", 9)]
    assert (b.prefill_tokens, b.decode_seqs) == (9, 1)


def test_max_num_seqs_limits_running_requests() -> None:
    s = sched(max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", [i] * 6), 0.0)
    b = s.schedule(0.0)
    assert [r.request_id for r, _ in b.entries] == ["r0", "r1"]
    assert s.load()[:2] == (2, 1)
    outs, _ = drain(s)
    assert all(v[-1].finished for v in outs.values()) and len(outs) == 3


def test_cached_tokens_never_count_the_last_prompt_token() -> None:
    s = sched()
    prompt = list(range(12))  # exactly 3 blocks
    s.add(req("a", prompt), 0.0)
    outs, _ = drain(s)
    assert outs["a"][0].cached_tokens == 0
    s.add(req("b", prompt), 0.0)
    outs, _ = drain(s)
    assert outs["b"][0].cached_tokens == 8  # 2 blocks: the 3rd holds the last token
    s.add(req("c", prompt + [99]), 0.0)
    outs, _ = drain(s)
    assert outs["c"][0].cached_tokens == 12
    assert s.counters["prefix_cache_hits_tokens"] == 20
    assert s.counters["prefix_cache_queries_tokens"] == 12 + 12 + 13


def test_preemption_when_blocks_run_out_and_everyone_still_finishes() -> None:
    s = sched(num_blocks=10, max_num_batched_tokens=64)
    for i in range(3):
        s.add(req(f"r{i}", [i + 1] * 8, max_tokens=10), 0.0)  # each needs 5 blocks at the end
    outs, _ = drain(s)
    assert s.counters["preemptions"] > 0
    assert {k: v[-1].finish_reason for k, v in outs.items()} == dict.fromkeys(
        ("r0", "r1", "r2"), "length")
    assert all(sum(len(o.token_ids) for o in v) == 10 for v in outs.values())
    assert s.blocks.num_used == 0


def test_abort_frees_blocks_and_reports_abort() -> None:
    s = sched(max_num_batched_tokens=4)
    s.add(req("a", list(range(20))), 0.0)
    s.complete(s.schedule(0.0), 0.0)
    assert s.blocks.num_used > 0
    out = s.abort("a", 0.0)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert s.blocks.num_used == 0 and s.abort("a", 0.0) is None
    s.add(req("w", [1, 2, 3]), 0.0)  # abort while still waiting
    assert s.abort("w", 0.0) is not None and not s.waiting
    s.blocks.check()


def test_stop_tokens_eos_and_ignore_eos() -> None:
    s = sched(vocab_size=1, eos_token_id=0)  # every sampled token is 0
    s.add(req("eos", [5, 6], max_tokens=5), 0.0)
    s.add(req("ign", [5, 7], max_tokens=5, ignore_eos=True), 0.0)
    s.add(req("stop", [5, 8], max_tokens=5, ignore_eos=True, stop_token_ids=(0,)), 0.0)
    outs, _ = drain(s)
    assert (outs["eos"][-1].finish_reason, outs["eos"][-1].num_output) == ("stop", 1)
    assert (outs["ign"][-1].finish_reason, outs["ign"][-1].num_output) == ("length", 5)
    assert outs["stop"][-1].finish_reason == "stop"


def test_max_model_len_ends_with_length() -> None:
    s = sched(max_model_len=10)
    s.add(req("a", list(range(8)), max_tokens=50), 0.0)
    outs, _ = drain(s)
    assert (outs["a"][-1].finish_reason, outs["a"][-1].num_output) == ("length", 2)


def test_tokens_are_deterministic_and_in_vocab() -> None:
    def tokens(seed: int, sampling_seed: int | None = None) -> list[int]:
        s = sched(seed=seed, vocab_size=50)
        s.add(req("a", [1, 2, 3], max_tokens=8, sampling_seed=sampling_seed), 0.0)
        outs, _ = drain(s)
        return [t for o in outs["a"] for t in o.token_ids]

    assert tokens(0) == tokens(0)
    assert tokens(0) != tokens(1)
    assert tokens(0, 7) != tokens(0)
    assert all(0 <= t < 50 for t in tokens(3))


def test_step_time_follows_the_model_and_speedup() -> None:
    p = PolynomialTiming()
    s = sched(timing=p, speedup_ratio=2.0, max_num_batched_tokens=1000)
    s.add(req("a", list(range(100)), max_tokens=2), 0.0)
    b = s.schedule(0.0)
    assert b.duration_s == pytest.approx(p.prefill_ms(100) / 1000 / 2)
    s.complete(b, b.duration_s)
    b = s.schedule(1.0)
    assert b.decode_seqs == 1 and b.prefill_tokens == 0
    assert b.duration_s == pytest.approx(p.decode_ms(b.kv_usage) / 1000 / 2)


def test_modelled_tpot_is_the_decode_steps_time_per_later_token() -> None:
    s = sched(timing=PolynomialTiming(), max_num_batched_tokens=1000)
    s.add(req("a", list(range(40)), max_tokens=5), 0.0)
    s.add(req("one", list(range(100, 140)), max_tokens=1), 0.0)  # no later token: no TPOT
    now, decode_s = 0.0, 0.0
    while s.has_work():
        b = s.schedule(now)
        if b.prefill_tokens == 0:  # a pure decode step of "a"
            decode_s += b.duration_s
        now += b.duration_s
        s.complete(b, now)
    assert decode_s > 0
    assert list(s.modelled_tpot) == [("a", pytest.approx(decode_s / 4))]


def test_first_token_times_split_queue_and_prefill() -> None:
    s = sched(timing=PolynomialTiming(), max_num_seqs=1)
    s.add(req("a", list(range(50)), max_tokens=1), 0.0)
    s.add(req("b", list(range(100, 150)), max_tokens=1), 0.0)
    outs, end = drain(s)
    a, b = outs["a"][0], outs["b"][0]
    assert a.queue_s == 0.0 and a.prefill_s == pytest.approx(PolynomialTiming().prefill_ms(50)
                                                             / 1000)
    assert b.queue_s == pytest.approx(a.prefill_s) and b.prefill_s == pytest.approx(a.prefill_s)


def test_prefill_decode_handoff_simulation() -> None:
    bw, bpb = 1e9, 1_000_000  # 1 ms per block
    p = sched(kv_bytes_per_block=bpb, transfer_bandwidth=bw, engine_id="P")
    d = sched(kv_bytes_per_block=bpb, transfer_bandwidth=bw, engine_id="D")
    prompt = list(range(30))  # 8 blocks (7 full + 2 tokens)
    p.add(req("x", prompt, max_tokens=1, remote_decode=True), 0.0)
    pout, _ = drain(p)
    params = pout["x"][-1].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == "P" and params["remote_request_id"] == "x"
    assert len(params["remote_block_ids"]) == 8
    # D already holds the first 2 blocks of the prompt: 6 blocks cross, 6 ms
    d.add(req("warm", prompt[:8] + [999], max_tokens=1), 0.0)
    drain(d)
    d.blocks.drain_events()
    d.add(req("x", prompt, max_tokens=3, remote_prefill=True), 10.0)
    b = d.schedule(10.0)
    assert b.empty and d.load()[1] == 1  # receiving, not running
    assert d.next_ready_at() == pytest.approx(10.006)
    assert d.counters["kv_transfer_bytes"] == 6 * bpb
    assert d.counters["kv_external_loaded_tokens"] == 30 - 8
    outs, _ = drain(d, 10.0)
    toks = [t for o in outs["x"] for t in o.token_ids]
    assert toks[0] == pout["x"][0].token_ids[0]  # D continues with P's first token
    assert outs["x"][0].cached_tokens == 29 and len(toks) == 3
    assert outs["x"][0].prefill_s == pytest.approx(0.006)
    stored = [e for e in d.drain_events() if e["type"] == "BlockStored"]
    assert sum(len(e["block_hashes"]) for e in stored) >= 5  # received full blocks cached


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_blocks_and_index_consistent(seed: int) -> None:
    rng = random.Random(seed)
    s = sched(num_blocks=rng.choice([12, 24, 48]), max_num_batched_tokens=rng.choice([8, 32]),
              max_num_seqs=rng.choice([2, 4, 8]), timing=PolynomialTiming())
    tr, index, next_id = EventTranslator(BS), KvIndex(), 0
    prefixes = [[rng.randrange(40) for _ in range(8)] for _ in range(3)]
    now = 0.0
    for i in range(60):
        if rng.random() < 0.6:
            s.add(req(f"r{i}", rng.choice(prefixes) + [rng.randrange(40)] * rng.randint(1, 6),
                      max_tokens=rng.randint(1, 8)), now)
        if rng.random() < 0.1 and s.requests:
            s.abort(rng.choice(sorted(s.requests)), now)
        b = s.schedule(now)
        now += b.duration_s
        s.complete(b, now)
        s.blocks.check()
        for raw in s.drain_events():
            for ev in tr.translate(raw):
                index.apply(KvEvent("w", next_id, ev.kind, ev.block_hashes, ev.tier))
                next_id += 1
        assert set(index.dump().get("w", {}).get("device", ())) == s.blocks.cached_hashes()
    drain(s, now)
    assert s.blocks.num_used == 0 and not s.requests


@pytest.mark.parametrize("seed", range(6))
def test_every_computed_full_block_is_cached_after_each_step(seed: int) -> None:
    """A step caches the blocks it filled (chunked prefill, decode, preemption and
    recompute, KV reception, salts): after every step, each live request's computed full
    blocks are cached with its salt's hashes."""
    rng = random.Random(seed)
    s = sched(num_blocks=rng.choice([12, 24, 48]), max_num_batched_tokens=rng.choice([5, 8, 32]),
              max_num_seqs=rng.choice([2, 4, 8]), timing=PolynomialTiming())
    prefixes = [[rng.randrange(40) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    now = 0.0
    for i in range(80):
        if rng.random() < 0.5:
            s.add(req(f"r{i}", rng.choice(prefixes) + [rng.randrange(40)] * rng.randint(1, 6),
                      max_tokens=rng.randint(1, 9), remote_prefill=rng.random() < 0.2,
                      cache_salt=rng.choice(["", "t"])), now)
        b = s.schedule(now)
        ready = s.next_ready_at()
        if b.empty and ready is not None:
            now = max(now, ready)
        now += b.duration_s
        s.complete(b, now)
        s.blocks.check()
        cached = s.blocks.cached_hashes()
        for r in s.requests.values():
            if s.blocks.holds(r.request_id):
                full = r.num_computed // BS * BS
                assert set(s.blocks.hash_blocks(r.tokens[:full], salt=r.cache_salt)) <= cached
    drain(s, now)
    assert s.blocks.num_used == 0 and not s.requests


def test_prompt_hash_packs_the_little_endian_u32_prompt() -> None:
    import struct

    import xxhash

    s = sched(seed=5)
    for prompt in ([1, 2, 3], [0, 2**32 - 1, 70000], [2**32 + 7, -1]):  # last: masked path
        r = req("a", prompt, sampling_seed=9)
        h = xxhash.xxh3_64()
        h.update(struct.pack("<QQ", 5, 9))
        h.update(struct.pack(f"<{len(prompt)}I", *(t & 0xFFFFFFFF for t in prompt)))
        assert s._prompt_hash(r).intdigest() == h.intdigest()


def tokens_of(s: Scheduler, r: SimRequest) -> list[int]:
    """Runs ``r`` alone to its end; its generated tokens."""
    s.add(r, 0.0)
    return [t for o in drain(s)[0][r.request_id] for t in o.token_ids]


def test_token_n_depends_on_every_token_before_it_so_a_resend_continues() -> None:
    prompt = list(range(100, 140))
    full = tokens_of(sched(seed=3), req("a", prompt, max_tokens=12, sampling_seed=4))
    assert len(full) == 12 and len(set(full)) > 1
    for cut in (1, 5, 11):  # migration: prompt + the tokens so far, the rest of max_tokens
        rest = tokens_of(sched(seed=3), req("b", prompt + full[:cut], max_tokens=12 - cut,
                                            sampling_seed=4))
        assert full[:cut] + rest == full
    other = tokens_of(sched(seed=3), req("c", prompt, max_tokens=12, sampling_seed=5))
    assert other != full  # the sampling seed is part of the hash
