"""services.frontend.encode_thread.EncodeThread over the tiny model's real Rust tokenizer:
the ids are the backend's own, prompts submitted while it works go in one batch, a
prompt the backend refuses fails only its own call, and a cancelled caller costs the
others nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from services.frontend.encode_thread import EncodeThread
from services.frontend.models import Tokenizer
from workers.model import tiny


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tiny.ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
    return Tokenizer(str(path))._backend


class Gated:
    """The backend, whose first call waits for ``go`` (so later prompts queue up), and
    which records each call's batch."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.go = threading.Event()
        self.started = threading.Event()
        self.batches: list[tuple[list[Any], bool]] = []

    def encode_batch_fast(self, texts: list[Any], add_special_tokens: bool) -> Any:
        self.batches.append((list(texts), add_special_tokens))
        self.started.set()
        assert self.go.wait(30), "the test never let the first batch go"
        return self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


async def holding(backend: Any, text: str = "hold"
                  ) -> tuple[Gated, EncodeThread, asyncio.Future[list[int]]]:
    """A thread over the gated backend, holding its first batch (``text``) until the
    test sets ``go``: what is submitted meanwhile queues for the next batch."""
    gated = Gated(backend)
    thread = EncodeThread(gated)
    first = thread.encode(text, True)
    assert await asyncio.to_thread(gated.started.wait, 30), "the thread never took it"
    return gated, thread, first


def ids(backend: Any, text: str, special: bool = True) -> list[int]:
    return list(backend.encode_batch_fast([text], add_special_tokens=special)[0].ids)


async def test_prompts_submitted_meanwhile_go_in_one_batch_with_the_backends_ids(
        backend: Any) -> None:
    gated, thread, first = await holding(backend, "the first prompt")
    texts = [f"prompt number {i} " * (i + 1) for i in range(6)]
    rest = [thread.encode(t, i % 2 == 0) for i, t in enumerate(texts)]
    gated.go.set()
    assert await first == ids(backend, "the first prompt")
    got = await asyncio.gather(*rest)
    assert got == [ids(backend, t, i % 2 == 0) for i, t in enumerate(texts)]
    # one call for the first prompt, then one per add_special_tokens value
    assert gated.batches == [(["the first prompt"], True),
                             (texts[0::2], True), (texts[1::2], False)]
    thread.close()


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
