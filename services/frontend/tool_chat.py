"""Tool calling on the chat path: the request side (between parsing and the worker) and
the warm-up of vLLM's tool parser. The output side is :mod:`.shapes`' (one
:class:`~services.frontend.tools.ToolCallParser` per choice). Contract:

- :data:`WARMUP` (:class:`ToolsWarmup`, one per process: vLLM's classes are imported once)
  imports vLLM's tool parser (10-18 s on a cold start). The frontend's start calls
  ``WARMUP.start()``, which runs it in a daemon thread and returns at once, so text
  requests are served meanwhile. :meth:`ToolsWarmup.wait` is what a tools request
  awaits: it returns once the import is done (starting it when nobody did), or raises
  ApiError 500 naming ``tools`` when vLLM's parser cannot be imported. A text request
  never waits. Once imported, the process's heap is frozen again, without a collection
  while requests are served (:func:`services.common.gc_heap.freeze_heap`; a no-op
  outside ``serve_main``): the import is most of it.
- :func:`prepare` (called by :meth:`Pipeline.prepare` for every chat request, before its
  template is rendered): nothing for a request without tools and without tool messages.
  Otherwise the model's template is probed (once per model,
  :meth:`~services.frontend.models.Tokenizer.tool_support`) and what it would drop is a
  400 (:func:`.tools.template_problem`: ``tool_choice`` ``auto`` on a template that does
  not render tools, an assistant's ``tool_calls`` on one that does not render them);
  a request with tools waits for :data:`WARMUP`; ``required`` and a named function get
  their JSON-schema constraint (:func:`.tools.structured_for`) as the request's
  ``sampling.structured``, so they travel to the worker as any ``response_format``
  (the mock engine refuses them: 400 naming ``structured``).
- :func:`explain` turns a worker's refusal of that constraint (a 400 naming
  ``structured``, e.g. the mock engine's) into a 400 naming ``tool_choice``, which is what
  the client sent.
- :func:`chat_kwargs`: the keywords of :meth:`Tokenizer.apply_chat` for the request
  (``extras`` and ``tools``), ``{}`` without either (the template renders as before).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from typing import Any

from services.common.gc_heap import freeze_heap
from services.frontend import tools
from services.frontend.models import Tokenizer
from services.frontend.openai_schema import ApiError, ParsedRequest, Structured

log = logging.getLogger(__name__)


class ToolsWarmup:
    """vLLM's tool parser imported once per process (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: str | None = None

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def run(self) -> None:
        """Imports the parser now (blocking; at most once); ApiError 500 if it fails."""
        with self._lock:
            if not self._done.is_set():
                try:
                    tools.warm()
                except Exception as exc:  # noqa: BLE001 - every request is told why
                    self._error = f"{type(exc).__name__}: {exc}"
                    log.error("vLLM's tool parser cannot be imported: %s", self._error)
                else:
                    freeze_heap("vLLM's tool parser", collect=False)
                self._done.set()
        if self._error is not None:
            raise ApiError(500, "tool calling is unavailable: vLLM's tool parser cannot be "
                           f"imported ({self._error})", type="internal_error", param="tools")

    def _quiet(self) -> None:
        try:
            self.run()
        except ApiError:
            pass  # logged by run; each tools request gets the error

    def start(self) -> None:
        """Starts the import in a daemon thread (no-op once done)."""
        if not self._done.is_set():
            threading.Thread(target=self._quiet, name="tools-warmup", daemon=True).start()

    async def wait(self) -> None:
        """Returns once the parser is imported (module docstring)."""
        if self._done.is_set() and self._error is None:
            return
        await asyncio.to_thread(self.run)


WARMUP = ToolsWarmup()


def _uses_tools(req: ParsedRequest) -> bool:
    return req.tools is not None or bool(req.message_extras)


def chat_kwargs(req: ParsedRequest) -> dict[str, Any]:
    """``apply_chat``'s tool keywords for ``req`` (module docstring)."""
    if not _uses_tools(req):
        return {}
    return {"extras": req.message_extras, **tools.render_kwargs(req.tools)}


async def prepare(req: ParsedRequest, tok: Tokenizer) -> ParsedRequest:
    """``req`` checked against its model's template, with the forced call's constraint
    (module docstring)."""
    if not _uses_tools(req):
        return req
    support = await asyncio.to_thread(tok.tool_support)
    messages = [{"role": role, **req.message_extras.get(i, {})}
                for i, (role, _) in enumerate(req.messages)]
    err = tools.template_problem(req.tools, messages, support, req.model)
    if err is not None:
        raise err
    if req.tools is None:
        return req
    await WARMUP.wait()
    constraint = tools.structured_for(req.tools)
    if constraint is None:
        return req
    return replace(req, sampling=replace(req.sampling, structured=Structured(
        "json_schema", constraint.json_schema)))


def explain(req: ParsedRequest, err: ApiError) -> ApiError:
    """``err``, or a worker's refusal of a forced call's constraint as a 400 naming
    ``tool_choice`` (module docstring)."""
    tr = req.tools
    if (tr is None or not tr.constrained or err.status != 400 or err.param is not None
            or "structured" not in err.message):
        return err
    choice = "required" if tr.choice == "required" else f"function {tr.function!r}"
    return replace(err, param="tool_choice", message=(
        f"tool_choice {choice} is served by structured outputs (the call's JSON schema), "
        f"which the worker refused: {err.message}"))
