"""Frontend API keys: parsing, tenants and salts, the constant-time check, the 401 body.

The HTTP app is the real frontend app over a real (worker-less) pipeline: the key is
checked before the body is read, so no worker is needed to see a 401 (a valid key gets
the pipeline's 404 for the unknown model instead).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.common.config import ConfigError, load_config
from services.frontend import auth
from services.frontend.auth import (
    OPEN,
    ApiKeys,
    KeyFileError,
    Unauthorized,
    key_tenant,
    merge_api_key_flags,
    parse_key_file,
    tenant_salt,
)
from services.frontend.http_api import create_app
from services.frontend.main import FrontendConfig
from services.frontend.models import ModelCatalog
from services.frontend.pipeline import Pipeline

KEY_FILE = """
# team keys
sk-alice-1 alice
sk-alice-2 alice   # a second key of the same tenant
sk-hash#1 carol
sk-bob bob

sk-solo
"""


def test_key_file_lines_comments_and_errors() -> None:
    assert parse_key_file(KEY_FILE) == [("sk-alice-1", "alice"), ("sk-alice-2", "alice"),
                                        ("sk-hash#1", "carol"), ("sk-bob", "bob"),
                                        ("sk-solo", None)]
    with pytest.raises(KeyFileError, match="line 2: expected 'key \\[tenant\\]'"):
        parse_key_file("k t\nk2 t x\n")
    with pytest.raises(KeyFileError, match="#2 is listed twice") as exc:
        ApiKeys.from_sources("sk-a,sk-a")
    assert "sk-a" not in str(exc.value)  # errors never echo a key


def test_tenants_and_salts() -> None:
    keys = ApiKeys.from_sources(" sk-x , sk-y", KEY_FILE)
    assert len(keys) == 7 and keys.enabled
    alice1, alice2 = keys.check("Bearer sk-alice-1"), keys.check("Bearer sk-alice-2")
    assert alice1 == alice2 and alice1.name == "alice"
    assert alice1.cache_salt == hashlib.sha256(b"kvmesh-tenant\0alice").hexdigest()[:16]
    # a key without a tenant is its own: named by its hash, never by the key itself
    x = keys.check("Bearer sk-x")
    assert x.name == key_tenant("sk-x") == hashlib.sha256(b"sk-x").hexdigest()[:16]
    assert x.cache_salt == tenant_salt(x.name) and "sk-x" not in x.cache_salt
    salts = {keys.check(f"Bearer {k}").cache_salt
             for k in ("sk-x", "sk-y", "sk-alice-1", "sk-bob", "sk-solo")}
    assert len(salts) == 5 and "" not in salts
    shared = ApiKeys.from_sources("sk-x", KEY_FILE, shared=True)
    assert {shared.check(f"Bearer {k}").cache_salt for k in ("sk-x", "sk-bob")} == {""}
    assert ApiKeys(()).check(None) is OPEN and OPEN.cache_salt == ""


@pytest.mark.parametrize("header", [None, "", "sk-x", "Basic sk-x", "Bearer", "Bearer ",
                                    "Bearer sk-z", "Bearer sk-x2", "Bearer sk-"])
def test_bad_or_missing_keys_are_refused(header: str | None) -> None:
    keys = ApiKeys.from_sources("sk-x,sk-y")
    with pytest.raises(Unauthorized) as exc:
        keys.check(header)
    assert "sk-x" not in str(exc.value)
    assert keys.check("bearer  sk-y ").name == key_tenant("sk-y")


def test_every_key_is_compared_without_early_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ApiKeys.from_sources("sk-1,sk-2,sk-3")
    for presented in ("sk-1", "sk-3", "nope", "a-much-longer-key-than-the-others"):
        calls.clear()
        try:
            keys.check(f"Bearer {presented}")
        except Unauthorized:
            pass
        assert len(calls) == 3  # first, last or no match: always every key
        # SHA-256 digests on both sides: equal lengths, the key's length leaks nothing
        assert {len(a) for a, _ in calls} == {len(b) for _, b in calls} == {32}


def test_repeated_api_key_flags_fold_into_one_list() -> None:
    argv = ["--api-key", "k1", "--port", "0", "--api-key=k2", "--api-keys", "k3,k4",
            "--api-key-file", "f"]
    assert merge_api_key_flags(argv) == ["--port", "0", "--api-key-file", "f",
                                         "--api-keys", "k1,k2,k3,k4"]
    assert merge_api_key_flags(["--port", "1"]) == ["--port", "1"]


@pytest.mark.parametrize("argv", [["--api-key", ""], ["--api-key= "], ["--api-key", "a,b"]])
def test_an_empty_or_comma_api_key_flag_is_an_error(argv: list[str]) -> None:
    with pytest.raises(KeyFileError, match="--api-key: one non-empty key per flag"):
        merge_api_key_flags(argv)


@pytest.mark.parametrize("keys", [" , ", "a,,b", "a,"])
def test_a_key_list_with_an_empty_item_is_an_error(keys: str) -> None:
    with pytest.raises(ConfigError, match="api_keys: item #. of the key list is empty"):
        load_config(FrontendConfig, [], {"KVMESH_API_KEYS": keys})


def test_a_key_file_without_keys_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="api_key_file .*no key in the file"):
        load_config(FrontendConfig, ["--api-key-file", str(f)], {})


def test_config_flags_env_and_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(KEY_FILE)
    cfg = load_config(FrontendConfig, merge_api_key_flags(
        ["--api-key", "sk-x", "--api-key", "sk-y", "--api-key-file", str(f),
         "--metrics-auth"]), {})
    assert len(cfg.load_api_keys()) == 7 and cfg.metrics_auth
    env = load_config(FrontendConfig, [], {"KVMESH_API_KEYS": "a,b",
                                           "KVMESH_SHARED_PREFIX_CACHE": "1"})
    keys = env.load_api_keys()
    assert len(keys) == 2 and keys.check("Bearer a").cache_salt == ""
    assert not load_config(FrontendConfig, [], {}).load_api_keys().enabled
    with pytest.raises(ConfigError, match="api_key_file .*missing"):
        load_config(FrontendConfig, ["--api-key-file", str(tmp_path / "missing")], {})
    f.write_text("k a b\n")
    with pytest.raises(ConfigError, match="api_key_file .*line 1"):
        load_config(FrontendConfig, ["--api-key-file", str(f)], {})


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    return Pipeline(ModelCatalog(), lambda: None)


def _assert_401(resp: object) -> None:
    assert resp.status_code == 401  # type: ignore[attr-defined]
    assert resp.headers["www-authenticate"] == "Bearer"  # type: ignore[attr-defined]
    err = resp.json()["error"]  # type: ignore[attr-defined]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert err["message"] and "sk-good" not in err["message"]


@pytest.mark.parametrize("metrics_auth", [False, True])
def test_http_401_body_and_open_health(pipeline: Pipeline, metrics_auth: bool) -> None:
    app = create_app(pipeline, keys=ApiKeys.from_sources("sk-good"), metrics_auth=metrics_auth)
    client = TestClient(app)
    body = {"model": "m", "prompt": "hello"}
    for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good"}):
        _assert_401(client.post("/v1/completions", json=body, headers=headers))
        _assert_401(client.post("/v1/chat/completions", headers=headers,
                                json={"model": "m", "messages": []}))
        _assert_401(client.get("/v1/models", headers=headers))
    # refused before the body is read: even garbage gets the 401, not a 400
    _assert_401(client.post("/v1/completions", content=b"{not json"))
    good = {"Authorization": "Bearer sk-good"}
    assert client.post("/v1/completions", json=body, headers=good).status_code == 404
    assert client.get("/v1/models", headers=good).status_code == 200
    assert client.get("/health").status_code == 503  # open (and no workers)
    metrics = client.get("/metrics")
    if metrics_auth:
        _assert_401(metrics)
        assert client.get("/metrics", headers=good).status_code == 200
    else:
        assert metrics.status_code == 200


def test_a_metrics_key_reads_metrics_and_nothing_else(pipeline: Pipeline) -> None:
    client = TestClient(create_app(pipeline, keys=ApiKeys.from_sources("sk-user"),
                                   metrics_auth=True,
                                   metrics_keys=ApiKeys.from_sources("sk-scrape")))
    scrape = {"Authorization": "Bearer sk-scrape"}
    assert client.get("/metrics", headers=scrape).status_code == 200
    assert client.get("/metrics", headers={"Authorization": "Bearer sk-user"}).status_code \
        == 200
    _assert_401(client.get("/metrics"))
    _assert_401(client.get("/v1/models", headers=scrape))  # not a user's key
    _assert_401(client.post("/v1/completions", headers=scrape,
                            json={"model": "m", "prompt": "x"}))


def test_http_without_keys_is_open(pipeline: Pipeline) -> None:
    client = TestClient(create_app(pipeline))
    assert client.get("/v1/models").status_code == 200
    assert client.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 404
