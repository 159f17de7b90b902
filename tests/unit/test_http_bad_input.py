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
from services.frontend.json_checks import check_json
from services.frontend.models import ModelCatalog
from services.frontend.openai_schema import ApiError
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
    # a surrogate as raw bytes (json.loads lets them through), and in UTF-16 JSON text
    ("/v1/completions", b'{"model": "m", "prompt": "a\xed\xa0\x80"}', "prompt"),
    ("/v1/completions", '{"model": "m", "prompt": "\\ud800"}'.encode("utf-16"), "prompt"),
    ("/v1/completions", '{"model": "m", "prompt": "\ud800"}'.encode("utf-16-le",
                                                                  "surrogatepass"), "prompt"),
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


def _decodes(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


@pytest.mark.parametrize("raw", [raw for _, raw, _ in CASES if _decodes(raw)] + [
    _completion(), _completion(prompt=list(range(300))), b'{"a": "\\\\ud800"}',
    json.dumps({"model": "m", "prompt": "caf\u00e9 \u2603"}, ensure_ascii=False).encode(),
    b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}", b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}"])
def test_the_json_text_shortcut_answers_as_the_walk(raw: bytes) -> None:
    """check_json with the text the body came from refuses exactly what the walk alone
    refuses, with the same error."""
    body = json.loads(raw)

    def outcome(*args: object) -> tuple[str, str | None] | None:
        try:
            check_json(*args)  # type: ignore[arg-type]
        except ApiError as err:
            return err.message, err.param
        return None
    assert outcome(body, raw) == outcome(body)


def test_plain_ascii_json_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.frontend.json_checks as schema

    def walk(*_: object) -> None:
        raise AssertionError("walked")
    monkeypatch.setattr(schema, "_first_problem", walk)
    check_json({"model": "m", "prompt": [1, 2]}, b'{"model": "m", "prompt": [1, 2]}')
    with pytest.raises(AssertionError):  # a surrogate escape: walked
        check_json({"model": "m\ud800"}, b'{"model": "m\\ud800"}')


def test_a_long_token_list_is_checked_and_a_bad_string_after_it_is_found() -> None:
    ids = list(range(700_000))
    check_json({"model": "m", "prompt": ids})  # numbers only: nothing to refuse
    with pytest.raises(ApiError) as err:
        check_json({"model": "m", "prompt": ids, "stop": ["ok", "bad\ud800"]})
    assert err.value.status == 400 and err.value.param == "stop[1]"
