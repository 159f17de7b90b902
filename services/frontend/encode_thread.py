"""Prompts tokenized in batches on one thread of their own, off the event loop.

A ``tokenizers.Tokenizer`` lets go of the GIL while ``encode_batch_fast`` runs, so a
prompt tokenized on another thread costs the event loop only its hand-over; but a hop
through ``asyncio.to_thread`` costs ~90 µs of CPU per prompt. :class:`EncodeThread`
hands prompts over in batches instead: every prompt submitted while the thread works
goes into its next ``encode_batch_fast`` call, and each batch's results come back to
the loop in one callback.

Contract of :class:`EncodeThread` (``backend``: a ``tokenizers.Tokenizer``):

- ``await encode(text, add_special_tokens)``: the ids ``backend.encode_batch_fast([text],
  add_special_tokens=...)[0].ids`` gives, computed on the thread (started on first use,
  a daemon), batched with the prompts submitted meanwhile (one backend call per batch
  and ``add_special_tokens`` value). An exception the backend raises for a prompt is
  raised by that prompt's call only (a refused batch is encoded prompt by prompt; one
  that is not an ``Exception``, e.g. a Rust panic, is raised as RuntimeError naming
  it). A caller cancelled meanwhile gets nothing; the others' results are unaffected.
  The results of a batch reach each event loop in one callback. Should the thread itself
  fail, every call it holds raises RuntimeError naming the failure (logged) and the next
  ``encode`` starts a new thread: no call is left waiting.
- ``close()``: the thread ends once the prompts submitted before are answered; later
  ``encode`` calls raise RuntimeError. Idempotent. The frontend never closes its
  tokenizers' threads: they live as long as the process (one per model folder).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_Item = tuple[str, bool, "asyncio.Future[list[int]]", asyncio.AbstractEventLoop]


def _settle(results: list[tuple[asyncio.Future[list[int]], Any, BaseException | None]]
            ) -> None:
    for fut, ids, exc in results:
        if fut.done():  # cancelled meanwhile
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(ids)


class EncodeThread:
    """See the module docstring."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._cv = threading.Condition()
        self._todo: list[_Item] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def encode(self, text: str, add_special_tokens: bool) -> asyncio.Future[list[int]]:
        """A future of the prompt's ids (see the module docstring)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the tokenizer's encode thread is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvmesh-encode")
                self._thread.start()
            self._todo.append((text, bool(add_special_tokens), fut, loop))
            if len(self._todo) == 1:
                self._cv.notify()
        return fut

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _encode(self, texts: list[str], add_special_tokens: bool
                ) -> list[tuple[list[int] | None, BaseException | None]]:
        """Each text's (ids, None), or (None, what the backend raised for it alone):
        a batch the backend refuses is encoded text by text. Never raises."""
        try:
            encs = self._backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
            return [(e.ids, None) for e in encs]
        except BaseException as exc:  # noqa: BLE001 - handed to its caller(s)
            if len(texts) == 1:
                return [(None, _as_exception(exc, "the tokenizer"))]
        return [self._encode([text], add_special_tokens)[0] for text in texts]

    def _run(self) -> None:
        todo: list[_Item] = []
        try:
            while True:
                with self._cv:
                    while not self._todo and not self._closed:
                        self._cv.wait()
                    if not self._todo:
                        return
                    todo, self._todo = self._todo, []
                self._answer(todo)
                todo = []
        except BaseException as exc:  # noqa: BLE001 - every waiting caller is told
            log.exception("the tokenizer's encode thread failed; its calls fail and the "
                          "next prompt starts a new thread")
            with self._cv:
                rest, self._todo = self._todo, []
                self._thread = None
            error = _as_exception(exc, "the tokenizer's encode thread")
            _deliver([(t[2], None, error, t[3]) for t in (*todo, *rest)])

    def _answer(self, todo: list[_Item]) -> None:
        """Encodes ``todo`` (one backend call per ``add_special_tokens`` value) and hands
        each result to its caller's loop."""
        results = []
        for flag in (True, False):
            part = [t for t in todo if t[1] is flag]
            if part:
                results += [(t[2], ids, exc, t[3]) for t, (ids, exc) in zip(
                    part, self._encode([t[0] for t in part], flag), strict=True)]
        _deliver(results)


def _as_exception(exc: BaseException, what: str) -> Exception:
    """``exc``, or a RuntimeError naming it when it is not an ``Exception`` (a caller's
    handlers for Exception still catch it)."""
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"{what} failed: {type(exc).__name__}: {exc}")


def _deliver(results: list[tuple[asyncio.Future[list[int]], Any, BaseException | None,
                                 asyncio.AbstractEventLoop]]) -> None:
    """Hands the results to their loops, one callback per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
    for fut, ids, exc, loop in results:
        by_loop.setdefault(loop, []).append((fut, ids, exc))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, batch)
        except RuntimeError:  # that loop is closed: nobody waits
            pass
