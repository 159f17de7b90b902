"""The engine interface every worker engine implements (vLLM, mock, SGLang, ...).

Contract, method by method:

- ``start()``: loads the model and makes the engine ready. Called once, before any
  other coroutine. Raises on failure; the worker then exits.
- ``info``: static facts about the engine (model name, model folder, block size,
  context length, KV layout, P/D handoff coordinates). Valid after ``start()``.
- ``generate(request)``: async iterator of :class:`EngineOutput` deltas for one request.
  The last item has ``finished=True`` and a ``finish_reason``. If the consumer stops
  iterating early (client cancel), the engine must abort the request and free its KV.
  Raises :class:`EngineError` for a request the engine refuses (e.g. prompt too long),
  :class:`EngineDeadError` (in flight, or at once) once the engine has died, and
  :class:`EngineUnavailableError` (in flight, or at once) when the engine lives but
  cannot serve the request now (a peer it needs is gone).
  ``request.kv_transfer_params`` go to the engine's KV connector unchanged; the
  connector's answer comes back on the final output's ``kv_transfer_params``.
  ``request.cache_salt`` (non-empty) isolates the request's prefix cache: its blocks
  are hits only for requests with the same salt, and its KV events let the relay
  compute the salted kvmesh hashes (vLLM: ``extra_keys`` of the first block).
- ``abort(request_id)``: aborts a running request; returns False if unknown.
- ``load()``: cheap, non-blocking snapshot of the engine's load.
- ``counters()``: cumulative counters (prefix hits, KV transfers and bytes, ...).
- ``reset_prefix_cache()``: drops every cached block that no request uses; True when the
  cache is now empty (the engine then announces AllBlocksCleared on its KV event bus).
  Default: unsupported, False.
- ``wait_dead()``: returns (a short reason) once the engine has died on its own (e.g.
  vLLM's EngineCore process exited); never returns while the engine lives, nor because
  of ``shutdown()``. Several waiters may wait; all get the same reason. A worker that
  sees it stops serving and exits non-zero so its supervisor restarts it (see
  :mod:`workers.main`). Default: never returns (an engine that cannot die on its own).
- ``shutdown()``: stops the engine and frees its resources. Idempotent.

:func:`validate_sampling` checks a :class:`Sampling` before any engine sees it (the
worker servicer calls it): :class:`EngineError` naming the field for ``max_tokens < 1``,
a NaN or infinite float, ``temperature < 0``, ``top_p`` outside (0, 1], ``top_k < -1``,
``presence_penalty``/``frequency_penalty`` outside [-2, 2], ``repetition_penalty <= 0``
or a negative stop token id (OpenAI's and vLLM's ranges). Seeds are not checked: any
int64 is a valid seed (vLLM reads -1 as none). The optional features
(:data:`OPTIONAL_FEATURES`): ``logprobs``/``prompt_logprobs`` outside [0,
:data:`MAX_LOGPROBS`] (vLLM's default ``max_logprobs``), a ``logit_bias`` id < 0 or a
bias outside [-100, 100] or not finite, ``min_tokens`` < 0 or > ``max_tokens``,
``min_p`` outside [0, 1], ``bad_words`` (blank, or over :data:`MAX_BAD_WORDS` /
:data:`MAX_BAD_WORD_BYTES`), ``allowed_token_ids`` (negative, or over
:data:`MAX_ALLOWED_TOKEN_IDS`), and a ``structured`` (:class:`StructuredOutputs`) with no kind
or more than one, an empty regex/grammar/choice list, a ``json_schema`` that is not a
JSON object, or ``compact_json`` on a kind that is not JSON. Sizes: a ``json_schema``,
``regex`` or ``grammar`` over :data:`MAX_STRUCTURED_BYTES` (UTF-8), a ``choice`` of more
than :data:`MAX_STRUCTURED_CHOICES` strings or over MAX_STRUCTURED_BYTES in all, more than
:data:`MAX_LOGIT_BIAS` ``logit_bias`` entries.

**Optional features**: an engine lists the ones it serves in :attr:`Engine.serves`; the
worker servicer refuses a request that sets one the engine does not serve
(INVALID_ARGUMENT naming ``sampling.<feature>``), so nothing is ever silently ignored.
Log-probabilities come back on :class:`EngineOutput`: ``logprobs`` holds one
:class:`PositionLogprobs` per token of ``token_ids`` (the sampled token with its
log-probability and rank, and the ``logprobs`` most likely tokens at that position, rank
1 first), ``prompt_logprobs`` (first output only) one per prompt token (the first has
none: its entry is the token alone, logprob 0, rank 0).

Everything that crosses a process boundary is a plain dataclass here; the worker
service converts to and from protobuf.
"""

from __future__ import annotations

import abc
import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


class EngineError(Exception):
    """A request the engine cannot serve (bad input); maps to INVALID_ARGUMENT."""


class KvHandoffError(Exception):
    """A remote prefill's KV did not come (P gone or silent past the handoff timeout, or
    its load failed) and the policy is "fail"; the message names P. Maps to UNAVAILABLE."""


class EngineDeadError(Exception):
    """The engine died and serves nothing more; maps to UNAVAILABLE. The message is the
    reason (what :meth:`Engine.wait_dead` returns)."""


class EngineUnavailableError(Exception):
    """The engine is alive but cannot serve this request now (e.g. its AFD FFN peer is
    gone); the message names the cause. Maps to UNAVAILABLE ``engine unavailable:
    <cause>``; the worker is not marked dead and serves later requests (the frontend
    migrates the request elsewhere or answers 503)."""


# Sampling features an engine may or may not serve (Engine.serves), by Sampling field.
OPTIONAL_FEATURES = ("logprobs", "prompt_logprobs", "structured", "logit_bias",
                     "min_tokens", "min_p", "bad_words", "allowed_token_ids",
                     "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens")
# The most top log-probabilities one position may ask for (vLLM's max_logprobs default).
MAX_LOGPROBS = 20
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Size caps on what a request may ask the engine to compile or apply (the frontend's too).
MAX_STRUCTURED_BYTES = 64 << 10  # a json_schema, regex or grammar (UTF-8); choice: in all
MAX_STRUCTURED_CHOICES = 1024  # strings of a choice
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_BAD_WORDS = 256  # bad_words strings, each at most MAX_BAD_WORD_BYTES (UTF-8)
MAX_BAD_WORD_BYTES = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 16  # allowed_token_ids entries


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrained decoding (vLLM's structured outputs): exactly one kind is set.

    ``json_schema``: a JSON schema as JSON text; ``json_object``: any JSON object;
    ``regex``; ``choice``: exactly one of these strings; ``grammar``: EBNF/GBNF.
    ``compact_json``: no optional whitespace in JSON (vLLM's disable_any_whitespace).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    compact_json: bool = False

    def kinds(self) -> list[str]:
        """The kinds set (a valid value has exactly one)."""
        return [k for k in STRUCTURED_KINDS
                if (self.json_object if k == "json_object" else getattr(self, k) is not None)]


@dataclass(frozen=True)
class TokenLogprob:
    """A token and its log-probability; ``rank`` 1 = the most likely token (0: none,
    the first prompt token)."""

    token_id: int
    logprob: float
    rank: int


@dataclass(frozen=True)
class PositionLogprobs:
    """One position: the token there and the most likely tokens (rank order)."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters for one request (OpenAI semantics; temperature 0 = greedy).

    The fields after ``repetition_penalty`` are the optional features
    (:data:`OPTIONAL_FEATURES`); :meth:`features` names those a request sets.
    """

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # top log-probabilities per generated / prompt position (None: none computed)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutputs | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    min_tokens: int = 0
    min_p: float | None = None
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # (): every id
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def features(self) -> list[str]:
        """The optional features this request sets (to other than their defaults), in
        :data:`OPTIONAL_FEATURES` order."""
        unset: dict[str, object] = {"logit_bias": (), "min_tokens": 0, "bad_words": (),
                                    "allowed_token_ids": (),
                                    "include_stop_str_in_output": False,
                                    "skip_special_tokens": True,
                                    "spaces_between_special_tokens": True}
        return [f for f in OPTIONAL_FEATURES if getattr(self, f) != unset.get(f)]


def _validate_structured(so: StructuredOutputs) -> None:
    kinds = so.kinds()
    if len(kinds) != 1:
        raise EngineError("sampling.structured must set exactly one of "
                          f"{', '.join(STRUCTURED_KINDS)}; got {kinds or 'none'}")
    kind = kinds[0]
    if kind in ("json_schema", "regex", "grammar"):
        size = len(str(getattr(so, kind)).encode("utf-8", errors="replace"))
        if size > MAX_STRUCTURED_BYTES:
            raise EngineError(f"sampling.structured.{kind} is {size} bytes; at most "
                              f"{MAX_STRUCTURED_BYTES}")
    if kind == "choice" and so.choice:
        if len(so.choice) > MAX_STRUCTURED_CHOICES:
            raise EngineError(f"sampling.structured.choice has {len(so.choice)} strings; at "
                              f"most {MAX_STRUCTURED_CHOICES}")
        size = sum(len(str(c).encode("utf-8", errors="replace")) for c in so.choice)
        if size > MAX_STRUCTURED_BYTES:
            raise EngineError(f"sampling.structured.choice is {size} bytes in all; at most "
                              f"{MAX_STRUCTURED_BYTES}")
    if kind in ("regex", "grammar") and not str(getattr(so, kind)).strip():
        raise EngineError(f"sampling.structured.{kind} must not be empty")
    if kind == "choice" and (not so.choice or any(not isinstance(c, str) for c in so.choice)):
        raise EngineError("sampling.structured.choice must be a non-empty list of strings")
    if kind == "json_schema":
        try:
            schema = json.loads(so.json_schema or "")
        except ValueError as exc:
            raise EngineError(f"sampling.structured.json_schema is not valid JSON: {exc}"
                              ) from exc
        if not isinstance(schema, dict):
            raise EngineError("sampling.structured.json_schema must be a JSON object, got "
                              f"{type(schema).__name__}")
    if so.compact_json and kind not in ("json_schema", "json_object"):
        raise EngineError(f"sampling.structured.compact_json applies to JSON only, not {kind}")


def _validate_features(s: Sampling) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise EngineError(f"sampling.{name} must be in [0, {MAX_LOGPROBS}], got {value}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise EngineError(f"sampling.logit_bias takes at most {MAX_LOGIT_BIAS} entries, got "
                          f"{len(s.logit_bias)}")
    for token, bias in s.logit_bias:
        if token < 0:
            raise EngineError(f"sampling.logit_bias token ids must be >= 0, got {token}")
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise EngineError(f"sampling.logit_bias[{token}] must be in [-100, 100], "
                              f"got {bias}")
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise EngineError(f"sampling.min_tokens must be in [0, max_tokens={s.max_tokens}], "
                          f"got {s.min_tokens}")
    if s.min_p is not None and not (math.isfinite(s.min_p) and 0 <= s.min_p <= 1):
        raise EngineError(f"sampling.min_p must be in [0, 1], got {s.min_p}")
    if s.structured is not None:
        _validate_structured(s.structured)
    if len(s.bad_words) > MAX_BAD_WORDS:
        raise EngineError(f"sampling.bad_words takes at most {MAX_BAD_WORDS} words, got "
                          f"{len(s.bad_words)}")
    for i, word in enumerate(s.bad_words):
        if not word.strip() or len(word.encode("utf-8", errors="replace")) > MAX_BAD_WORD_BYTES:
            raise EngineError(f"sampling.bad_words[{i}] must be a non-blank word of at most "
                              f"{MAX_BAD_WORD_BYTES} bytes")
    if len(s.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise EngineError(f"sampling.allowed_token_ids takes at most {MAX_ALLOWED_TOKEN_IDS} "
                          f"ids, got {len(s.allowed_token_ids)}")
    if any(t < 0 for t in s.allowed_token_ids):
        raise EngineError("sampling.allowed_token_ids must be token ids (>= 0)")


def validate_sampling(s: Sampling) -> None:
    """Raises :class:`EngineError` naming the first bad field; see the module docstring."""
    if s.max_tokens < 1:
        raise EngineError(f"sampling.max_tokens must be > 0, got {s.max_tokens}")
    floats = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")
    for name in floats:
        value = getattr(s, name)
        if value is not None and not math.isfinite(value):
            raise EngineError(f"sampling.{name} must be a finite number, got {value}")
    checks = (
        ("temperature", lambda v: v >= 0, ">= 0"),
        ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("top_k", lambda v: v >= -1, ">= -1 (-1 or 0: no limit)"),
        ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
        ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
        ("repetition_penalty", lambda v: v > 0, "> 0"),
    )
    for name, ok, bound in checks:
        value = getattr(s, name)
        if value is not None and not ok(value):
            raise EngineError(f"sampling.{name} must be {bound}, got {value}")
    negative = [t for t in s.stop_token_ids if t < 0]
    if negative:
        raise EngineError(f"sampling.stop_token_ids must be >= 0, got {negative[0]}")
    _validate_features(s)


@dataclass(frozen=True)
class EngineRequest:
    """One tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    # Opaque P/D handoff parameters for the engine's KV connector (vLLM:
    # ``kv_transfer_params``); see :mod:`workers.kv.nixl`. None: a plain request.
    kv_transfer_params: dict[str, Any] | None = None
    # The tenant's prefix-cache salt ("" = none): blocks computed under one salt are never
    # prefix hits for another (vLLM: the request's ``cache_salt``).
    cache_salt: str = ""
    # EPD: the prompt's decoded images (PIL), in prompt order (the prompt holds one image
    # marker token per image, which the engine expands), their ids (vLLM's
    # multi_modal_uuids = mm_hash, the embedding-cache key), and the embeddings an
    # encoder published for some of them (vLLM's ec_transfer_params, keyed by mm_hash;
    # None: the engine encodes every image itself).
    images: list[Any] = field(default_factory=list)
    image_uuids: list[str] = field(default_factory=list)
    ec_transfer_params: dict[str, Any] | None = None
    # A hint from a consumer that holds plain decode outputs anyway (a whole answer, or
    # vLLM's stream_interval): it is content to be woken for the first output with
    # tokens, for one that carries more than tokens and text, for the finished one, and
    # each time this many tokens have come since it last took outputs; in between, an
    # engine may keep outputs and hand them over merged (tokens and text concatenated, as
    # for a consumer that lags). The outputs' contents are the same either way. 1: every
    # output as produced. An engine may ignore it (vLLM, SGLang and AFD do).
    output_interval: int = 1


@dataclass
class EngineOutput:
    """One streamed delta. ``finish_reason`` is one of "stop", "length", "abort"."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Engine-measured seconds the request spent queued before it was first scheduled and
    # from then to its first token; set on the output carrying the first token when known.
    queue_s: float | None = None
    prefill_s: float | None = None
    # Set on the final output when the engine's KV connector returns handoff parameters
    # (a prefill request's coordinates for the decode side to load its KV from).
    kv_transfer_params: dict[str, Any] | None = None
    # Set on the final output when the engine's EC connector returns parameters (an EC
    # consumer: its per-embedding transfer reports, :func:`workers.ec.core.transfer_reports`).
    ec_transfer_params: dict[str, Any] | None = None
    # With sampling.logprobs: one entry per token of token_ids; with
    # sampling.prompt_logprobs, on the first output: one per prompt token.
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] | None = None


@dataclass(frozen=True)
class EngineLoad:
    """A load snapshot. ``kv_usage`` is the used fraction of KV blocks, in [0, 1]."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_total_blocks: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about a started engine."""

    engine: str
    model: str
    model_path: str
    block_size: int
    max_model_len: int
    # Equal on two engines iff their KV blocks are interchangeable (architecture, dtype,
    # layers, KV heads, head size, block size, ...); a P/D handoff needs equal layouts.
    kv_layout: str = ""
    # Handoff coordinates of the engine's KV connector (mode "pull"/"push", engine_id,
    # side-channel host/port, tp_size, ...); empty when the engine has no connector.
    handoff: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """Base class of all engines; see the module docstring for each method's contract."""

    #: The optional sampling features (:data:`OPTIONAL_FEATURES`) this engine serves;
    #: a request setting another is refused by the worker. Default: none.
    serves: frozenset[str] = frozenset()

    @property
    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool: ...

    def load(self) -> EngineLoad:
        """Default: no load information."""
        return EngineLoad()

    def counters(self) -> dict[str, int]:
        """Cumulative, monotonic engine counters by name (default: none)."""
        return {}

    async def reset_prefix_cache(self) -> bool:
        """Default: not supported."""
        return False

    @property
    def accepts_images(self) -> bool:
        """Whether ``EngineRequest.images`` may be set (default: no, text only)."""
        return False

    async def wait_dead(self) -> str:
        """Default: never returns (this engine cannot die apart from its process)."""
        await asyncio.get_running_loop().create_future()  # never resolved
        raise AssertionError("unreachable")

    async def shutdown(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Default: nothing to free."""
