"""Stored Responses API objects, for ``store``, ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}`` (pure: no asyncio, no I/O; the clock is passed in).

vLLM's server keeps every stored response in an unbounded dict (and only with
``VLLM_ENABLE_RESPONSES_API_STORE``); this store is bounded. Contract:

- :class:`ResponseStore` ``(max_entries, max_bytes, ttl_s, clock)`` holds response
  objects (dicts, as answered) together with the chat messages that produced them (the
  prompt the worker rendered: instructions as a system message, the earlier turns, the
  input). Every entry belongs to a tenant (the API key's tenant name, see
  :mod:`.auth`); the key is ``(tenant, response id)``, so a tenant never sees, replaces or
  deletes another tenant's response: its id is simply unknown there (the HTTP layer
  answers 404 for it, the same as for an id never stored).
- ``put(tenant, response, messages)`` stores (or replaces) the entry of
  ``response["id"]`` and makes it the most recently used. It expires ``ttl_s`` seconds
  after this put (reading does not extend it, as OpenAI's retention runs from creation).
  Then, while more than ``max_entries`` entries or more than ``max_bytes`` bytes are held,
  the least recently used entry (over all tenants) is evicted. An entry's size is the
  length of the compact JSON of its response plus its messages. An entry larger than
  ``max_bytes`` on its own is not stored (``put`` returns False and nothing is evicted).
- ``get(tenant, id)`` is the entry (:class:`Stored`) or None (unknown, another tenant's,
  evicted, expired or deleted), and marks it most recently used. ``delete(tenant, id)``
  removes it (True) or says it was not there (False). Every call first drops the expired
  entries. ``len(store)`` and ``store.bytes`` are what is held.
- :func:`conversation` is what a request with ``previous_response_id`` continues from,
  as vLLM builds it (``construct_input_messages``): the stored messages without their
  system messages (instructions do not carry over; the new request's own come first),
  then the stored output as one assistant message: the ``output_text`` parts joined as
  its content, and each ``function_call`` item as a ``tool_calls`` entry (``id`` = its
  ``call_id``, so the next input can answer it with a ``function_call_output``), which is
  also how those items are read when a client sends them back as ``input`` itself.
  :func:`continue_messages` puts it after a chat body's first ``head`` messages (1 for
  the system message of the new request's ``instructions``, else 0), as vLLM does.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Key = tuple[str, str]


@dataclass(frozen=True)
class Stored:
    """One stored response: the object as answered and the chat messages behind it."""

    tenant: str
    response: dict[str, Any]
    messages: list[dict[str, Any]]
    size: int
    expires_at: float


def entry_size(response: dict[str, Any], messages: list[dict[str, Any]]) -> int:
    """The bytes an entry counts for: compact JSON of the response and the messages."""
    dump = json.dumps([response, messages], separators=(",", ":"), ensure_ascii=False)
    return len(dump.encode())


class ResponseStore:
    """A bounded, per-tenant, LRU + TTL store of response objects (module docstring)."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float]) -> None:
        if max_entries < 1 or max_bytes < 1 or not ttl_s > 0:
            raise ValueError("max_entries, max_bytes and ttl_s must be > 0, got "
                             f"{max_entries}, {max_bytes}, {ttl_s}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lru: OrderedDict[Key, Stored] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[Key, None] = OrderedDict()  # first to expire first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes(self) -> int:
        """The bytes held (the sum of the entries' sizes)."""
        return self._bytes

    def _drop(self, key: Key) -> None:
        entry = self._lru.pop(key)
        del self._by_age[key]
        self._bytes -= entry.size

    def _expire(self) -> None:
        now = self._clock()
        while self._by_age:
            key = next(iter(self._by_age))
            if self._lru[key].expires_at > now:
                break
            self._drop(key)

    def put(self, tenant: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> bool:
        """Stores ``response`` (its ``id``) for ``tenant``; False when it alone is over
        ``max_bytes`` (then nothing changes but expiry)."""
        self._expire()
        size = entry_size(response, messages)
        if size > self.max_bytes:
            return False
        key = (tenant, str(response["id"]))
        if key in self._lru:
            self._drop(key)
        self._lru[key] = Stored(tenant, response, messages, size,
                                self._clock() + self.ttl_s)
        self._by_age[key] = None
        self._bytes += size
        while len(self._lru) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._lru)))
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """``tenant``'s entry of ``response_id`` (now the most recently used), or None."""
        self._expire()
        key = (tenant, response_id)
        entry = self._lru.get(key)
        if entry is not None:
            self._lru.move_to_end(key)
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        """Removes ``tenant``'s entry of ``response_id``; False when there was none."""
        self._expire()
        key = (tenant, response_id)
        if key not in self._lru:
            return False
        self._drop(key)
        return True


def _output_text(item: dict[str, Any]) -> str:
    return "".join(p.get("text") or "" for p in item.get("content") or []
                   if p.get("type") == "output_text")


def conversation(stored: Stored) -> list[dict[str, Any]]:
    """The chat messages a continuation of ``stored`` starts with (module docstring)."""
    out = [dict(m) for m in stored.messages if m.get("role") != "system"]
    content = "".join(_output_text(i) for i in stored.response.get("output") or []
                      if i.get("type") == "message")
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in stored.response.get("output") or [] if i.get("type") == "function_call"]
    if content or calls:
        reply: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            reply["tool_calls"] = calls
        out.append(reply)
    return out


def continue_messages(messages: list[dict[str, Any]], stored: Stored,
                      head: int) -> list[dict[str, Any]]:
    """``messages`` (a new request's) continuing ``stored``: their first ``head`` (the
    new instructions' system message), then :func:`conversation`, then the rest."""
    return [*messages[:head], *conversation(stored), *messages[head:]]
