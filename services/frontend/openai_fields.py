"""Which top-level fields an OpenAI request may carry: nothing is silently ignored.

Pure: no I/O. Contract of :func:`field_problem(body, kind)` (``kind``: ``"completion"``
or ``"chat"``), called by :mod:`services.frontend.openai_schema` before it parses a body
(which answers a problem with a 400 naming the field as ``param``): ``(message, field)``
for the first field, in body order, that is

- **unknown**: in none of the tables below (OpenAI itself answers "Unrecognized request
  argument supplied"), or a field of the other endpoint (``messages`` on completions);
- **recognised but not supported by kvmesh** (OpenAI's ``best_of``, ``suffix``,
  ``functions``, ...; ``tools`` and ``tool_choice`` on completions; vLLM's extensions
  such as ``bad_words`` or ``kv_transfer_params``)
  and set to anything but its no-op value (:data:`NO_OP`: ``null``, or the value that
  asks for nothing, e.g. ``response_format: {"type": "text"}``, ``echo: false``,
  ``tools: []``): a client asking for JSON, a tool call or log-probabilities must learn
  at once that it will not get them, never receive prose in their place.

Accepted: the fields the parser reads (:data:`SUPPORTED`) and OpenAI's fields that do not
change what is generated (:data:`NO_EFFECT`: ``user``, ``metadata``,
``safety_identifier``, ``prompt_cache_key``); None when every field is accepted. Served
since issue 15 (validated by the parser): ``n``, ``logprobs`` (chat: a boolean, with
``top_logprobs``; completions: an integer k), ``echo`` (completions), ``response_format``,
``logit_bias``, vLLM's ``min_tokens``, ``min_p`` and ``structured_outputs``, and on chat ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (validated by :mod:`.tools`), vLLM's
``add_generation_prompt`` and ``continue_final_message``, and on both
``add_special_tokens`` and vLLM's ``stream_interval``. A message's own
keys are checked by :func:`message_problem`: ``role``, ``content``, ``tool_calls`` and
``tool_call_id`` are accepted (their values are :func:`.tools.message_extras`'s to check;
``content`` may be null); ``name`` (the chat templates served render no participant
names), ``function_call`` and ``refusal`` are refused until they are served.
"""

from __future__ import annotations

from typing import Any

COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "ignore_eos", "n",
    "request_id", "cache_salt", "stop_token_ids", "repetition_penalty", "return_token_ids",
    "truncate_prompt_tokens", "truncation_side", "bad_words", "allowed_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "stream_interval",
})
# Served on both endpoints: structured outputs, logit_bias and vLLM's min_tokens / min_p.
SAMPLING = frozenset({"response_format", "logit_bias", "min_tokens", "min_p", "logprobs",
                      "structured_outputs"})
SUPPORTED = {
    "completion": COMMON | SAMPLING | {"prompt", "echo", "add_special_tokens"},
    "chat": COMMON | SAMPLING | {"messages", "max_completion_tokens", "top_logprobs",
                                 "tools", "tool_choice", "parallel_tool_calls",
                                 "add_generation_prompt", "continue_final_message",
                                 "add_special_tokens"},
}
NO_EFFECT = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})

# Recognised fields kvmesh does not serve yet, each with the values that ask for nothing
# (a field SUPPORTED on one endpoint is still checked here on the other: ``echo`` on chat).
_NONE: tuple[Any, ...] = (None,)
NO_OP: dict[str, tuple[Any, ...]] = {
    # OpenAI (both endpoints or one of them)
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # completions: no effect without tools
    "functions": (None, []),
    "function_call": (None, "none"),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "prediction": _NONE,
    "modalities": (None, ["text"]),
    "audio": _NONE,
    "reasoning_effort": _NONE,
    "verbosity": _NONE,
    "web_search_options": _NONE,
    # vLLM's extensions
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": _NONE,
    "guided_json": _NONE,
    "guided_regex": _NONE,
    "guided_choice": _NONE,
    "guided_grammar": _NONE,
    "guided_decoding_backend": _NONE,
    "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0),
    "kv_transfer_params": _NONE,
    "vllm_xargs": _NONE,
    "echo_prompt": _NONE,
    "chat_template": _NONE,
    "chat_template_kwargs": _NONE,
    "mm_processor_kwargs": _NONE,
    "media_io_kwargs": _NONE,
    "documents": _NONE,
    "use_beam_search": (None, False),
    "response_prefix": _NONE,
}
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})
MESSAGE_REFUSED = ("function_call", "refusal", "audio", "name")


def _is_no_op(name: str, value: Any) -> bool:
    allowed = NO_OP[name]
    # bool is an int in Python: False must not pass for 0 nor True for 1 (and vice versa).
    return any(type(value) is type(a) and value == a for a in allowed)


def field_problem(body: dict[str, Any], kind: str) -> tuple[str, str] | None:
    """(message, field) of the first unknown or unsupported field (module docstring)."""
    supported = SUPPORTED[kind]
    for name, value in body.items():
        if name in supported or name in NO_EFFECT:
            continue
        if name in NO_OP:
            if not _is_no_op(name, value):
                return (f"'{name}' is not supported by kvmesh (yet); send it as null or "
                        f"leave it out", name)
            continue
        other = "chat" if kind == "completion" else "completion"
        where = (f" (it belongs to the {other} endpoint)" if name in SUPPORTED[other]
                 else "")
        return f"Unrecognized request argument supplied: '{name}'{where}", name
    return None


def message_problem(message: dict[str, Any], index: int) -> tuple[str, str] | None:
    """(message, field) of the first key of ``messages[index]`` kvmesh would not honour."""
    for key in message:
        if key in MESSAGE_KEYS:
            continue
        param = f"messages[{index}].{key}"
        if key in MESSAGE_REFUSED:
            why = ("participant names are not rendered" if key == "name"
                   else "use tool_calls" if key == "function_call"
                   else "it is not served")
            return f"{param} is not supported by kvmesh (yet): {why}", param
        return f"Unrecognized key in messages[{index}]: '{key}'", param
    return None
