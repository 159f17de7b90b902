"""vLLM's ``/tokenize`` and ``/detokenize`` on the frontend, with the model's own tokenizer.

Contract (the request and response shapes of vLLM's server, checked as strictly as the
OpenAI endpoints: an unknown field, or one kvmesh does not serve, is a 400 naming it):

- ``POST /tokenize`` with ``prompt`` (a string; ``add_special_tokens``, default true) or
  ``messages`` (chat messages rendered by the model's chat template;
  ``add_generation_prompt`` default true, ``continue_final_message`` default false, not
  both true; ``add_special_tokens`` default false), and ``return_token_strs``: answers
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless
  asked). The ids are the ones a completion of the same prompt would be routed with
  (text only: a message with an image part is a 400 naming ``messages``, as kvmesh's
  image placeholders are expanded per request). ``chat_template``,
  ``chat_template_kwargs``, ``tools``, ``mm_processor_kwargs`` and ``media_io_kwargs``
  are refused unless null.
- ``POST /detokenize`` with ``tokens`` (ids in the vocabulary: a 400 naming
  ``tokens[i]`` otherwise) answers ``{"prompt": text}``, special tokens kept, as vLLM.
- ``model`` may be left out when exactly one model is served (vLLM's server has one);
  otherwise it is required (400), and an unknown model is a 404 ``model_not_found``.
- Both need an API key when keys are configured, like ``/v1/*``; tokenizing runs in a
  thread, never on the event loop.

:func:`parse_tokenize` and :func:`parse_detokenize` are pure; :func:`add_routes` wires
the endpoints into the frontend's FastAPI app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.frontend.models import ModelCatalog, ModelInfo
from services.frontend.openai_schema import INT32_MAX, ApiError, Content, parse_chat

_COMPLETION = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                   "add_special_tokens", "return_token_strs"})
_CHAT_REFUSED = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs",
                 "media_io_kwargs")


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated /tokenize body: ``prompt`` or ``messages`` (exactly one is set)."""

    model: str | None
    prompt: str | None = None
    messages: tuple[tuple[str, Content], ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    # messages[i]'s tool_calls / tool_call_id (rendered by the template, as in a chat)
    extras: dict[int, dict[str, Any]] = field(default_factory=dict)


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    return body


def _check_keys(body: dict[str, Any], allowed: frozenset[str],
                refused: tuple[str, ...] = ()) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in refused and value is None:
            continue
        if name in refused:
            raise _bad(f"'{name}' is not supported by kvmesh (yet); leave it out", name)
        raise _bad(f"Unrecognized request argument supplied: '{name}'", name)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _model(body: dict[str, Any]) -> str | None:
    v = body.get("model")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise _bad("'model' must be a non-empty string", "model")
    return v


def parse_tokenize(body: Any) -> TokenizeRequest:
    """Validates a /tokenize body (module docstring); ApiError 400 naming the field."""
    body = _object(body)
    model = _model(body)
    strs = _bool(body, "return_token_strs", False)
    if "messages" in body:
        _check_keys(body, _CHAT, _CHAT_REFUSED)
        gen = _bool(body, "add_generation_prompt", True)
        cont = _bool(body, "continue_final_message", False)
        if gen and cont:
            raise _bad("Cannot set both `continue_final_message` and "
                       "`add_generation_prompt` to True.", "continue_final_message")
        chat = parse_chat({"model": model or "-", "messages": body["messages"]})
        if chat.images:
            raise _bad("/tokenize takes text messages only (kvmesh expands image "
                       "placeholders per request)", chat.images[0].field)
        return TokenizeRequest(model, messages=chat.messages,
                               add_special_tokens=_bool(body, "add_special_tokens", False),
                               add_generation_prompt=gen, continue_final_message=cont,
                               return_token_strs=strs, extras=chat.message_extras)
    _check_keys(body, _COMPLETION)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("one of 'prompt' or 'messages' is required", "prompt")
    if not isinstance(prompt, str):
        raise _bad(f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
    return TokenizeRequest(model, prompt=prompt,
                           add_special_tokens=_bool(body, "add_special_tokens", True),
                           return_token_strs=strs)


def parse_detokenize(body: Any) -> tuple[str | None, tuple[int, ...]]:
    """(model, token ids) of a /detokenize body; ApiError 400 naming the field."""
    body = _object(body)
    _check_keys(body, frozenset({"model", "tokens"}))
    tokens = body.get("tokens")
    if tokens is None:
        raise _bad("'tokens' is required", "tokens")
    if not isinstance(tokens, list):
        raise _bad("'tokens' must be a list of token ids", "tokens")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
            raise _bad(f"tokens[{i}] must be a token id (an integer >= 0), got {t!r}",
                       f"tokens[{i}]")
    return _model(body), tuple(tokens)


def resolve_model(catalog: ModelCatalog, name: str | None) -> ModelInfo:
    """The named model, or the only one served when ``name`` is None."""
    if name is None:
        served = catalog.all()
        if len(served) != 1:
            raise _bad(f"'model' is required: {len(served)} models are served", "model")
        return served[0]
    info = catalog.get(name)
    if info is None:
        raise ApiError(404, f"The model '{name}' does not exist or has no live worker",
                       param="model", code="model_not_found")
    return info


def add_routes(app: FastAPI, catalog: ModelCatalog,
               authorize: Callable[[Request], object],
               read_json: Callable[[Request], Awaitable[Any]]) -> None:
    """Adds ``/tokenize`` and ``/detokenize``; ``authorize`` raises ApiError 401 for a
    missing or unknown key, ``read_json`` reads the body within the HTTP limits."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        authorize(request)
        req = parse_tokenize(await read_json(request))
        info = resolve_model(catalog, req.model)
        tok = await asyncio.to_thread(catalog.tokenizer, info)
        if req.messages is not None:
            ids = await asyncio.to_thread(
                tok.apply_chat, req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens, extras=req.extras)
        else:
            ids = await asyncio.to_thread(tok.encode, req.prompt or "",
                                          req.add_special_tokens)
        strs = await asyncio.to_thread(tok.token_strs, ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": info.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        authorize(request)
        model, ids = parse_detokenize(await read_json(request))
        info = resolve_model(catalog, model)
        tok = await asyncio.to_thread(catalog.tokenizer, info)
        size = tok.vocab_size
        bad = next((i for i, t in enumerate(ids) if t >= size), None)
        if bad is not None:
            raise _bad(f"tokens[{bad}] = {ids[bad]} is not in the vocabulary ({size} tokens)",
                       f"tokens[{bad}]")
        text = await asyncio.to_thread(tok.decode, ids, False)
        return JSONResponse({"prompt": text})
