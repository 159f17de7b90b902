"""bench.store helpers: kvmesh / Mooncake ratios (matched by (size, batch), error rows
skipped), prompt vocabularies, and what of Mooncake's environment vLLM gets to see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.store.mooncake_vllm import expose_mooncake
from bench.store.reuse import vocab_of
from bench.store.run import ratios, ttft_ratios


def row(size: int, batch: int, gbps: float, ops: float) -> dict[str, float]:
    return {"size": size, "batch": batch, "put_gbps": gbps, "get_gbps": 2 * gbps,
            "put_ops": ops, "get_ops": 2 * ops}


def test_ratios_pair_rows_by_shape_and_skip_errors() -> None:
    ours = [row(64, 8, 1.0, 100.0), row(1024, 8, 3.0, 30.0), row(64, 1, 0.5, 50.0)]
    theirs = [row(64, 1, 0.25, 10.0), row(64, 8, 2.0, 400.0),
              {"size": 1024, "batch": 8, "error": "put failed"}]
    out = ratios(ours, theirs)
    assert [(r["size"], r["batch"]) for r in out] == [(64, 8), (64, 1)]
    assert out[0]["put_gbps"] == pytest.approx(0.5) and out[0]["get_ops"] == pytest.approx(0.25)
    assert out[1]["put_ops"] == pytest.approx(5.0)


def test_no_ratios_when_mooncake_failed_as_a_whole() -> None:
    assert ratios([row(64, 8, 1.0, 1.0)], {"error": "mooncake node did not start"}) == []
    assert ratios([row(64, 8, 1.0, 1.0)], None) == []


def test_vocab_of_reads_the_models_vocab_size(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    assert vocab_of(tmp_path) == (100, 20000)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 768}))
    assert vocab_of(tmp_path) == (100, 768)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    assert vocab_of(tmp_path) == (3, 50)


def test_only_mooncake_and_its_libs_are_exposed(tmp_path: Path) -> None:
    site, into = tmp_path / "site", tmp_path / "into"
    for name in ("mooncake", "mooncake_transfer_engine_non_cuda.libs", "numpy", "aiohttp"):
        (site / name).mkdir(parents=True)
    into.mkdir()
    expose_mooncake(site, into)
    assert sorted(p.name for p in into.iterdir()) == [
        "mooncake", "mooncake_transfer_engine_non_cuda.libs"]
    assert (into / "mooncake").resolve() == (site / "mooncake").resolve()


def test_ttft_ratios_match_prefixes_whatever_their_key_type() -> None:
    result = {"store_hit": {1024: 0.2, 2048: 0.3}, "store_l1_hit": {1024: 0.1},
              "mooncake_connector": {"mooncake_hit": {"1024": 0.4, "2048": 0.0}}}
    assert ttft_ratios(result) == {"store": {"1024": pytest.approx(0.5)},
                                   "store_l1": {"1024": pytest.approx(0.25)},
                                   "store_embedded": {}}
    assert ttft_ratios({"store_hit": {1024: 0.2}}) == {
        "store": {}, "store_l1": {}, "store_embedded": {}}
