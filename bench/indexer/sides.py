"""The two indexers under test, behind one small interface, and what each side's timing covers.

Contracts:

- A :class:`Side` converts the neutral workload (:mod:`bench.indexer.workload`) to its own
  inputs, applies events, answers queries, and normalises an answer to
  ``{worker index: leading blocks}`` for the correctness check (normalising is never timed).
- :class:`Ours` is :class:`services.indexer.core.KvIndex`. Event input: a ``KvEvent``
  (worker ``"w<i>"``, chained hashes, tier "device"). Query input: the chained hashes.
  Answer: ``{worker: Overlap}``.
- :class:`Dynamo` is ``dynamo._core.RadixTree`` from ``ai-dynamo-runtime``. Event input:
  Dynamo's ``KvCacheEvent`` JSON bytes, ``{"event_id", "data": {"stored": {"parent_hash",
  "blocks": [{"block_hash": chained, "tokens_hash": local}]}}}`` or ``{"removed":
  {"block_hashes": [...]}}``, worker id = the index. Query input: the local hashes
  (Dynamo's tree is keyed by them). Answer: ``find_matches(...).scores``, i.e. the Python
  dict ``{(worker_id, dp_rank): blocks}``; the ``.scores`` conversion is inside the timed
  call, as a router needs it. Its events are applied through the binding's background
  thread, so :meth:`Side.apply_all` ends with a barrier (an empty ``find_matches``) inside
  the timed window.
- :meth:`Side.hash_prompt` is the token → query-input conversion a router must do
  (ours: local + chained hashes; Dynamo: local hashes only); it is timed separately.
- :func:`load_dynamo` returns the RadixTree class or the reason it is unavailable; the
  benchmark runs without it. Install it by hand (it is not a project requirement):
  ``pip install ai-dynamo-runtime==1.6.1``. That release pins ``pydantic<=2.13.5`` and pip
  downgrades the project's pydantic; reinstall the project's version afterwards (the
  RadixTree binding does not use pydantic).
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from typing import Any

from bench.indexer.workload import Event, Query
from services.common.block_hash import block_hashes, local_block_hash
from services.indexer.core import KvEvent, KvIndex

DYNAMO_DIST = "ai-dynamo-runtime"
DYNAMO_IMPORT = "dynamo._core.RadixTree"


class Side:
    """One indexer under test (see the module docstring)."""

    name = "side"
    timed = {"events": "", "queries": "", "hashing": ""}

    def reset(self) -> None:
        """Starts from an empty index."""
        raise NotImplementedError

    def convert_events(self, events: Sequence[Event]) -> list[Any]:
        """Neutral events → this side's event inputs."""
        raise NotImplementedError

    def apply_all(self, inputs: Sequence[Any]) -> None:
        """Applies converted events in order; returns once they are all applied."""
        raise NotImplementedError

    def query_input(self, q: Query) -> Any:
        """The precomputed query input (what :meth:`query` takes)."""
        raise NotImplementedError

    def query(self, inp: Any) -> Any:
        """One FindMatches call, returning the side's native answer."""
        raise NotImplementedError

    def normalise(self, answer: Any) -> dict[int, int]:
        """Native answer → ``{worker index: blocks}``."""
        raise NotImplementedError

    def hash_prompt(self, tokens: Sequence[int], block_size: int) -> Any:
        """Tokens → query input."""
        raise NotImplementedError


class Ours(Side):
    """kvmesh's KvIndex."""

    name = "kvmesh"
    timed = {
        "events": "KvIndex.apply(KvEvent) per event; conversion = building the KvEvent",
        "queries": "KvIndex.find_matches(chained hashes) -> dict[str, Overlap]",
        "hashing": "services.common.block_hash.block_hashes(tokens) (local + chained)",
    }

    def __init__(self) -> None:
        self.index = KvIndex()
        self._names: dict[int, str] = {}

    def reset(self) -> None:
        self.index = KvIndex()

    def _name(self, w: int) -> str:
        name = self._names.get(w)
        if name is None:
            name = self._names[w] = f"w{w}"
        return name

    def convert_events(self, events: Sequence[Event]) -> list[Any]:
        name = self._name
        return [KvEvent(name(e.worker), e.event_id, e.kind, e.hashes) for e in events]

    def apply_all(self, inputs: Sequence[Any]) -> None:
        apply = self.index.apply
        for ev in inputs:
            if apply(ev) is not None:
                raise RuntimeError(f"unexpected gap at {ev}")

    def query_input(self, q: Query) -> Any:
        return list(q.hashes)

    def query(self, inp: Any) -> Any:
        return self.index.find_matches(inp)

    def normalise(self, answer: Any) -> dict[int, int]:
        return {int(w[1:]): ov.blocks for w, ov in answer.items()}

    def hash_prompt(self, tokens: Sequence[int], block_size: int) -> Any:
        return block_hashes(tokens, block_size)


def load_dynamo() -> tuple[Any, dict[str, Any]]:
    """(RadixTree class or None, info for the report: version, import path, error)."""
    info: dict[str, Any] = {"distribution": DYNAMO_DIST, "import": DYNAMO_IMPORT}
    try:
        info["version"] = importlib.metadata.version(DYNAMO_DIST)
    except importlib.metadata.PackageNotFoundError:
        info["version"] = None
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken native module
        info.update(available=False, error=f"{type(exc).__name__}: {exc}")
        return None, info
    info.update(available=True, error=None)
    return RadixTree, info


class Dynamo(Side):
    """Dynamo's RadixTree Python binding."""

    name = "dynamo"
    timed = {
        "events": "RadixTree.apply_event(worker_id, json_bytes) per event, then one empty "
                  "find_matches as a barrier; conversion = json.dumps(...).encode()",
        "queries": "RadixTree.find_matches(local hashes).scores -> dict[(worker, dp), int]",
        "hashing": "local_block_hash per full block (no chaining)",
    }

    def __init__(self, tree_cls: Any) -> None:
        self._cls = tree_cls
        self.tree = tree_cls()

    def reset(self) -> None:
        self.tree = self._cls()

    def convert_events(self, events: Sequence[Event]) -> list[Any]:
        dumps = json.dumps
        out: list[tuple[int, bytes]] = []
        for e in events:
            if e.kind == "stored":
                data: Any = {"stored": {
                    "parent_hash": e.parent,
                    "blocks": [{"block_hash": h, "tokens_hash": t}
                               for h, t in zip(e.hashes, e.locals, strict=True)]}}
            elif e.kind == "removed":
                data = {"removed": {"block_hashes": list(e.hashes)}}
            else:
                data = "cleared"
            out.append((e.worker, dumps({"event_id": e.event_id, "data": data}).encode()))
        return out

    def apply_all(self, inputs: Sequence[Any]) -> None:
        apply = self.tree.apply_event
        for w, payload in inputs:
            apply(w, payload)
        self.tree.find_matches([])  # barrier: the binding serialises calls on one thread

    def query_input(self, q: Query) -> Any:
        return list(q.locals)

    def query(self, inp: Any) -> Any:
        return self.tree.find_matches(inp).scores

    def normalise(self, answer: Any) -> dict[int, int]:
        out: dict[int, int] = {}
        for (w, _dp), n in answer.items():
            out[w] = out.get(w, 0) + n
        return out

    def hash_prompt(self, tokens: Sequence[int], block_size: int) -> Any:
        return [local_block_hash(tokens[i:i + block_size])
                for i in range(0, len(tokens) - block_size + 1, block_size)]
