"""The E/P/D worker configurations :func:`workers.main.build_engine` builds (no engine
started): P reads embeddings (EC consumer) and hands KV over NIXL; D only takes KV (and
the images with the request, under the same image limit). The deployment itself runs in
``tests/integration/test_epd_mesh.py``."""

from __future__ import annotations

import os
from typing import Any

from workers.config import WorkerConfig
from workers.ec import configs as ec
from workers.kv import nixl
from workers.main import build_engine


def _engine_config(**kw: Any) -> Any:
    cfg = WorkerConfig(**{"engine": "vllm", "model_path": "/models/vlm", "nixl_port": 5999,
                          "worker_id": "w1", "max_images": 2, **kw})
    assert cfg.problems() == [], cfg.problems()
    return build_engine(cfg).config  # type: ignore[attr-defined]


def test_prefill_ec_consumer_has_both_connectors() -> None:
    before = dict(os.environ)
    p = _engine_config(role="prefill", ec_role="ec_consumer")
    assert dict(os.environ) == before  # the env is for its EngineCore only
    ecc = p.engine_kwargs["ec_transfer_config"]
    assert (ecc["ec_connector"], ecc["ec_role"]) == (ec.CONNECTOR, "ec_consumer")
    assert p.kv_transfer_config["kv_connector"] == nixl.CONNECTORS["pull"]
    assert p.engine_kwargs["limit_mm_per_prompt"] == {"image": 2}
    assert p.env == {**ec.ec_env(), **nixl.nixl_env(5999)}  # UCX for both NIXL agents


def test_decode_takes_kv_and_images_but_no_embeddings() -> None:
    d = _engine_config(role="decode")
    assert "ec_transfer_config" not in d.engine_kwargs
    assert d.kv_transfer_config["kv_connector"] == nixl.CONNECTORS["pull"]
    assert d.engine_kwargs["limit_mm_per_prompt"] == {"image": 2}  # --max-images holds
    assert d.env == nixl.nixl_env(5999)


def test_aggregated_worker_without_ec_role_keeps_the_image_limit() -> None:
    a = _engine_config(role="agg", max_images=3)
    assert a.kv_transfer_config is None and "ec_transfer_config" not in a.engine_kwargs
    assert a.engine_kwargs["limit_mm_per_prompt"] == {"image": 3}
