"""The frontend's model catalog: served models from discovery, with their tokenizers.

Contract:

- ``update(records)`` replaces the catalog from live worker records; a model exists while
  at least one worker serves it. Tokenizers stay cached by model folder; a model folder
  seen for the first time starts loading its tokenizer in a background thread at once,
  so the first request does not pay for importing and loading it (seconds).
- ``get(name)`` returns :class:`ModelInfo` or None.
- ``tokenizer(info)`` loads (once, from the model folder on local disk; never from a hub)
  and returns a :class:`Tokenizer`; ``loaded_tokenizer(info)`` returns it only if it is
  loaded already (None otherwise), without blocking; ``await eos_token_ids(info)``: its
  EOS ids (loading it in a thread if need be), None when it cannot be loaded (not tried
  again for that folder).
- :class:`Tokenizer` encodes prompts (``await encode_off_loop(...)``: the same ids,
  tokenized off the event loop by :mod:`.encode_thread`), names the model's EOS ids as
  vLLM takes them (``eos_token_ids``: the tokenizer's EOS plus ``generation_config.json``'s), spells
  tokens as vLLM's log-probabilities do (``token_texts``) and renders chat messages with
  the model's own chat
  template (``add_generation_prompt=True``); a message whose content is parts (images)
  is rendered as the template's ``[{"type": "text", ...}, {"type": "image"}]`` list.
  Tool calling (:mod:`.tools`): ``apply_chat(..., extras=, tools=)`` merges
  ``extras[i]`` (an assistant's ``tool_calls``, a tool message's ``tool_call_id``) into
  message i's dict and hands ``tools`` (the OpenAI chat tool dicts) to the template;
  without them the template's arguments are exactly as before. ``tool_support()`` is
  what the template renders (:func:`.tools.template_support`), probed once per model.
- ``ModelInfo.accepts_images``: some worker of the model lists the capability ``images``.
  ``expander(info)``: the model's :class:`~services.frontend.images.ImageExpander`
  (loaded once, blocking: call from a thread); ValueError when it has none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from protos import discovery_pb2
from services.frontend import tools as tool_calls
from services.frontend.encode_thread import EncodeThread
from services.frontend.images import ImageExpander

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """One served model."""

    name: str
    model_path: str
    max_model_len: int
    block_size: int
    num_workers: int
    created: int
    accepts_images: bool = False


def _eos_token_ids(model_path: str, tokenizer_eos: int | None) -> frozenset[int]:
    ids = set() if tokenizer_eos is None else {int(tokenizer_eos)}
    try:
        with open(os.path.join(model_path, "generation_config.json"), encoding="utf-8") as fh:
            found = json.load(fh).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        found = None
    for x in found if isinstance(found, list) else [found]:
        if isinstance(x, int) and not isinstance(x, bool):
            ids.add(x)
    return frozenset(ids)


def tokenize_on_calling_threads() -> None:
    """Sets ``TOKENIZERS_PARALLELISM=false`` for this process unless it is set already:
    the frontend hands its tokenizers one prompt at a time (:mod:`.encode_thread`), and
    on rayon's pool each costs a hand-over and idle threads spinning (perf at concurrency
    8: the tokenizer threads took 32% of the frontend's CPU samples with it, 27%
    without). The frontend's ``main`` calls it; an operator's value is kept."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _plain_backend(tok: Any) -> Any:
    """A private copy of the ``tokenizers.Tokenizer`` behind ``tok`` when calling it
    directly gives what ``tok.encode(text)`` gives, else None. That holds for
    transformers' plain fast tokenizer class (no subclass reworking the text or the ids)
    whose backend truncates and pads nothing and splits special tokens as ``tok`` says:
    then ``tok.encode`` only wraps one backend call in Python (~0.1 ms per prompt here).
    The copy keeps it so: a later HF call that leaves truncation or special-token
    splitting set on the shared backend (``tok`` goes to vLLM's tool parsers) does not
    reach it."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: always through tok.encode
        return None
    backend = getattr(tok, "_tokenizer", None)
    if (backend is None or not getattr(tok, "is_fast", False)
            or type(tok)._encode_plus is not TokenizersBackend._encode_plus
            or type(tok).encode is not TokenizersBackend.encode):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if bool(backend.encode_special_tokens) != bool(getattr(tok, "split_special_tokens", False)):
        return None
    own = type(backend).from_str(backend.to_str())
    own.encode_special_tokens = backend.encode_special_tokens
    return own


class Tokenizer:
    """A local Hugging Face tokenizer plus chat template."""

    def __init__(self, model_path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self._eos_ids = _eos_token_ids(model_path, self._tok.eos_token_id)
        self._backend = _plain_backend(self._tok)
        self._thread = EncodeThread(self._backend) if self._backend is not None else None

    async def encode_off_loop(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode``'s ids, computed on the tokenizer's :class:`EncodeThread` (after the
        prompts submitted before) when ``encode`` goes straight to the Rust backend, else
        here."""
        if self._thread is not None:
            return await self._thread.encode(text, add_special_tokens)
        return self.encode(text, add_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a request unless ``ignore_eos``, as vLLM's engine takes them:
        the tokenizer's EOS and ``generation_config.json``'s ``eos_token_id`` (one id or a
        list; an unreadable file adds none)."""
        return self._eos_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a raw prompt, with the model's BOS if it adds one (and
        ``add_special_tokens``): exactly what the Hugging Face tokenizer's ``encode``
        gives, straight from its Rust backend when nothing in between can change them
        (see :func:`_plain_backend`)."""
        if self._backend is not None:
            # encode_batch*, unlike encode, let go of the GIL; _fast skips the character
            # offsets (unused here): ~25% less CPU per prompt, the same ids
            return self._backend.encode_batch_fast(  # type: ignore[no-any-return]
                [text], add_special_tokens=add_special_tokens)[0].ids
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    @property
    def hf(self) -> Any:
        """The Hugging Face tokenizer (what vLLM's tool parser takes)."""
        return self._tok

    def apply_chat(self, messages: Sequence[tuple[str, Any]], *,
                   add_generation_prompt: bool = True,
                   continue_final_message: bool = False,
                   add_special_tokens: bool = False,
                   extras: Mapping[int, Mapping[str, Any]] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the chat-templated conversation, by default ending with the
        assistant prompt (content parts, extras and tools: see the module docstring);
        the keywords are the chat template's (``continue_final_message``: the last
        message left open; ``add_special_tokens``: the tokenizer's BOS on top of the
        template's). ``encode(render_chat(...), add_special_tokens)``."""
        return self.encode(self.render_chat(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, extras=extras, tools=tools),
            add_special_tokens)

    def render_chat(self, messages: Sequence[tuple[str, Any]], *,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    extras: Mapping[int, Mapping[str, Any]] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's text of the conversation (``apply_chat`` before encoding;
        the same keywords)."""
        def content(c: Any) -> Any:
            if isinstance(c, str):
                return c
            if c is None:
                return ""
            return [{"type": "text", "text": text} if kind == "text" else {"type": kind}
                    for kind, text in c]

        more = extras or {}
        kwargs: dict[str, Any] = {} if tools is None else {"tools": tools}
        return str(self._tok.apply_chat_template(
            [{"role": r, "content": content(c), **more.get(i, {})}
             for i, (r, c) in enumerate(messages)],
            tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs,
        ))

    def tool_support(self) -> tool_calls.TemplateSupport:
        """What the chat template renders of tools (probed once; see the module doc)."""
        if not hasattr(self, "_tool_support"):
            def render(messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None) -> str:
                kwargs: dict[str, Any] = {} if tools is None else {"tools": tools}
                return str(self._tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **kwargs))

            self._tool_support = tool_calls.template_support(render)
        return self._tool_support

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string (the vocabulary's spelling, e.g. ``Ġworld``)."""
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(ids))]

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded alone, as vLLM spells tokens in log-probabilities
        (``convert_ids_list_to_tokens``: ``decode([id])``, with the leading spaces a
        SentencePiece ``Metaspace`` piece stands for restored). Unlike vLLM, a token that
        is part of a multi-byte character is not corrected from its neighbours: it keeps
        its replacement character."""
        texts = [str(self._tok.decode([i]) or "") for i in ids]
        marker = self._space_marker()
        if marker is None:
            return texts
        out = []
        for raw, text in zip(self._tok.convert_ids_to_tokens(list(ids)), texts, strict=True):
            lead = len(raw or "") - len((raw or "").lstrip(marker))
            have = len(text) - len(text.lstrip(" "))
            out.append(" " * (lead - have) + text if lead > have else text)
        return out

    def _space_marker(self) -> str | None:
        """The Metaspace replacement character of the tokenizer, or None."""
        if not hasattr(self, "_marker"):
            marker = None
            backend = getattr(self._tok, "backend_tokenizer", None)
            if backend is not None:
                pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
                subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
                marker = next((p.get("replacement", "\u2581") for p in subs
                               if p.get("type") == "Metaspace"), None)
            self._marker: str | None = marker
        return self._marker

    @property
    def vocab_size(self) -> int:
        return len(self._tok)


class ModelCatalog:
    """Models served by live workers."""

    def __init__(self) -> None:
        self._models: dict[str, ModelInfo] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        self._expanders: dict[str, ImageExpander] = {}
        self._lock = threading.Lock()
        self._warming: set[str] = set()
        self._no_tokenizer: set[str] = set()  # folders whose tokenizer failed to load

    def update(self, records: Iterable[discovery_pb2.InstanceRecord]) -> None:
        """Rebuilds the catalog from worker records."""
        models: dict[str, ModelInfo] = {}
        for r in records:
            prev = models.get(r.model)
            created = int(r.started_at_ms // 1000)
            images = "images" in r.capabilities
            if prev is None:
                models[r.model] = ModelInfo(r.model, r.model_path, r.max_model_len, r.block_size,
                                            1, created, images)
            else:
                models[r.model] = replace(
                    prev, max_model_len=min(prev.max_model_len, r.max_model_len),
                    num_workers=prev.num_workers + 1, created=min(prev.created, created),
                    accepts_images=prev.accepts_images or images)
        self._models = models
        for info in models.values():
            if info.model_path and info.model_path not in self._warming:
                self._warming.add(info.model_path)
                threading.Thread(target=self._warm, args=(info,), daemon=True,
                                 name=f"tokenizer-{info.name}").start()

    def _warm(self, info: ModelInfo) -> None:
        try:
            self.tokenizer(info)
        except Exception:  # noqa: BLE001 - the request path reports it (and retries);
            # the path stays in _warming so discovery updates do not start it again
            log.debug("tokenizer warm-up of %s failed", info.model_path)

    def on_workers(self, instances: dict[str, discovery_pb2.InstanceRecord]) -> None:
        """Discovery listener."""
        self.update(instances.values())

    def get(self, name: str) -> ModelInfo | None:
        return self._models.get(name)

    def all(self) -> list[ModelInfo]:
        return sorted(self._models.values(), key=lambda m: m.name)

    def expander(self, info: ModelInfo) -> ImageExpander:
        """The model's image expander (blocking on first use; call from a thread)."""
        with self._lock:
            exp = self._expanders.get(info.model_path)
            if exp is None:
                exp = self._expanders[info.model_path] = ImageExpander(info.model_path)
            return exp

    def loaded_tokenizer(self, info: ModelInfo) -> Tokenizer | None:
        """The model's tokenizer if it is loaded already (never blocks), else None."""
        return self._tokenizers.get(info.model_path)

    async def eos_token_ids(self, info: ModelInfo) -> frozenset[int] | None:
        """The model's :attr:`Tokenizer.eos_token_ids`, loading the tokenizer in a thread
        when it is not loaded yet; None when it cannot be loaded (logged, and not tried
        again for that folder)."""
        tok = self.loaded_tokenizer(info)
        if tok is None:
            if info.model_path in self._no_tokenizer:
                return None
            try:
                tok = await asyncio.to_thread(self.tokenizer, info)
            except Exception as exc:  # noqa: BLE001 - the caller goes on without the ids
                self._no_tokenizer.add(info.model_path)
                log.warning("model %s: no tokenizer at %s (%s): its EOS ids are unknown",
                            info.name, info.model_path, exc)
                return None
        return tok.eos_token_ids

    def tokenizer(self, info: ModelInfo) -> Tokenizer:
        """The model's tokenizer (blocking on first use; call from a thread)."""
        with self._lock:
            tok = self._tokenizers.get(info.model_path)
            if tok is None:
                tok = self._tokenizers[info.model_path] = Tokenizer(info.model_path)
            return tok
