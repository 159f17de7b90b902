"""Unit tests for workers.model.tiny: the locally generated tiny Llama folder (no network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from workers.model import paths, tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_folder_layout(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", tiny.MARKER,
    } <= names
    assert not any(p.name.startswith(".tiny-llama.") for p in tiny_dir.parent.iterdir())
    assert tiny.is_complete(tiny_dir)
    assert not tiny.is_complete(tiny_dir, seed=tiny.DEFAULT_SEED + 1)


def test_config_and_special_ids(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_dir / "config.json").read_text())
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == "float32"
    assert cfg["vocab_size"] == len(tok)
    assert 512 <= len(tok) <= 1024
    assert cfg["num_attention_heads"] * cfg["head_dim"] == 128
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == cfg["eos_token_id"] == gen["eos_token_id"] == tiny.EOS_ID
    assert tok.bos_token_id == cfg["bos_token_id"] == tiny.BOS_ID
    assert tok.convert_tokens_to_ids("<|endoftext|>") == tiny.PAD_ID


def test_tokenizer_round_trip(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for text in ["Hello world! The capital of France is Paris.", "  x = 42;\n\tünïcode 🚀 ok"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # Merges were learnt: common words are shorter than their byte count.
    assert len(tok.encode("the teacher reads the morning news")) < 20
    # Special tokens are single ids.
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == tiny.BOS_ID


def test_chat_template(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert plain == text.removesuffix("<|im_start|>assistant\n")


def test_weights_float32_and_forward(tiny_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    state = load_file(tiny_dir / "model.safetensors")
    assert state and all(t.dtype == torch.float32 for t in state.values())
    assert "lm_head.weight" in state
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    logits = model(torch.tensor([[1, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size)


def test_same_seed_identical_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_other_seed_differs(tiny_dir: Path, tmp_path: Path) -> None:
    other = tiny.ensure_tiny_model(tmp_path / "t", seed=7)
    assert tiny.is_complete(other, seed=7)
    assert (other / "model.safetensors").read_bytes() != (
        tiny_dir / "model.safetensors"
    ).read_bytes()


def test_idempotent(tiny_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    assert tiny.ensure_tiny_model(tiny_dir) == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before


def test_incomplete_folder_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert tiny.ensure_tiny_model(target) == target
    assert tiny.is_complete(target)
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_default_path_uses_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    assert paths.cache_dir() == tmp_path
    assert paths.models_dir() == tmp_path / "models"
    monkeypatch.delenv("KVMESH_CACHE_DIR")
    assert paths.cache_dir() == Path("~/.cache/kvmesh").expanduser()


TOOLS_FREE_CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": ""},
     {"role": "tool", "content": "sunny"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "  spaces \n and ünïcode 🚀 <|im_end|> inside "}],
]


@pytest.mark.parametrize("generation", [True, False])
def test_tools_free_chats_render_as_format_version_1(tiny_dir: Path,
                                                     generation: bool) -> None:
    """Version 2's tools branch changes nothing for a chat without tools: the same token
    ids as the version-1 ChatML template, with and without the generation prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.chat_template == tiny.CHATML_TEMPLATE != tiny.CHATML_TEMPLATE_V1
    for msgs in TOOLS_FREE_CHATS:
        new = tok.apply_chat_template(msgs, add_generation_prompt=generation,
                                      return_dict=False)
        old = tok.apply_chat_template(msgs, add_generation_prompt=generation,
                                      chat_template=tiny.CHATML_TEMPLATE_V1,
                                      return_dict=False)
        assert list(new) == list(old) and len(old) > 2, msgs


def test_chat_template_renders_tools_hermes_style(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tool: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tok.apply_chat_template(msgs, tools=[tool], tokenize=False,
                                   add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n" + tiny.TOOLS_SYSTEM_HEAD + "\n"
        + json.dumps(tool) + tiny.TOOLS_SYSTEM_TAIL + "<|im_end|>\n"
        "<|im_start|>user\nHi?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\nsunny<|im_end|>\n"
        "<|im_start|>assistant\n")
    # without a system message the tools get their own
    alone = str(tok.apply_chat_template(msgs[1:2], tools=[tool], tokenize=False,
                                        add_generation_prompt=True))
    assert alone.startswith("<|im_start|>system\n# Tools\n") and alone.endswith(
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
