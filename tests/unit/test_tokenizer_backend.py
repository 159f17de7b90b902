"""The frontend's Tokenizer.encode goes straight to the Rust backend only when that gives
exactly the Hugging Face tokenizer's ids (services.frontend.models._plain_backend)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.frontend.models import Tokenizer, _plain_backend
from workers.model import tiny
from workers.model.prepare import prepare_smollm2
from workers.model.tiny_vlm import ensure_tiny_vlm

TEXTS = [
    "", " ", "hello", "Hello, world!  Two  spaces\tand a tab\nand lines\n\n",
    "naïve café – 東京 🙂 ", "<s> not really a bos </s>", "<|im_start|>user\nhi<|im_end|>",
    "word " * 300, "x" * 2000, "1234567890 3.14159 -42 0x1F",
]


@pytest.fixture(scope="module", params=["tiny", "smollm2", "tiny-vlm"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Tokenizer:
    if request.param == "tiny":
        path: Path = tiny.ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
    elif request.param == "tiny-vlm":
        path = ensure_tiny_vlm()
    else:
        path = prepare_smollm2(progress=False)
    return Tokenizer(str(path))


def test_backend_is_used_and_gives_the_hf_ids(tok: Tokenizer) -> None:
    assert tok._backend is not None
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == \
                list(tok.hf.encode(text, add_special_tokens=special)), (text, special)


def test_backend_is_not_used_when_it_would_differ(tok: Tokenizer) -> None:
    hf = tok.hf
    backend = hf._tokenizer
    backend.enable_truncation(8)
    try:
        assert _plain_backend(hf) is None  # the HF encode would not truncate
    finally:
        backend.no_truncation()
    hf.split_special_tokens = True
    try:
        assert _plain_backend(hf) is None
    finally:
        hf.split_special_tokens = False
    own = _plain_backend(hf)
    assert own is not None and own is not backend

    class Reworked(type(hf)):  # type: ignore[misc]
        def _encode_plus(self, *args: object, **kwargs: object) -> object:
            raise AssertionError("not reached")

    hf.__class__, cls = Reworked, hf.__class__
    try:
        assert _plain_backend(hf) is None
    finally:
        hf.__class__ = cls


def test_state_left_on_the_shared_backend_does_not_reach_encode(tok: Tokenizer) -> None:
    """vLLM's tool parsers get ``tok.hf``: truncation or special-token splitting left on
    its backend by some later call must not change what the frontend sends."""
    text = "<|im_start|>user\n" + "word " * 64
    want = list(tok.hf.encode(text))
    backend = tok.hf._tokenizer
    backend.enable_truncation(8)
    backend.encode_special_tokens = True
    try:
        assert tok.encode(text) == want and len(want) > 8
    finally:
        backend.no_truncation()
        backend.encode_special_tokens = False


def test_no_fast_tokenizer_means_no_backend() -> None:
    class Slow:
        is_fast = False
        _tokenizer = object()

    assert _plain_backend(Slow()) is None
