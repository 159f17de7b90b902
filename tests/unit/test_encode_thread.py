"""services.frontend.encode_thread.EncodeThread over the tiny model's real Rust tokenizer:
the ids are the backend's own, prompts are encoded in order and each result reaches its
caller while the next one is encoded, a prompt the backend refuses fails only its own
call, and a cancelled caller costs the others nothing. Also: the frontend's tokenizers
run without rayon's pool unless the operator says otherwise."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import pytest

from services.frontend.encode_thread import EncodeThread, _Outbox
from services.frontend.models import Tokenizer, tokenize_on_calling_threads
from workers.model import tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny.ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="module")
def backend(model: str) -> Any:
    return Tokenizer(model)._backend


class Gated:
    """The backend, whose first call waits for ``go`` (so later prompts queue up), and
    which records each call's texts."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.go = threading.Event()
        self.started = threading.Event()
        self.calls: list[tuple[list[Any], bool]] = []

    def encode_batch_fast(self, texts: list[Any], add_special_tokens: bool) -> Any:
        self.calls.append((list(texts), add_special_tokens))
        self.started.set()
        assert self.go.wait(30), "the test never let the first batch go"
        return self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


async def holding(backend: Any, text: str = "hold"
                  ) -> tuple[Gated, EncodeThread, asyncio.Future[list[int]]]:
    """A thread over the gated backend, holding its first prompt (``text``) until the
    test sets ``go``: what is submitted meanwhile queues behind it."""
    gated = Gated(backend)
    thread = EncodeThread(gated)
    first = thread.encode(text, True)
    assert await asyncio.to_thread(gated.started.wait, 30), "the thread never took it"
    return gated, thread, first


def ids(backend: Any, text: str, special: bool = True) -> list[int]:
    return list(backend.encode_batch_fast([text], add_special_tokens=special)[0].ids)


async def test_prompts_are_encoded_in_order_one_call_each_with_the_backends_ids(
        backend: Any) -> None:
    gated, thread, first = await holding(backend, "the first prompt")
    texts = [f"prompt number {i} " * (i + 1) for i in range(6)]
    rest = [thread.encode(t, i % 2 == 0) for i, t in enumerate(texts)]
    gated.go.set()
    assert await first == ids(backend, "the first prompt")
    got = await asyncio.gather(*rest)
    assert got == [ids(backend, t, i % 2 == 0) for i, t in enumerate(texts)]
    assert gated.calls == [(["the first prompt"], True)] + [
        ([t], i % 2 == 0) for i, t in enumerate(texts)]
    thread.close()


class HoldOn:
    """The backend, whose calls wait for ``go`` first when they hold ``first`` and then
    when they hold ``text``; ``started`` is set once the call for ``first`` began."""

    def __init__(self, backend: Any, first: str, text: str) -> None:
        self.backend, self.first, self.text = backend, first, text
        self.started = threading.Event()
        self.go_first = threading.Event()
        self.go = threading.Event()

    def encode_batch_fast(self, texts: list[Any], add_special_tokens: bool) -> Any:
        if self.first in texts:
            self.started.set()
            assert self.go_first.wait(30), "the test never let the first prompt go"
        if self.text in texts:
            assert self.go.wait(30), "the test never let the held prompt go"
        return self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


async def test_a_result_reaches_its_caller_while_the_next_prompt_is_encoded(
        backend: Any) -> None:
    held = HoldOn(backend, "first", "held")
    thread = EncodeThread(held)
    first = thread.encode("first", True)
    assert await asyncio.to_thread(held.started.wait, 30), "the thread never took it"
    # both queue behind the first prompt: the thread takes them together
    free, later = thread.encode("free", True), thread.encode("held", True)
    held.go_first.set()
    try:  # handed back together, their results would wait for the held prompt
        assert await asyncio.wait_for(first, 30) == ids(backend, "first")
        assert await asyncio.wait_for(free, 30) == ids(backend, "free")
        assert not later.done()
    finally:
        held.go.set()
    assert await later == ids(backend, "held")
    thread.close()


class Wakeups:
    """Stands for a loop in _Outbox: records each wake-up, run when the test says."""

    def __init__(self) -> None:
        self.callbacks: list[tuple[Any, tuple[Any, ...]]] = []

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        self.callbacks.append((callback, args))

    def is_closed(self) -> bool:
        return False

    def run(self) -> None:
        todo, self.callbacks = self.callbacks, []
        for callback, args in todo:
            callback(*args)


async def test_results_that_pile_up_before_the_loop_takes_them_wake_it_once() -> None:
    loop, outbox = Wakeups(), _Outbox()
    futs = [asyncio.get_running_loop().create_future() for _ in range(3)]

    def put_all() -> None:
        for i, f in enumerate(futs):
            outbox.put(loop, f, [i], None)  # type: ignore[arg-type]

    put = threading.Thread(target=put_all)
    put.start()
    await asyncio.to_thread(put.join, 30)
    assert not put.is_alive()
    assert len(loop.callbacks) == 1
    loop.run()
    assert [f.result() for f in futs] == [[0], [1], [2]]
    later = asyncio.get_running_loop().create_future()
    outbox.put(loop, later, None, ValueError("x"))  # type: ignore[arg-type]
    assert len(loop.callbacks) == 1  # taken before: a new wake-up
    loop.run()
    with pytest.raises(ValueError):
        later.result()


def test_tokenizers_run_on_the_calling_threads_unless_the_operator_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    tokenize_on_calling_threads()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    tokenize_on_calling_threads()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


async def test_a_closed_loops_results_are_dropped() -> None:
    loop, outbox = asyncio.new_event_loop(), _Outbox()
    fut = loop.create_future()
    outbox.put(loop, fut, [1], None)  # a wake-up scheduled, never run: the loop closes
    loop.close()
    outbox.put(loop, loop.create_future(), [2], None)
    assert not outbox._waiting
    assert not fut.done()


async def test_a_refused_prompt_fails_its_own_call_only(backend: Any) -> None:
    gated, thread, first = await holding(backend)
    good = thread.encode("a good prompt", True)
    bad = thread.encode(12345, True)  # type: ignore[arg-type]  # not text: refused
    also_good = thread.encode("another good one", True)
    gated.go.set()
    await first
    assert await good == ids(backend, "a good prompt")
    assert await also_good == ids(backend, "another good one")
    with pytest.raises(TypeError):
        await bad
    thread.close()


async def test_a_cancelled_caller_costs_the_others_nothing(backend: Any) -> None:
    gated, thread, first = await holding(backend)
    gone = thread.encode("nobody waits for this", True)
    kept = thread.encode("somebody waits for this", True)
    gone.cancel()
    gated.go.set()
    await first
    assert await kept == ids(backend, "somebody waits for this")
    assert gone.cancelled()
    thread.close()


async def test_close_answers_what_was_submitted_and_refuses_more(backend: Any) -> None:
    thread = EncodeThread(backend)
    pending = thread.encode("submitted before the close", False)
    thread.close()
    thread.close()  # idempotent
    assert await pending == ids(backend, "submitted before the close", False)
    with pytest.raises(RuntimeError, match="closed"):
        thread.encode("after", True)
    assert thread._thread is not None
    await asyncio.to_thread(thread._thread.join, 30)
    assert not thread._thread.is_alive()


class Panic(BaseException):
    """What a Rust panic in the tokenizer surfaces as (pyo3's PanicException is a
    BaseException)."""


class Panicky:
    """The backend, panicking on one text."""

    def __init__(self, backend: Any, bad: str) -> None:
        self.backend, self.bad = backend, bad

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> Any:
        if self.bad in texts:
            raise Panic("boom")
        return self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


async def test_a_panicking_prompt_fails_as_an_exception_and_the_thread_goes_on(
        backend: Any) -> None:
    thread = EncodeThread(Panicky(backend, "poison"))
    bad, good = thread.encode("poison", True), thread.encode("fine", True)
    with pytest.raises(RuntimeError, match="the tokenizer failed: Panic: boom"):
        await bad
    assert await good == ids(backend, "fine")
    assert await thread.encode("later", True) == ids(backend, "later")
    thread.close()


async def test_a_failed_thread_fails_its_calls_and_the_next_prompt_starts_a_new_one(
        backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    gated, thread, first = await holding(backend)
    real_answer = thread._answer

    def broken(todo: list[Any]) -> None:
        raise Panic("the thread broke")

    thread._answer = broken  # type: ignore[method-assign]  # the next batch breaks it
    queued = [thread.encode(f"queued {i}", True) for i in range(3)]
    with caplog.at_level(logging.ERROR, "services.frontend.encode_thread"):
        gated.go.set()
        assert await first == ids(backend, "hold")  # answered before the failure
        for fut in queued:
            with pytest.raises(RuntimeError, match="encode thread failed: Panic"):
                await fut
    assert "encode thread failed" in caplog.text
    thread._answer = real_answer  # type: ignore[method-assign]
    assert await thread.encode("after", True) == ids(backend, "after")  # a new thread
    thread.close()


async def test_a_thread_failing_mid_batch_keeps_the_answers_it_gave(backend: Any) -> None:
    gated, thread, first = await holding(backend)
    real_encode = thread._encode
    seen: list[str] = []

    def second_breaks(text: str, add_special_tokens: bool) -> Any:
        seen.append(text)
        if len(seen) == 2:
            raise Panic("the thread broke")
        return real_encode(text, add_special_tokens)

    thread._encode = second_breaks  # type: ignore[method-assign]
    queued = [thread.encode(f"queued {i}", True) for i in range(3)]  # taken together
    gated.go.set()
    assert await first == ids(backend, "hold")
    assert await queued[0] == ids(backend, "queued 0")  # answered before the failure
    for fut in queued[1:]:
        with pytest.raises(RuntimeError, match="encode thread failed: Panic"):
            await fut
    thread.close()
