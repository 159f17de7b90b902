"""OpenAI request validation: JSON bodies → typed requests, or an OpenAI-shaped error.

Pure: no I/O. Contract:

- :func:`parse_completion` / :func:`parse_chat` take the decoded JSON body and return a
  :class:`ParsedRequest`, or raise :class:`ApiError` (status 400, ``invalid_request_error``)
  naming the offending parameter. Unknown fields, and fields kvmesh does not serve set to
  anything but their no-op value, are refused the same way, never ignored
  (:mod:`services.frontend.openai_fields`).
- ``cache_salt`` in the body (vLLM's extension: a non-empty string) is the client's own
  salt (``ParsedRequest.client_salt``). :func:`with_tenant` gives the salt the mesh uses:
  the tenant's (from the API key) when the client sent none, else a digest of both, so a
  client can split its tenant's cache further but never reach another tenant's.
- The parsed request against the model's context, once tokenized (truncation, prompt +
  max_tokens): :mod:`.context_window`.
- :func:`error_body` renders an ApiError as ``{"error": {message, type, param, code}}``.
- JSON-level checks of a body (nesting, lone surrogates): :mod:`.json_checks`.
- **Images** (chat only): a content part ``{"type": "image_url", "image_url": {"url":
  ...}}`` (or ``"image_url": "<url>"``) must be a ``data:image/png|jpeg;base64,`` URL
  (:func:`services.encoder.images.data_url_bytes`: the media type, base64 and the byte
  limit are checked here, the 400 naming ``messages[i].content[j].image_url.url``);
  ``http(s)://`` URLs are refused ("remote image URLs are not supported") unless
  ``ImageLimits.remote_urls`` (the frontend's ``--allow-remote-images``): then the part
  keeps the URL in ``ImagePart.url`` (``data`` empty) and the pipeline fetches it
  (:mod:`services.frontend.remote_images`: byte and time limits, a 400 naming the same
  field when the fetch fails); other schemes are refused as before. More than
  ``ImageLimits.max_images`` images in a request is a 400 naming the first part over
  the limit. The decoded bytes are ``ParsedRequest.images`` (:class:`ImagePart`, in
  prompt order) and the message's content becomes a tuple of parts, ``("text", text)``
  and ``("image", "")``; the pixel checks need a decode and are the pipeline's. A message whose
  parts are all text stays one string, as before.
- **Sampling surface** (issue 15), each a 400 naming the field when malformed:
  ``n`` (1..:data:`MAX_N`; ``ParsedRequest.n``, fanned out by :mod:`.fanout`);
  ``logprobs`` — chat: a boolean, ``top_logprobs`` 0..:data:`MAX_LOGPROBS` (> 0 needs
  ``logprobs: true``, as vLLM); completions: an integer k in 0..MAX_LOGPROBS — becomes
  ``SamplingSpec.logprobs`` (the top-k count; None = none); ``echo`` (completions: the
  prompt prepended; with ``logprobs`` also ``SamplingSpec.prompt_logprobs`` = k);
  ``response_format`` ``{"type": "text"}`` → none, ``json_object`` →
  ``Structured("json_object")``, ``json_schema`` (``json_schema.schema`` an object) →
  ``Structured("json_schema", <the schema as compact JSON>)``, any other type a 400;
  ``logit_bias`` an object of token-id strings to numbers, each clamped to [-100, 100] as
  vLLM does (the ids are checked against the vocabulary by the pipeline, which has the
  tokenizer); vLLM's ``min_tokens`` (0..max_tokens) and ``min_p`` (0..1).
  Sizes: ``n`` x the number of prompts at most :data:`MAX_CHOICES` (:func:`check_choices`,
  a 400 naming ``n``), the schema's compact JSON at most :data:`MAX_STRUCTURED_BYTES`
  (400 naming ``response_format``), at most :data:`MAX_LOGIT_BIAS` ``logit_bias`` entries.
  vLLM's ``structured_outputs`` (regex, choice, grammar, json, json_object) is parsed by
  :mod:`.structured` into the same ``SamplingSpec.structured``.
- ``stream_options`` (with ``stream: true`` only, as vLLM): ``include_usage`` (a boolean
  or null) and ``continuous_usage_stats`` (a boolean or null: usage on every chunk, as
  vLLM's, ``ParsedRequest.continuous_usage``); ``continuous_usage_stats: true`` without
  ``include_usage: true`` is a 400 naming it (vLLM ignores it then), any other key is a
  400 naming ``stream_options.<key>``.
- **Tools** (chat): ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are checked by
  :func:`.tools.parse_tools` (``ParsedRequest.tools``; :func:`.tools.conflict` refuses
  ``response_format`` with a forced call), and the messages' ``tool_calls`` /
  ``tool_call_id`` by :func:`.tools.message_extras` (``ParsedRequest.message_extras``; a
  null ``content`` is ``""``).
- **Batches** (completions): ``prompt`` may be a list of strings or a list of token-id
  lists; ``ParsedRequest.batch`` then holds every prompt (``prompt`` /
  ``prompt_token_ids`` the first) and :func:`split_batch` gives one request per prompt.
  A list of one prompt is that prompt.
- Every integer is range-checked against the protobuf field that carries it (``seed``
  int64, ``top_k``/``max_tokens``/token ids int32), so nothing out of range reaches the
  serialiser.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from services.encoder.images import ImageLimits, InputError, data_url_bytes
from services.frontend.openai_fields import field_problem, message_problem

if TYPE_CHECKING:
    from services.frontend.tools import ToolRequest

MAX_STOP = 4
MAX_N = 128  # OpenAI's limit on n
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (and vLLM's default max_logprobs)
MAX_BATCH = 256  # prompts in one /v1/completions request
MAX_CHOICES = 256  # sub-requests of one request: n x prompts (check_choices)
MAX_STRUCTURED_BYTES = 64 << 10  # a json_schema's text (UTF-8), as the workers cap it
MAX_LOGIT_BIAS = 1024  # logit_bias entries, as the workers cap them
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class ApiError(Exception):
    """An error the client caused (4xx) or one upstream (5xx), OpenAI-shaped."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    # Seconds the client should wait before retrying (admission rejections): HTTP sends
    # ``Retry-After``, gRPC the ``retry-after`` trailing metadata.
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return self.message


def error_body(err: ApiError) -> dict[str, Any]:
    """The OpenAI error JSON for ``err``."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


@dataclass(frozen=True)
class Structured:
    """Constrained decoding: ``kind`` json_object | json_schema | regex | choice | grammar;
    ``value`` the schema (JSON text), regex or grammar; ``choices`` for ``choice``."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling parameters. ``max_tokens`` None = fill from the context."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extensions
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float | None = None
    # issue 15: the top-k counts of log-probabilities (None: none computed)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: Structured | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float | None = None
    # vLLM's decoding extensions (services/frontend/vllm_extras.py)
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass(frozen=True)
class ImagePart:
    """One image of a chat request: the file's bytes and the field it came from."""

    field: str
    data: bytes
    url: str = ""  # a remote (http/https) image, fetched by the pipeline; data is then b""


# A message's content: a string, or (images present) parts ("text", text) / ("image", "").
Content = str | tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completions or chat request."""

    kind: str  # "completion" | "chat"
    model: str
    sampling: SamplingSpec
    stream: bool = False
    # vLLM's stream_interval: a streamed answer's tokens go in chunks of at least this many
    # (the first and the last chunk excepted); None: the workers' --stream-interval
    stream_interval: int | None = None
    include_usage: bool = False
    # vLLM's prompt rendering options: chat template (chat) and the tokenizer's special
    # tokens (None: the endpoint's default, chat false, completions true)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids
    truncate: tuple[int, str] | None = None  # vLLM's truncate_prompt_tokens, its side
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage per chunk
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, Content], ...] = field(default_factory=tuple)
    images: tuple[ImagePart, ...] = ()  # chat image parts, in prompt order
    request_id: str | None = None
    # The caller's tenant's prefix-cache salt, set by the API from the API key (never from
    # the body: a client cannot pick another tenant's cache), see with_tenant. "": unsalted.
    cache_salt: str = ""
    client_salt: str = ""  # the body's cache_salt (vLLM's extension), "" when absent
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt is prepended to each choice
    # completions with several prompts: every prompt (str or token ids), in order
    batch: tuple[str | tuple[int, ...], ...] = ()
    # chat tool calling (:mod:`.tools`): the validated tools and tool_choice (None: no
    # tools), and per message index the tool keys its template dict gets
    tools: ToolRequest | None = None
    message_extras: dict[int, dict[str, Any]] = field(default_factory=dict)


def split_batch(req: ParsedRequest) -> list[ParsedRequest]:
    """One request per prompt of ``req`` (itself when it is no batch)."""
    if not req.batch:
        return [req]
    return [replace(req, batch=(), prompt=p if isinstance(p, str) else None,
                    prompt_token_ids=None if isinstance(p, str) else p) for p in req.batch]


def with_tenant(req: ParsedRequest, tenant_salt: str) -> ParsedRequest:
    """``req`` with the salt the mesh uses (see the module docstring)."""
    salt = tenant_salt
    if req.client_salt:
        salt = hashlib.sha256(f"{tenant_salt}\0{req.client_salt}".encode()).hexdigest()[:16]
    return req if req.cache_salt == salt else replace(req, cache_salt=salt)


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


def _opt_number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(f"'{name}' must be a number, got {type(v).__name__}", name)
    if not lo <= v <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return float(v)


def _opt_int(body: dict[str, Any], name: str, lo: int = -INT32_MAX - 1,
             hi: int = INT32_MAX) -> int | None:
    """An optional integer in ``[lo, hi]`` (by default the int32 range of its field)."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if not lo <= v <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _opt_bool(body: dict[str, Any], name: str, default: Any = False) -> Any:
    """The boolean ``body[name]``; ``default`` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _render(body: dict[str, Any]) -> dict[str, Any]:
    """A chat's template options (vLLM's): not both ``add_generation_prompt`` and
    ``continue_final_message``; the latter needs an assistant message last."""
    gen = _opt_bool(body, "add_generation_prompt", True)
    cont = _opt_bool(body, "continue_final_message", False)
    if gen and cont:
        raise _bad("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                   "True.", "continue_final_message")
    if cont and body["messages"][-1].get("role") != "assistant":
        raise _bad("'continue_final_message' continues the last message, which must be the "
                   "assistant's", "continue_final_message")
    return {"add_generation_prompt": gen, "continue_final_message": cont,
            "add_special_tokens": _opt_bool(body, "add_special_tokens", None),
            "return_token_ids": _opt_bool(body, "return_token_ids"),
            "truncate": _truncate(body)}


def _truncate(body: dict[str, Any]) -> tuple[int, str] | None:
    """vLLM's ``truncate_prompt_tokens`` (-1: the context; >= 0) and ``truncation_side``
    (left, the default, or right); the pipeline truncates, knowing the context."""
    k = _opt_int(body, "truncate_prompt_tokens", -1, INT64_MAX)
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise _bad(f"'truncation_side' must be 'left' or 'right', got {side!r}",
                   "truncation_side")
    if k is None:
        if side is not None:
            raise _bad("'truncation_side' needs 'truncate_prompt_tokens'", "truncation_side")
        return None
    if k == 0:
        raise _bad("'truncate_prompt_tokens' must be -1 or >= 1", "truncate_prompt_tokens")
    return k, side or "left"


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise _bad("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    return model


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > MAX_STOP:
            raise _bad(f"'stop' takes at most {MAX_STOP} sequences", "stop")
        return tuple(s for s in v if s)
    raise _bad("'stop' must be a string or a list of strings", "stop")


# The body fields _sampling reads beyond the max tokens and these common ones:
# temperature, top_p, seed, ignore_eos. A body with none of them (most requests) gets the
# values those fields take when absent, without a call per field (a lone request runs
# this code cold: each call costs µs); tests/unit/test_openai_schema_plain.py holds the
# two paths equal.
_RARE_SAMPLING = frozenset({
    "top_k", "stop", "presence_penalty", "frequency_penalty", "stop_token_ids",
    "repetition_penalty", "response_format", "structured_outputs", "logit_bias",
    "min_tokens", "min_p", "bad_words", "allowed_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens"})


def _sampling(body: dict[str, Any], max_tokens_names: tuple[str, ...],
              default_max_tokens: int | None = None, **fixed: Any) -> SamplingSpec:
    """The body's sampling fields; ``max_tokens`` is ``default_max_tokens`` when the body
    gives none (``min_tokens`` is checked against it, as vLLM does), ``fixed``: fields
    the caller sets (built once: no ``replace`` of a 30-field dataclass per request).
    :func:`_sampling_all`'s answer (its checks in its order), read field by field only
    when the body holds a field of :data:`_RARE_SAMPLING`."""
    if not _RARE_SAMPLING.isdisjoint(body):
        return _sampling_all(body, max_tokens_names, default_max_tokens, **fixed)
    return SamplingSpec(
        max_tokens=_max_tokens(body, max_tokens_names, default_max_tokens),
        temperature=_opt_number(body, "temperature", 0.0, 2.0),
        top_p=_opt_number(body, "top_p", 0.0, 1.0),
        seed=_opt_int(body, "seed", INT64_MIN, INT64_MAX),
        ignore_eos=_opt_bool(body, "ignore_eos"),
        **(_ABSENT_SAMPLING or _absent_sampling()), **fixed)


def _max_tokens(body: dict[str, Any], names: tuple[str, ...], default: int | None
                ) -> int | None:
    """The first of ``names`` the body gives (> 0), else ``default``."""
    max_tokens = None
    for name in names:
        max_tokens = _opt_int(body, name)
        if max_tokens is not None:
            if max_tokens <= 0:
                raise _bad(f"'{name}' must be > 0, got {max_tokens}", name)
            break
    return max_tokens or default


def _sampling_all(body: dict[str, Any], max_tokens_names: tuple[str, ...],
                  default_max_tokens: int | None = None, **fixed: Any) -> SamplingSpec:
    """:func:`_sampling`, every field read."""
    max_tokens = _max_tokens(body, max_tokens_names, default_max_tokens)
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=_opt_number(body, "temperature", 0.0, 2.0),
        top_p=_opt_number(body, "top_p", 0.0, 1.0),
        top_k=_opt_int(body, "top_k", -1),
        seed=_opt_int(body, "seed", INT64_MIN, INT64_MAX),
        stop=_stop(body),
        ignore_eos=_opt_bool(body, "ignore_eos"),
        presence_penalty=_opt_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_opt_number(body, "frequency_penalty", -2.0, 2.0),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        repetition_penalty=_positive(body, "repetition_penalty"),
        structured=_structured(body),
        logit_bias=_logit_bias(body),
        min_tokens=_min_tokens(body, max_tokens),
        min_p=_opt_number(body, "min_p", 0.0, 1.0),
        **_vllm_extras(body), **fixed,
    )


def _n(body: dict[str, Any]) -> int:
    n = _opt_int(body, "n", 1, MAX_N)
    return 1 if n is None else n


def _min_tokens(body: dict[str, Any], max_tokens: int | None) -> int:
    v = _opt_int(body, "min_tokens", 0)
    if v is None:
        return 0
    if max_tokens is not None and v > max_tokens:
        raise _bad(f"'min_tokens' ({v}) must be less than or equal to 'max_tokens' "
                   f"({max_tokens})", "min_tokens")
    return v


def _response_format(body: dict[str, Any]) -> Structured | None:
    v = body.get("response_format")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("'response_format' must be an object", "response_format")
    kind = v.get("type")
    extra = next((k for k in v if k not in ("type", "json_schema")), None)
    if extra is not None:
        raise _bad(f"Unrecognized key in response_format: '{extra}'", f"response_format.{extra}")
    if kind == "text" or kind == "json_object":
        if "json_schema" in v:
            raise _bad(f"response_format.json_schema is only for type 'json_schema', not "
                       f"{kind!r}", "response_format.json_schema")
        return None if kind == "text" else Structured("json_object")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema must be an object with a 'schema'",
                       "response_format.json_schema")
        bad = next((k for k in spec if k not in ("name", "description", "schema", "strict")),
                   None)
        if bad is not None:
            raise _bad(f"Unrecognized key in response_format.json_schema: '{bad}'",
                       f"response_format.json_schema.{bad}")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema must be a JSON schema object",
                       "response_format.json_schema.schema")
        text = json.dumps(schema, separators=(",", ":"))
        if len(text.encode()) > MAX_STRUCTURED_BYTES:
            raise _bad(f"response_format.json_schema.schema is {len(text.encode())} bytes as "
                       f"compact JSON; at most {MAX_STRUCTURED_BYTES}", "response_format")
        return Structured("json_schema", text)
    raise _bad(f"response_format.type must be one of 'text', 'json_object', 'json_schema'; "
               f"got {kind!r}", "response_format.type")


def _vllm_extras(body: dict[str, Any]) -> dict[str, Any]:
    from services.frontend import vllm_extras  # it imports this module

    return vllm_extras.parse_extras(body.get)


def _structured(body: dict[str, Any]) -> Structured | None:
    from services.frontend import structured  # it imports this module

    return structured.combined(_response_format(body), body)


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _bad("'logit_bias' must be an object of token ids to biases", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(v)}",
                   "logit_bias")
    out = []
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()
                and int(key) <= INT32_MAX):
            raise _bad(f"logit_bias key {key!r} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or bias != bias:
            raise _bad(f"logit_bias[{key!r}] must be a number", "logit_bias")
        out.append((int(key), min(100.0, max(-100.0, float(bias)))))  # vLLM clamps
    return tuple(out)


def _logprobs_count(body: dict[str, Any], name: str) -> int | None:
    return _opt_int(body, name, 0, MAX_LOGPROBS)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """The chat top-k count: None without ``logprobs: true``."""
    want = _opt_bool(body, "logprobs")
    top = _logprobs_count(body, "top_logprobs")
    if top and not want:
        raise _bad("when using 'top_logprobs', 'logprobs' must be set to true",
                   "top_logprobs")
    return (top or 0) if want else None


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _bad(f"'{name}' must be a list of token ids", name)
    bad = next((t for t in v if not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        raise _bad(f"'{name}' token ids must be between 0 and {INT32_MAX}, got {bad}", name)
    return tuple(v)


def _positive(body: dict[str, Any], name: str) -> float | None:
    v = _opt_number(body, name, 0.0, 1e6)
    if v is not None and v <= 0:
        raise _bad(f"'{name}' must be > 0, got {v}", name)
    return v


def _stream(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage) of the body (module docstring)."""
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if opts and not stream:
            raise _bad("Stream options can only be defined when `stream=True`.",
                       "stream_options")
        extra = next((k for k in opts if k not in ("include_usage",
                                                   "continuous_usage_stats")), None)
        if extra is not None:
            raise _bad(f"Unrecognized key in stream_options: {extra!r}",
                       f"stream_options.{extra}")
        for key in ("include_usage", "continuous_usage_stats"):
            if not isinstance(opts.get(key, False), bool | None):
                raise _bad(f"'stream_options.{key}' must be a boolean, got "
                           f"{type(opts[key]).__name__}", f"stream_options.{key}")
        include_usage = bool(opts.get("include_usage"))
        continuous = bool(opts.get("continuous_usage_stats"))
        if continuous and not include_usage:
            raise _bad("'stream_options.continuous_usage_stats' needs "
                       "'stream_options.include_usage': true",
                       "stream_options.continuous_usage_stats")
    return stream, include_usage, continuous


def _request_id(body: dict[str, Any]) -> str | None:
    rid = body.get("request_id")
    return rid if isinstance(rid, str) and rid else None


def _client_salt(body: dict[str, Any]) -> str:
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise _bad("'cache_salt' must be a non-empty string if provided", "cache_salt")
    return salt


def _check_fields(body: dict[str, Any], kind: str) -> None:
    problem = field_problem(body, kind)
    if problem is not None:
        raise _bad(*problem)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    return body


def _one_prompt(prompt: Any, param: str) -> str | tuple[int, ...]:
    """A prompt: a non-empty string or a non-empty list of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise _bad(f"'{param}' must not be empty", param)
        return prompt
    # every element an int, not a bool (type(True) is bool); one pass in C, not in Python
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        if min(prompt) < 0 or max(prompt) > INT32_MAX:
            bad = next(t for t in prompt if not 0 <= t <= INT32_MAX)
            raise _bad(f"'{param}' token ids must be between 0 and {INT32_MAX}, got {bad}",
                       param)
        return tuple(prompt)
    raise _bad(f"'{param}' must be a string, a list of token ids, or a list of either",
               param)


def _prompts(body: dict[str, Any]) -> list[str | tuple[int, ...]]:
    """The completions prompt(s): one, or a batch (see the module docstring)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is required", "prompt")
    if isinstance(prompt, list) and not {str, list}.isdisjoint(map(type, prompt)):
        if len(prompt) > MAX_BATCH:
            raise _bad(f"'prompt' takes at most {MAX_BATCH} prompts", "prompt")
        return [_one_prompt(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
                for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def check_choices(n: int, prompts: int) -> None:
    """ApiError 400 naming ``n`` when ``n`` x ``prompts`` exceeds :data:`MAX_CHOICES`."""
    if n * prompts > MAX_CHOICES:
        raise _bad(f"'n' ({n}) x {prompts} prompt(s) is {n * prompts} sub-requests; at most "
                   f"{MAX_CHOICES} per request", "n")


# The completion fields parse_completion reads beyond model, prompt, stream, n and the
# sampling ones: a body with none of them gets their absent values at once (as
# _RARE_SAMPLING; the same test holds the two paths equal).
_RARE_COMPLETION = frozenset({
    "stream_options", "echo", "logprobs", "stream_interval", "request_id", "cache_salt",
    "add_special_tokens", "return_token_ids", "truncate_prompt_tokens", "truncation_side"})


def parse_completion(body: Any) -> ParsedRequest:
    """Validates a /v1/completions body (:func:`_parse_completion_all`'s answer, read
    field by field only when the body holds a field of :data:`_RARE_COMPLETION`)."""
    body = _require_object(body)
    _check_fields(body, "completion")
    if not _RARE_COMPLETION.isdisjoint(body):
        return _parse_completion_all(body)
    model = _model(body)
    prompts = _prompts(body)
    first = prompts[0]
    stream = _opt_bool(body, "stream")
    sampling = _sampling(body, ("max_tokens",), 16, logprobs=None, prompt_logprobs=None)
    n = _n(body)
    check_choices(n, len(prompts))
    return ParsedRequest(
        kind="completion", model=model, sampling=sampling, stream=stream,
        prompt=first if isinstance(first, str) else None,
        prompt_token_ids=None if isinstance(first, str) else first, n=n,
        batch=tuple(prompts) if len(prompts) > 1 else (),
        **(_ABSENT_COMPLETION or _absent_completion()))


def _parse_completion_all(body: dict[str, Any]) -> ParsedRequest:
    """:func:`parse_completion` of an object whose fields passed ``_check_fields``, every
    field read."""
    model = _model(body)
    prompts = _prompts(body)
    first = prompts[0]
    stream, include_usage, continuous = _stream(body)
    echo = _opt_bool(body, "echo")
    k = None if body.get("logprobs") is False else _logprobs_count(body, "logprobs")
    sampling = _sampling(body, ("max_tokens",), 16, logprobs=k,
                         prompt_logprobs=k if echo else None)
    check_choices(_n(body), len(prompts))
    return ParsedRequest(
        kind="completion", model=model, sampling=sampling,
        stream=stream, include_usage=include_usage, continuous_usage=continuous,
        stream_interval=_opt_int(body, "stream_interval", 1),
        prompt=first if isinstance(first, str) else None,
        prompt_token_ids=None if isinstance(first, str) else first,
        request_id=_request_id(body), client_salt=_client_salt(body), n=_n(body), echo=echo,
        add_special_tokens=_opt_bool(body, "add_special_tokens", None),
        return_token_ids=_opt_bool(body, "return_token_ids"), truncate=_truncate(body),
        batch=tuple(prompts) if len(prompts) > 1 else (),
    )


def _absent(spec: Any, names: Iterable[str]) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in names}


# The values the rarely given fields take when absent: the general path's own, on a body
# without them (computed on first use: the general path imports modules that import this
# one).
_ABSENT_SAMPLING: dict[str, Any] = {}
_ABSENT_COMPLETION: dict[str, Any] = {}


def _absent_sampling() -> dict[str, Any]:
    _ABSENT_SAMPLING.update(_absent(_sampling_all({}, ()), (
        "top_k", "stop", "presence_penalty", "frequency_penalty", "stop_token_ids",
        "repetition_penalty", "structured", "logit_bias", "min_tokens", "min_p", "bad_words",
        "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens")))
    return _ABSENT_SAMPLING


def _absent_completion() -> dict[str, Any]:
    _ABSENT_COMPLETION.update(_absent(_parse_completion_all({"model": "m", "prompt": "p"}), (
        "include_usage", "continuous_usage", "stream_interval", "request_id", "client_salt",
        "echo", "add_special_tokens", "return_token_ids", "truncate")))
    return _ABSENT_COMPLETION


def _image_bytes(part: dict[str, Any], where: str, images: list[ImagePart],
                 limits: ImageLimits) -> ImagePart:
    """An image_url part's decoded bytes (see the module docstring)."""
    value = part.get("image_url")
    url_field = f"{where}.image_url.url" if isinstance(value, dict) else f"{where}.image_url"
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise _bad(f"{url_field} must be a non-empty string", url_field)
    if len(images) >= limits.max_images:
        raise _bad(f"{where}: at most {limits.max_images} images per request", where)
    if url.split(":", 1)[0].lower() in ("http", "https"):
        if limits.remote_urls:
            return ImagePart(url_field, b"", url)
        raise _bad(f"{url_field}: remote image URLs are not supported; send the image as a "
                   "data: URL (data:image/png;base64,...)", url_field)
    try:
        return ImagePart(url_field, data_url_bytes(url, url_field, limits))
    except InputError as exc:
        raise _bad(str(exc), exc.field) from exc


def _content(content: Any, i: int, images: list[ImagePart], limits: ImageLimits) -> Content:
    """A message's content; image parts are appended to ``images``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[tuple[str, str]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and isinstance(part, dict):
                images.append(_image_bytes(part, f"messages[{i}].content[{j}]", images,
                                           limits))
                parts.append(("image", ""))
            elif kind == "text" and isinstance(part, dict) and isinstance(part.get("text"),
                                                                          str):
                parts.append(("text", part["text"]))
            else:
                raise _bad(f"messages[{i}].content[{j}] must be a text part ({{'type': "
                           "'text', 'text': ...}) or an image part ({'type': 'image_url', "
                           "'image_url': {'url': 'data:image/png;base64,...'}})",
                           f"messages[{i}].content[{j}]")
        if all(kind == "text" for kind, _ in parts):
            return "".join(text for _, text in parts)
        return tuple(parts)
    if content is None:
        return ""
    raise _bad(f"messages[{i}].content must be a string or a list of text and image parts",
               f"messages[{i}].content")


def parse_chat(body: Any, image_limits: ImageLimits | None = None) -> ParsedRequest:
    """Validates a /v1/chat/completions body (images within ``image_limits``)."""
    limits = image_limits or ImageLimits()
    images: list[ImagePart] = []
    body = _require_object(body)
    _check_fields(body, "chat")
    model = _model(body)
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        problem = message_problem(m, i)
        if problem is not None:
            raise _bad(*problem)
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise _bad(f"messages[{i}].role must be one of system, user, assistant, "
                       f"developer, tool; got {role!r}", f"messages[{i}].role")
        out.append(("system" if role == "developer" else role,
                    _content(m.get("content"), i, images, limits)))
    from services.frontend import tools  # it imports this module

    tool_req = tools.parse_tools(body)
    err = tools.conflict(tool_req, body)
    if err is not None:
        raise err
    extras = tools.message_extras(msgs)
    stream, include_usage, continuous = _stream(body)
    check_choices(_n(body), 1)
    return ParsedRequest(
        kind="chat", model=model, tools=tool_req, message_extras=extras,
        sampling=_sampling(body, ("max_completion_tokens", "max_tokens"),
                           logprobs=_chat_logprobs(body)),
        stream=stream, include_usage=include_usage, continuous_usage=continuous,
        stream_interval=_opt_int(body, "stream_interval", 1),
        messages=tuple(out), **_render(body),
        images=tuple(images), request_id=_request_id(body), client_salt=_client_salt(body),
        n=_n(body),
    )

