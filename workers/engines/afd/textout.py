"""Incremental detokenization with stop strings, for the AFD worker (pure: no I/O).

The frontend sends token ids and takes the worker's text deltas (as from vLLM), so the AFD
attention worker turns its sampled ids into text itself.

:class:`TextStream` contract:

- ``TextStream(decode, stops)``: ``decode(ids) -> str`` decodes a whole id list (the
  worker passes the model's tokenizer, special tokens skipped); ``stops`` are the
  request's stop strings (vLLM semantics: the output ends *before* the first stop string,
  which is not included; empty strings are ignored).
- ``push(ids) -> (delta, stopped)``: ``ids`` are all the ids generated so far. Returns the
  new text since the last call and whether a stop string has appeared. Text that could
  still be the start of a stop string (the last ``max(len(stop)) - 1`` characters) and a
  trailing U+FFFD (an incomplete UTF-8 sequence) are held back until the next push.
  After ``stopped`` the stream is done: further pushes return ``("", True)``.
- ``flush(ids) -> delta``: at the end of a request that did not stop on a string, the
  text held back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """One request's output text (module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._emitted = 0  # characters of the decoded text already sent
        self.stopped = False

    def push(self, ids: list[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._decode(list(ids))
        if self._stops:
            begin = max(0, self._emitted - self._hold)
            hits = [i for i in (text.find(s, begin) for s in self._stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._take(text, max(self._emitted, min(hits))), True
        end = len(text) - self._hold
        if text.endswith("\ufffd"):
            end = min(end, len(text) - 1)
        return self._take(text, end), False

    def flush(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        return self._take(self._decode(list(ids)), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else max(end, self._emitted)
        delta = text[self._emitted:end]
        self._emitted = end
        return delta
