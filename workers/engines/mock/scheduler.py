"""The mock engine's scheduler: vLLM-v1-like continuous batching on a simulated clock (pure).

No asyncio, no I/O: every method takes ``now`` (seconds on any monotonic clock) from the
caller, so the async engine (:mod:`workers.engines.mock.engine`) and an offline
discrete-event replay drive the same code. One engine step is
``batch = schedule(now)``, then the caller lets ``batch.duration_s`` pass (a real sleep,
or a virtual clock), then ``outputs = complete(batch, now)``.

Contract of :class:`Scheduler`:

- ``add(req, now)``: queues a :class:`SimRequest` (FCFS). A request with
  ``remote_prefill`` (the decode side of a P→D handoff) receives its prompt's KV instead
  of computing it (below).
- ``schedule(now) -> Batch``: one step's work, as vLLM v1 plans it:
  1. KV receptions that are done by ``now`` make their requests runnable (front of the
     waiting queue) with ``prompt - 1`` tokens computed; the received full blocks are
     cached (``BlockStored``).
  2. Running requests, in order, get their remaining tokens (a decode: 1; a chunked
     prefill: the rest of the prompt) within the token budget
     ``max_num_batched_tokens``. When blocks run out, the *last* running request is
     preempted (recompute: its blocks are freed, its computed count drops to 0, it goes to
     the front of the waiting queue) until the request fits or is itself the victim.
  3. If nobody was preempted, waiting requests are admitted in order while the budget
     lasts and fewer than ``max_num_seqs`` run: the prefix-cache hit is the leading cached
     full blocks of its tokens (hashed with its ``cache_salt``: no hit across salts),
     never counting the last token (so at least one token is computed, as in vLLM); its
     first chunk is at most the remaining budget (chunked prefill). Admission stops at
     the first request whose blocks do not fit.
     A ``remote_prefill`` request is admitted by allocating blocks for its whole prompt
     and starting the simulated transfer of the blocks it does not hold: it stays waiting
     (``waiting_for_kv``, not running, not in the budget) until ``now + transfer`` where
     transfer = blocks · ``kv_bytes_per_block`` / ``transfer_bandwidth`` / speedup.
     **No data moves**: this is a simulation of the handoff's timing and cache effects.
  The batch's ``duration_s`` is the timing model's step time for its prefill tokens
  (tokens of entries that are not decodes) and decoding requests (entries of one token
  whose request already has KV), at the KV usage after allocation, divided by
  ``speedup_ratio``.
- ``complete(batch, now) -> list[StepOutput]``: applies the step: computed counts grow,
  newly full blocks are cached, each request whose tokens are all computed samples one
  token (deterministic, as a greedy model: token n is an xxh3_64 streaming hash of the
  engine seed, the sampling seed and *all* tokens before it, prompt and output, packed as
  little-endian u32, mod ``vocab_size``; so a request re-sent with prompt + the tokens
  generated so far continues the identical sequence, which request migration relies on),
  and finishes with "length" (``max_tokens`` or ``max_model_len`` reached) or "stop"
  (``eos_token_id`` unless ``ignore_eos``, or a ``stop_token_ids`` token; before
  ``min_tokens`` outputs such a token is never sampled: the next candidate is taken). Finished
  requests free their blocks (which stay cached until evicted). Requests aborted during the
  step are skipped. One :class:`StepOutput` per request that produced a token or finished;
  the first carries ``cached_tokens``, ``queue_s`` and ``prefill_s``; a finished
  ``remote_decode`` request (the prefill side) carries ``kv_transfer_params`` naming this
  engine, its request id and the blocks it held.
- ``abort(request_id, now)``: removes a live request, frees its blocks; returns its final
  ``StepOutput`` ("abort"), or None when unknown.
- ``has_work()``: something can be scheduled now or later without new input;
  ``next_ready_at()``: the earliest pending KV reception time (None when none).
- ``reset_prefix_cache()``: the block manager's ``reset()`` (False while blocks are used).
- ``drain_events()``: the block manager's KV events since the last call.
- ``load()``: (running, waiting incl. receiving, KV usage, total blocks);
  ``counters``: cumulative counts (see :data:`COUNTERS`);
  ``modelled_tpot``: (request id, modelled time per output token after the first) of the
  last :data:`TPOT_HISTORY` requests that finished normally with two or more tokens: the
  summed ``duration_s`` of the steps that gave its later tokens over their count. It is
  what the timing model says, free of the host's scheduling noise (tests assert SLOs on
  it; clients measure wall time).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from workers.engines.mock.blocks import BlockManager
from workers.engines.mock.timing import PolynomialTiming, TimingModel, transfer_ms

WAITING, WAITING_FOR_KV, RUNNING, FINISHED = "waiting", "waiting_for_kv", "running", "finished"

COUNTERS = (
    "steps", "prefill_tokens", "decode_tokens", "generated_tokens", "finished_requests",
    "aborted_requests", "preemptions", "prefix_cache_queries_tokens",
    "prefix_cache_hits_tokens", "kv_transfers", "kv_transfer_bytes",
    "kv_external_loaded_tokens", "evicted_blocks",
)
TPOT_HISTORY = 4096
_PAIR = struct.Struct("<QQ")
_U32LE = struct.Struct("<I")
_U32 = "I" if array("I").itemsize == 4 else "L"  # an array typecode of 4-byte items


@dataclass
class SchedulerConfig:
    """Sizes, limits and timing of one simulated engine."""

    num_blocks: int = 4096
    block_size: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    timing: TimingModel = field(default_factory=PolynomialTiming)
    speedup_ratio: float = 1.0
    kv_bytes_per_block: int = 4 << 20  # Llama-3-8B bf16 at 32 tokens per block
    transfer_bandwidth: float = 25e9  # bytes/s of the simulated P→D link
    vocab_size: int = 32000
    eos_token_id: int | None = None  # None: never stops on its own
    seed: int = 0
    engine_id: str = "mock"  # named in a prefill's kv_transfer_params

    def validate(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if not self.speedup_ratio > 0:
            raise ValueError("speedup_ratio must be > 0")
        if self.kv_bytes_per_block < 0 or not self.transfer_bandwidth > 0:
            raise ValueError("kv_bytes_per_block must be >= 0 and transfer_bandwidth > 0")
        if self.vocab_size < 1:
            raise ValueError("vocab_size must be >= 1")


@dataclass
class SimRequest:
    """A request inside the simulated engine (inputs first, then state)."""

    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None
    min_tokens: int = 0  # stop tokens (eos, stop_token_ids) suppressed before this many
    remote_prefill: bool = False  # decode side of a handoff: prompt KV is received
    remote_decode: bool = False  # prefill side: answer with handoff parameters
    cache_salt: str = ""  # the tenant's prefix-cache salt (blocks hash with it)
    # state
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: str = WAITING
    cached_tokens: int = -1
    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    kv_ready_at: float | None = None
    received_tokens: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    token_hash: Any = None  # xxh3_64 state over (seeds, tokens so far); see _sample
    decode_s: float = 0.0  # modelled time of the steps that gave its 2nd..last tokens
    # chained hashes of leading full blocks of ``tokens`` (from its admission's lookup),
    # reused when those blocks are cached
    prefix_hashes: list[int] = field(default_factory=list)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class StepOutput:
    """What one step (or an abort) produced for one request."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt: int = 0
    num_output: int = 0
    cached_tokens: int = 0
    queue_s: float | None = None
    prefill_s: float | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Batch:
    """One step's scheduled work: (request, tokens to compute) and its modelled time."""

    entries: list[tuple[SimRequest, int]]
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_usage: float = 0.0
    duration_s: float = 0.0
    started_at: float = 0.0

    @property
    def empty(self) -> bool:
        return not self.entries


class Scheduler:
    """See the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   enable_caching=config.enable_prefix_caching)
        self.waiting: deque[SimRequest] = deque()
        self.receiving: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # (request id, modelled TPOT in s) of the latest requests finished with 2+ tokens
        self.modelled_tpot: deque[tuple[str, float]] = deque(maxlen=TPOT_HISTORY)

    # -- input ---------------------------------------------------------------------------

    def add(self, req: SimRequest, now: float) -> None:
        """Queues ``req``; raises ValueError for a duplicate live id or an empty prompt."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        if not req.prompt:
            raise ValueError("the prompt is empty")
        req.tokens = list(req.prompt)
        req.arrival = now
        req.status = WAITING
        req.token_hash = self._prompt_hash(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _prompt_hash(self, req: SimRequest) -> Any:
        """The xxh3_64 state over the seeds and the prompt (the first token's input)."""
        h = xxhash.xxh3_64()
        h.update(_PAIR.pack(self.config.seed & (2**64 - 1),
                            (req.sampling_seed or 0) & (2**64 - 1)))
        try:  # the little-endian u32 tokens, packed fast (array is native-endian)
            packed = array(_U32, req.prompt)
            if sys.byteorder != "little":
                packed.byteswap()
            h.update(packed.tobytes())
        except OverflowError:  # a token outside [0, 2**32): keep its low 32 bits
            h.update(struct.pack(f"<{len(req.prompt)}I",
                                 *(t & 0xFFFFFFFF for t in req.prompt)))
        return h

    def _sample(self, req: SimRequest) -> int:
        """The next token: the hash of everything before it (intdigest does not finalize
        the streaming state), then the state absorbs the token. Before ``min_tokens``
        outputs a stop token (eos, ``stop_token_ids``) is suppressed, as vLLM masks its
        logit: the next candidate (digest + i, i = 1, 2, ...) is taken instead; only the
        token taken enters the state."""
        h = req.token_hash
        digest, vocab = h.intdigest(), self.config.vocab_size
        tok = int(digest % vocab)
        if req.min_tokens and req.num_output < req.min_tokens:
            banned = set(req.stop_token_ids)
            if self.config.eos_token_id is not None:
                banned.add(self.config.eos_token_id)
            if sum(0 <= t < vocab for t in banned) < vocab:  # else nothing is left
                i = 0
                while tok in banned:
                    i += 1
                    tok = int((digest + i) % vocab)
        h.update(_U32LE.pack(tok))
        return tok

    def abort(self, request_id: str, now: float) -> StepOutput | None:
        """Removes a live request; see the module docstring."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING_FOR_KV:
            self.receiving.remove(req)
        else:
            self.waiting.remove(req)
        self.counters["aborted_requests"] += 1
        return self._finish(req, "abort")

    def _finish(self, req: SimRequest, reason: str) -> StepOutput:
        params = self._release(req, reason)
        return StepOutput(req.request_id, [], True, reason, req.num_prompt, req.num_output,
                          max(req.cached_tokens, 0), kv_transfer_params=params)

    def _release(self, req: SimRequest, reason: str) -> dict[str, Any] | None:
        """Ends ``req`` (frees its blocks, forgets it); its ``kv_transfer_params``."""
        req.status = FINISHED
        req.finish_reason = reason
        params = None
        if req.remote_decode and reason != "abort":
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.config.engine_id,
                      "remote_request_id": req.request_id,
                      "remote_block_ids": self.blocks.blocks_of(req.request_id),
                      "tp_size": 1}
        self.blocks.free(req.request_id)
        del self.requests[req.request_id]
        return params

    # -- one step ------------------------------------------------------------------------

    def schedule(self, now: float) -> Batch:
        """Plans one step; see the module docstring."""
        cfg = self.config
        bs = cfg.block_size
        self._finish_receptions(now)
        budget = cfg.max_num_batched_tokens
        entries: list[tuple[SimRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.tokens) - req.num_computed, budget)
            victim: SimRequest | None = None
            while not self.blocks.allocate(req.request_id, req.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if victim is req:
                break
            entries.append((req, n))
            budget -= n
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting[0]
            if req.remote_prefill and req.kv_ready_at is None:
                if not self._start_reception(req, now):
                    break
                continue
            if not self.blocks.holds(req.request_id):  # fresh or preempted
                limit = (len(req.tokens) - 1) // bs * bs
                hashes = self.blocks.hash_blocks(req.tokens[:limit], salt=req.cache_salt)
                req.prefix_hashes = hashes
                hits = self.blocks.lookup(hashes)
                computed = hits * bs
                n = min(len(req.tokens) - computed, budget)
                if not self.blocks.allocate(req.request_id, computed + n, hashes[:hits]):
                    break
                req.num_computed = computed
                if req.cached_tokens < 0:
                    req.cached_tokens = computed
                    self.counters["prefix_cache_queries_tokens"] += len(req.tokens)
                    self.counters["prefix_cache_hits_tokens"] += computed
            else:  # its KV was received: compute the rest (one token)
                n = min(len(req.tokens) - req.num_computed, budget)
                if not self.blocks.allocate(req.request_id, req.num_computed + n):
                    break
            self.waiting.popleft()
            req.status = RUNNING
            if req.first_scheduled is None:
                req.first_scheduled = now
            self.running.append(req)
            entries.append((req, n))
            budget -= n
        batch = Batch(entries, started_at=now, kv_usage=self.blocks.usage)
        for req, n in entries:
            if n == 1 and req.num_computed > 0:
                batch.decode_seqs += 1
            else:
                batch.prefill_tokens += n
        ms = cfg.timing.step_ms(batch.prefill_tokens, batch.decode_seqs, batch.kv_usage)
        batch.duration_s = ms / 1000.0 / cfg.speedup_ratio
        return batch

    def _preempt(self, req: SimRequest) -> None:
        self.blocks.free(req.request_id)
        req.num_computed = 0
        req.status = WAITING
        req.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(req)

    def _start_reception(self, req: SimRequest, now: float) -> bool:
        """Allocates a remote-prefill request's prompt blocks and starts its transfer."""
        cfg = self.config
        bs = cfg.block_size
        n_prompt = req.num_prompt
        hashes = self.blocks.hash_blocks(req.prompt[:(n_prompt - 1) // bs * bs],
                                         salt=req.cache_salt)
        req.prefix_hashes = hashes
        hits = self.blocks.lookup(hashes)
        if not self.blocks.allocate(req.request_id, n_prompt, hashes[:hits]):
            return False
        self.waiting.popleft()
        local = hits * bs
        recv_blocks = -(-n_prompt // bs) - hits
        nbytes = recv_blocks * cfg.kv_bytes_per_block
        req.kv_ready_at = now + transfer_ms(nbytes, cfg.transfer_bandwidth) / 1000.0 / (
            cfg.speedup_ratio)
        req.received_tokens = n_prompt - local
        req.status = WAITING_FOR_KV
        req.first_scheduled = now
        self.receiving.append(req)
        self.counters["prefix_cache_queries_tokens"] += n_prompt
        self.counters["prefix_cache_hits_tokens"] += local
        self.counters["kv_transfers"] += 1
        self.counters["kv_transfer_bytes"] += nbytes
        self.counters["kv_external_loaded_tokens"] += req.received_tokens
        return True

    def _finish_receptions(self, now: float) -> None:
        done = [r for r in self.receiving if r.kv_ready_at is not None and r.kv_ready_at <= now]
        if not done:
            return
        for req in sorted(done, key=lambda r: (r.kv_ready_at, r.arrival), reverse=True):
            self.receiving.remove(req)
            req.num_computed = req.num_prompt - 1
            req.cached_tokens = req.num_computed
            self.blocks.commit(req.request_id, req.tokens, req.num_computed, req.cache_salt,
                               req.prefix_hashes)
            req.status = WAITING
            self.waiting.appendleft(req)

    def complete(self, batch: Batch, now: float) -> list[StepOutput]:
        """Applies a scheduled step; see the module docstring."""
        cfg = self.config
        bs = cfg.block_size
        counters = self.counters
        out: list[StepOutput] = []
        counters["steps"] += 1
        counters["prefill_tokens"] += batch.prefill_tokens
        counters["decode_tokens"] += batch.decode_seqs
        finished = False
        for req, n in batch.entries:
            if req.status != RUNNING:
                continue  # aborted (or preempted) meanwhile
            computed = req.num_computed + n
            req.num_computed = computed
            if computed // bs != (computed - n) // bs:
                # a block filled up (the ones full before were cached by the earlier step,
                # the admission's cache hits or the KV reception)
                self.blocks.commit(req.request_id, req.tokens, computed, req.cache_salt,
                                   req.prefix_hashes)
            tokens = req.tokens
            if computed < len(tokens):
                continue  # more prefill chunks to come
            tok = self._sample(req)
            tokens.append(tok)
            num_tokens = len(tokens)
            num_prompt = len(req.prompt)
            num_output = num_tokens - num_prompt
            counters["generated_tokens"] += 1
            so = StepOutput(req.request_id, [tok], False, None, num_prompt, num_output,
                            max(req.cached_tokens, 0))
            if req.first_token is not None:
                req.decode_s += batch.duration_s
            else:
                req.first_token = now
                start = req.first_scheduled if req.first_scheduled is not None else now
                so.queue_s = max(0.0, start - req.arrival)
                so.prefill_s = max(0.0, now - start)
            reason = None
            if num_output >= req.max_tokens or num_tokens >= cfg.max_model_len:
                reason = "length"
            elif tok in req.stop_token_ids or (
                    tok == cfg.eos_token_id and not req.ignore_eos):
                reason = "stop"
            if reason is not None:
                so.finished, so.finish_reason = True, reason
                so.kv_transfer_params = self._release(req, reason)
                counters["finished_requests"] += 1
                if num_output > 1:
                    self.modelled_tpot.append((req.request_id, req.decode_s / (num_output - 1)))
                finished = True
            out.append(so)
        if finished:
            self.running = [r for r in self.running if r.status == RUNNING]
        counters["evicted_blocks"] = self.blocks.evictions
        return out

    # -- state ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        """True when a step could do something now (running or admissible waiting work)."""
        return bool(self.running or self.waiting)

    def next_ready_at(self) -> float | None:
        """The earliest pending KV reception end, or None."""
        times = [r.kv_ready_at for r in self.receiving if r.kv_ready_at is not None]
        return min(times) if times else None

    def reset_prefix_cache(self) -> bool:
        return self.blocks.reset()

    def drain_events(self) -> list[dict[str, Any]]:
        return self.blocks.drain_events()

    def load(self) -> tuple[int, int, float, int]:
        """(running, waiting incl. receiving KV, KV usage, total blocks)."""
        return (len(self.running), len(self.waiting) + len(self.receiving),
                self.blocks.usage, self.blocks.num_blocks)
