"""A parsed request against its model's context window, once its prompt is tokenized
(the pipeline applies both, in this order; the parser, :mod:`.openai_schema`, cannot: it
knows neither the prompt's tokens nor the model).

Pure: no I/O. Contract:

- :func:`truncated` applies vLLM's ``truncate_prompt_tokens`` / ``truncation_side``.
- :func:`check_context` raises ApiError 400 when prompt + max_tokens exceed the model's
  context length (the same rule and wording style vLLM uses), and fills a missing
  max_tokens with what is left of the context (chat).
"""

from __future__ import annotations

from dataclasses import replace

from services.frontend.openai_schema import ApiError, ParsedRequest


def truncated(req: ParsedRequest, ids: list[int],
              max_model_len: int) -> tuple[list[int], ParsedRequest]:
    """vLLM's ``truncate_prompt_tokens`` k (-1: the model's context) from
    ``truncation_side`` (left: keep the last k tokens, right: the first k): the ids, and
    the request as one of those ids (so echo shows what was served). A 400 naming the
    field for k above the context, or with images (their placeholders would be cut)."""
    assert req.truncate is not None
    k, side = req.truncate
    k = max_model_len if k == -1 else k
    if k > max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens ({k}) is above the model's context "
                       f"({max_model_len} tokens)", param="truncate_prompt_tokens")
    if req.images:
        raise ApiError(400, "truncate_prompt_tokens is not served with images (their "
                       "placeholders would be cut)", param="truncate_prompt_tokens")
    if len(ids) <= k:
        return ids, req
    ids = ids[len(ids) - k:] if side == "left" else ids[:k]
    if req.kind == "chat":
        return ids, req
    return ids, replace(req, prompt=None, prompt_token_ids=tuple(ids))


def check_context(req: ParsedRequest, prompt_tokens: int, max_model_len: int) -> ParsedRequest:
    """Enforces prompt + max_tokens <= max_model_len; fills a missing max_tokens."""
    if prompt_tokens >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your prompt has {prompt_tokens} tokens. Please reduce the "
                       "length of the prompt.", param="messages" if req.kind == "chat"
                       else "prompt", code="context_length_exceeded")
    max_tokens = req.sampling.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {prompt_tokens + max_tokens} tokens "
                       f"({prompt_tokens} in the prompt, {max_tokens} for the completion). "
                       "Please reduce the length of the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    if req.sampling.min_tokens > max_tokens:
        raise ApiError(400, f"'min_tokens' ({req.sampling.min_tokens}) must be less than or "
                       f"equal to 'max_tokens' ({max_tokens})", param="min_tokens")
    if max_tokens == req.sampling.max_tokens:
        return req
    return replace(req, sampling=replace(req.sampling, max_tokens=max_tokens))
