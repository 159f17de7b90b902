"""Prompts tokenized on one thread of their own, off the event loop.

A ``tokenizers.Tokenizer`` lets go of the GIL while ``encode_batch_fast`` runs, so a
prompt tokenized on another thread costs the event loop only its hand-over; but a hop
through ``asyncio.to_thread`` costs ~90 µs of CPU per prompt. :class:`EncodeThread`
keeps one thread per tokenizer instead, fed by a queue: it encodes the prompts in the
order they were submitted, one backend call each, and hands each result back as soon as
it is ready, so the loop routes and sends one prompt while the thread encodes the next.
A loop is woken once for all the results that reach it before it takes them (a wake-up
costs it a syscall).

Contract of :class:`EncodeThread` (``backend``: a ``tokenizers.Tokenizer``):

- ``await encode(text, add_special_tokens)``: the ids ``backend.encode_batch_fast([text],
  add_special_tokens=...)[0].ids`` gives, computed on the thread (started on first use,
  a daemon), after the prompts submitted before it. An exception the backend raises for
  a prompt is raised by that prompt's call only (one that is not an ``Exception``, e.g.
  a Rust panic, as RuntimeError naming it). A caller cancelled meanwhile gets nothing;
  the others' results are unaffected. Should the thread itself fail, every call it holds
  and has not answered raises what it failed with (logged; a RuntimeError naming it when
  that is not an ``Exception``) and the next ``encode`` starts a new thread: no call is
  left waiting. Results reach a loop in the order they were computed; those for a loop
  that has closed are dropped (nobody waits for them).
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
        self._outbox = _Outbox()

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

    def _encode(self, text: str, add_special_tokens: bool
                ) -> tuple[list[int] | None, BaseException | None]:
        """The text's (ids, None), or (None, what the backend raised). Never raises."""
        try:
            enc = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
            return enc[0].ids, None
        except BaseException as exc:  # noqa: BLE001 - handed to its caller
            return None, _as_exception(exc, "the tokenizer")

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
            for _, _, fut, loop in (*todo, *rest):  # those answered already are skipped
                self._outbox.put(loop, fut, None, error)

    def _answer(self, todo: list[_Item]) -> None:
        """Encodes ``todo`` prompt by prompt, each result handed to its caller's loop as
        soon as it is ready."""
        for text, flag, fut, loop in todo:
            ids, exc = self._encode(text, flag)
            self._outbox.put(loop, fut, ids, exc)


def _as_exception(exc: BaseException, what: str) -> Exception:
    """``exc``, or a RuntimeError naming it when it is not an ``Exception`` (a caller's
    handlers for Exception still catch it)."""
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"{what} failed: {type(exc).__name__}: {exc}")


class _Outbox:
    """Results on their way to their loops: one ``call_soon_threadsafe`` per loop while
    the results before are not yet taken (a wake-up costs the loop a syscall; results
    that pile up meanwhile go with it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[asyncio.AbstractEventLoop, list[Any]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[list[int]],
            ids: Any, exc: BaseException | None) -> None:
        """Hands ``fut`` its ids (or ``exc``) on ``loop``, after the results put before
        for that loop; wakes the loop unless a wake-up is pending. Any thread; drops the
        result (and any still waiting) when the loop has closed."""
        with self._lock:
            batch = self._waiting.get(loop)
            if batch is not None and not loop.is_closed():
                batch.append((fut, ids, exc))
                return
            self._waiting[loop] = [(fut, ids, exc)]
        try:
            loop.call_soon_threadsafe(self._take, loop)
        except RuntimeError:  # that loop is closed: nobody waits
            with self._lock:
                self._waiting.pop(loop, None)

    def _take(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: settles every result waiting for it (a cancelled caller's is
        skipped), in the order they were put."""
        with self._lock:
            batch = self._waiting.pop(loop, [])
        _settle(batch)
