"""Bad HTTP input gets a 400 naming the field, never a 500, and the server keeps serving.

The inputs are the ones that used to escape validation: integers beyond their protobuf
field's range, lone surrogates, JSON nested a thousand deep, 5,000-digit integers.
The app is the real frontend app over a real (worker-less) pipeline: validation runs
before any model lookup or routing.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from services.frontend.http_api import create_app
from services.frontend.models import ModelCatalog
from services.frontend.openai_schema import ApiError, check_json
from services.frontend.pipeline import Pipeline


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(Pipeline(ModelCatalog(), lambda: None)))


def _completion(**fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "x", **fields}).encode()


CASES = [
    ("/v1/completions", _completion(seed=2**63), "seed"),
    ("/v1/completions", _completion(seed=-(2**63) - 1), "seed"),
    ("/v1/completions", _completion(top_k=2**31), "top_k"),
    ("/v1/completions", _completion(max_tokens=2**31), "max_tokens"),
    ("/v1/completions", _completion(prompt=[1, 2**31]), "prompt"),
    ("/v1/completions", _completion(prompt=[-1]), "prompt"),
    ("/v1/completions", b'{"model": "m\\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", b'{"model": "m", "prompt": "a\\udfffb"}', "prompt"),
    ("/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages[0].content"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "stop": ["\\udc00"]}', "stop[0]"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "x": ' + b"[" * 100 + b"]" * 100
     + b"}", "x"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "x": ' + b"[" * 1000 + b"]" * 1000
     + b"}", None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", None),
    ("/v1/completions", _completion(temperature=float("nan")), "temperature"),
    ("/v1/completions", _completion(top_p=float("inf")), "top_p"),
]


@pytest.mark.parametrize("path,raw,param", CASES)
def test_bad_input_is_a_400_naming_the_field(client: TestClient, path: str, raw: bytes,
                                             param: str | None) -> None:
    resp = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    # the same app still answers (the real keep-alive connection: test_frontend_limits)
    assert client.get("/v1/models").status_code == 200


def test_valid_extremes_pass_validation(client: TestClient) -> None:
    """The largest in-range values are not refused by validation (404: no such model)."""
    for raw in (_completion(seed=2**63 - 1), _completion(top_k=2**31 - 1),
                _completion(prompt=[0, 2**31 - 1])):
        resp = client.post("/v1/completions", content=raw,
                           headers={"Content-Type": "application/json"})
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


def test_a_long_token_list_is_checked_and_a_bad_string_after_it_is_found() -> None:
    ids = list(range(700_000))
    check_json({"model": "m", "prompt": ids})  # numbers only: nothing to refuse
    with pytest.raises(ApiError) as err:
        check_json({"model": "m", "prompt": ids, "stop": ["ok", "bad\ud800"]})
    assert err.value.status == 400 and err.value.param == "stop[1]"
