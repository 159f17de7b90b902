"""The launcher CLI's client side: which API key it sends, and that it sends it."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher.cli import _client_key, _first_model


def test_the_client_key_comes_from_the_flag_then_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_API_KEY", raising=False)
    monkeypatch.delenv("KVMESH_API_KEYS", raising=False)
    assert _client_key("") == ""
    monkeypatch.setenv("KVMESH_API_KEYS", " k1 ,k2")
    assert _client_key("") == "k1"
    monkeypatch.setenv("KVMESH_API_KEY", "solo")
    assert _client_key("") == "solo" and _client_key("flag") == "flag"


class _Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        ok = self.headers.get("Authorization") == "Bearer sk-1"
        body = json.dumps({"data": [{"id": "m"}]} if ok else {"error": {}}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def models_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def test_the_first_model_is_asked_with_the_key(models_url: str) -> None:
    assert _first_model(models_url, "sk-1") == "m"
    with pytest.raises(OSError, match="401"):  # urllib's HTTPError: an OSError
        _first_model(models_url, "")


def test_kvmesh_up_gives_its_planner_a_metrics_only_key() -> None:
    from services.launcher.up import scrape_keys

    front, planner = scrape_keys({"KVMESH_API_KEYS": "sk-user"}, lambda: "fresh")
    assert front == {"KVMESH_METRICS_API_KEYS": "fresh"}  # never a user's key
    assert planner == {"KVMESH_FRONTEND_API_KEY": "fresh"}
    front, planner = scrape_keys({"KVMESH_FRONTEND_API_KEY": "given",
                                  "KVMESH_METRICS_API_KEYS": "other"}, lambda: "unused")
    assert front == {"KVMESH_METRICS_API_KEYS": "other,given"}
    assert planner == {"KVMESH_FRONTEND_API_KEY": "given"}


def test_epd_flags_default_to_the_tiny_vlm_and_are_checked(tmp_path: Path) -> None:
    from services.common.config import from_args
    from services.launcher.cli import build_parser
    from services.launcher.up import MeshSpec

    args = build_parser({"KVMESH_EPD": "1", "KVMESH_ENCODERS": "2"}).parse_args(["up"])
    spec = from_args(MeshSpec, args)
    assert (spec.epd, spec.encoders, spec.served_model()) == (True, 2, "tiny-vlm")
    assert spec.problems() == []
    assert MeshSpec().served_model() == "smollm2"  # without --epd: as before
    assert MeshSpec(epd=True, model="tiny").served_model() == "tiny"
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text('{"vision_config": {}, "text_config": {}}')
    assert MeshSpec(epd=True, model=str(vlm)).problems() == []
    cases = {
        "smollm2": "--epd (KVMESH_EPD) needs a multimodal model, but --model (KVMESH_MODEL) "
                   "'smollm2' is a text-only model",
        str(tmp_path): "its config.json has no vision_config",
        str(tmp_path / "nowhere"): "has no readable config.json",
    }
    for model, words in cases.items():
        (problem,) = MeshSpec(epd=True, model=model).problems()
        assert words in problem, problem
    (problem,) = MeshSpec(epd=True, engine="mock").problems()
    assert "--epd (KVMESH_EPD) needs --engine (KVMESH_ENGINE) vllm" in problem
    (problem,) = MeshSpec(encoders=2).problems()
    assert problem == "--encoders (KVMESH_ENCODERS) (2) needs --epd (KVMESH_EPD)"
    (problem,) = MeshSpec(epd=True, encoders=0).problems()
    assert problem == "--encoders (KVMESH_ENCODERS) must be >= 1, got 0"


def test_sglang_engine_hands_off_through_its_bootstrap_and_refuses_push(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from services.launcher.up import MeshSpec
    from workers.engines.sglang import server

    monkeypatch.setattr(server, "sglang_python", lambda repo_root=None: Path("/venv/python"))
    spec = MeshSpec(engine="sglang")
    assert spec.problems() == []
    assert [spec.worker_handoff(r) for r in ("prefill", "decode", "agg")] == [
        "sglang", "sglang", "none"]
    assert MeshSpec(handoff="push").worker_handoff("decode") == "push"
    (problem,) = MeshSpec(engine="sglang", handoff="push").problems()
    assert "--handoff (KVMESH_HANDOFF) push is vLLM's" in problem
    monkeypatch.setattr(server, "sglang_python", lambda repo_root=None: None)
    (problem,) = MeshSpec(engine="sglang").problems()
    assert "needs the SGLang venv: run `make sglang`" in problem


def test_epd_workers_read_embeddings_only_where_they_prefill() -> None:
    from services.launcher.up import LocalMesh, MeshSpec

    epd = LocalMesh(MeshSpec(epd=True))
    assert {r: epd.ec_env(r)["KVMESH_EC_ROLE"] for r in ("agg", "prefill", "decode")} == {
        "agg": "ec_consumer", "prefill": "ec_consumer", "decode": ""}
    plain = LocalMesh(MeshSpec())
    assert {plain.ec_env(r)["KVMESH_EC_ROLE"] for r in ("agg", "prefill", "decode")} == {""}


def test_frontend_replicas_with_embedded_routers_refuse_admission_control() -> None:
    from services.launcher.up import MeshSpec

    (problem,) = MeshSpec(frontends=2, router="embedded", insecure=True,
                          admission="early").problems()
    assert problem.startswith("--frontends (KVMESH_FRONTENDS) 2 with --router "
                              "(KVMESH_ROUTER) embedded and --admission (KVMESH_ADMISSION) "
                              "early is not supported"), problem
    assert MeshSpec(frontends=2, router="embedded", insecure=True).problems() == []
    assert MeshSpec(frontends=2, admission="early").problems() == []  # one router process
    assert MeshSpec(frontends=0).problems() == [
        "--frontends (KVMESH_FRONTENDS) must be >= 1, got 0"]
