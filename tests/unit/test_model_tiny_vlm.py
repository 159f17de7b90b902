"""Unit tests for workers.model.tiny_vlm: the locally built tiny Idefics3 (no network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workers.model import tiny, tiny_vlm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_vlm.ensure_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-idefics3")


def test_config(vlm_dir: Path) -> None:
    cfg = json.loads((vlm_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Idefics3ForConditionalGeneration"]
    assert cfg["vision_config"]["num_hidden_layers"] == 2
    assert cfg["vision_config"]["image_size"] == 64
    vocab = cfg["text_config"]["vocab_size"]
    assert 0 <= cfg["pad_token_id"] < vocab and 0 <= cfg["text_config"]["pad_token_id"] < vocab
    assert cfg["image_token_id"] < vocab
    assert tiny_vlm.is_complete(vlm_dir)
    assert not tiny_vlm.is_complete(vlm_dir, seed=tiny_vlm.DEFAULT_SEED + 1)


def test_processor_four_image_tokens_without_torchvision(vlm_dir: Path) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(vlm_dir))
    assert type(proc.image_processor).__name__ == "Idefics3ImageProcessorPil"
    image = Image.fromarray(np.zeros((100, 80, 3), dtype=np.uint8))
    out = proc(text=[tiny_vlm.prompt("What is it?")], images=[[image]], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    image_id = proc.tokenizer.convert_tokens_to_ids(tiny_vlm.IMAGE_TOKEN)
    assert ids.count(image_id) == tiny_vlm.IMAGE_SEQ_LEN == 4
    assert tuple(out["pixel_values"].shape) == (1, 1, 3, 64, 64)  # no image splitting
    assert ids[0] == tiny.BOS_ID


def test_generate_runs(vlm_dir: Path) -> None:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    proc = AutoProcessor.from_pretrained(str(vlm_dir))
    model: Any = Idefics3ForConditionalGeneration.from_pretrained(str(vlm_dir),
                                                                  dtype=torch.float32)
    image = Image.fromarray(np.full((64, 64, 3), 200, dtype=np.uint8))
    inputs = proc(text=[tiny_vlm.prompt("Hi")], images=[[image]], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


def test_same_seed_identical_bytes(vlm_dir: Path, tmp_path: Path) -> None:
    again = tiny_vlm.build_tiny_vlm(tmp_path)
    assert (again / "model.safetensors").read_bytes() == (
        vlm_dir / "model.safetensors").read_bytes()


def test_idempotent(vlm_dir: Path) -> None:
    before = (vlm_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_vlm.ensure_tiny_vlm(vlm_dir) == vlm_dir
    assert (vlm_dir / "model.safetensors").stat().st_mtime_ns == before
