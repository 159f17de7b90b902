"""Two AFD transports on one host: in-process queues (tests) and shared memory.

Both implement :class:`~workers.engines.afd.connector.AfdConnector` (its module docstring
is the contract). Common to both:

- Sends validate: ``hidden`` is float32 ``[ctx.num_tokens, hidden_size]``,
  ``num_tokens <= max_tokens`` (else ValueError), ``attention_id`` < ``attention_workers``
  and ``microbatch`` < ``microbatches`` (ValueError).
- Attention side ``recv_ffn_output(ctx)`` returns the reply for exactly ``(layer,
  microbatch, step)`` of ``ctx``: replies for another in-flight microbatch are kept for
  their own ``recv``; replies of an older step (left over from an abandoned step) are
  dropped.
- FFN side: an attention worker that leaves (closes, dies) is dropped and the FFN keeps
  serving the others; ``recv_attn_output`` raises :class:`AfdPeerGone` only once this FFN
  connector is closed. ``send_ffn_output`` to a departed attention worker raises
  :class:`AfdPeerGone` (the FFN server counts it and goes on).
- Attention side: the FFN closing or dying raises :class:`AfdPeerGone` from the next send
  or recv; silence raises :class:`AfdTimeout` after ``timeout`` seconds; ``timeout=0``
  polls.

Shared memory (:class:`ShmFfnConnector`, :class:`ShmAttentionConnector`): the FFN side
creates ``/dev/shm/kvmesh-afd-<name>``, pre-sized to one slot of
``AfdTransportConfig.slot_bytes()`` per ``(attention_id, microbatch, direction)``, and
listens on the abstract UNIX ``SOCK_SEQPACKET`` socket ``\\0kvmesh-afd-<name>``. An
attention worker connects (retrying until ``connect_timeout``), says hello with its
attention id, and maps the file. A message is the payload written into its slot, then the
32-byte :func:`pack_context` header sent on the socket: the socket is both the wakeup
(a blocking ``select``, no spinning, which matters on 2 shared cores) and the liveness
signal (the kernel closes a dead process's end, so the peer sees EOF or EPIPE at once).
One slot per direction suffices: a microbatch sends its next layer only after the reply
to the previous one arrived, so the FFN has finished reading the slot by then.
"""

from __future__ import annotations

import collections
import mmap
import os
import queue
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.engines.afd.connector import (
    HEADER_BYTES,
    STAGE_ATTN_OUTPUT,
    STAGE_FFN_OUTPUT,
    AfdConnector,
    AfdContext,
    AfdPeerGone,
    AfdTimeout,
    AfdTransportConfig,
    pack_context,
    unpack_context,
)

STAGE_HELLO = 2  # shared memory: the first message of an attention connection
SHM_DIR = Path("/dev/shm")


def _validate(config: AfdTransportConfig, hidden: torch.Tensor, ctx: AfdContext) -> None:
    if hidden.dtype != torch.float32:
        raise ValueError(f"AFD hidden must be float32, got {hidden.dtype}")
    if hidden.dim() != 2 or hidden.shape[1] != config.hidden_size:
        raise ValueError(f"AFD hidden must be [num_tokens, {config.hidden_size}], "
                         f"got {list(hidden.shape)}")
    if hidden.shape[0] != ctx.num_tokens:
        raise ValueError(f"ctx.num_tokens={ctx.num_tokens} but hidden has {hidden.shape[0]} rows")
    if ctx.num_tokens > config.max_tokens:
        raise ValueError(f"num_tokens {ctx.num_tokens} exceeds max_tokens {config.max_tokens}")
    if not 0 <= ctx.attention_id < config.attention_workers:
        raise ValueError(f"attention_id {ctx.attention_id} out of range "
                         f"(attention_workers={config.attention_workers})")
    if not 0 <= ctx.microbatch < config.microbatches:
        raise ValueError(f"microbatch {ctx.microbatch} out of range "
                         f"(microbatches={config.microbatches})")


class _ReplyMatcher:
    """Attention side: hold replies that arrived for another in-flight microbatch."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int, int], tuple[AfdContext, torch.Tensor | None]] = {}

    def take(self, ctx: AfdContext) -> tuple[AfdContext, torch.Tensor | None] | None:
        return self._held.pop((ctx.layer, ctx.microbatch, ctx.step), None)

    def offer(self, want: AfdContext, got: AfdContext, payload: torch.Tensor | None) -> bool:
        """True when ``got`` answers ``want``; otherwise keep it (or drop it if stale)."""
        if (got.layer, got.microbatch, got.step) == (want.layer, want.microbatch, want.step):
            return True
        if got.step >= want.step:
            self._held[(got.layer, got.microbatch, got.step)] = (got, payload)
        self._held = {k: v for k, v in self._held.items() if k[2] >= want.step}
        return False


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


# ----------------------------------------------------------------------------- in-process

@dataclass(frozen=True)
class _Left:
    """In-process: an attention worker closed its connector."""

    attention_id: int


_ToFfn = tuple[AfdContext, torch.Tensor] | _Left
_ToAttn = tuple[AfdContext, torch.Tensor] | None  # None: the FFN side closed


class InProcessHub:
    """Queues joining up to ``attention_workers`` attention connectors and one FFN
    connector in one process (threads). Payloads are copied on send."""

    def __init__(self, config: AfdTransportConfig) -> None:
        self.config = config
        self.to_ffn: queue.Queue[_ToFfn] = queue.Queue()
        self.to_attn: dict[int, queue.Queue[_ToAttn]] = {
            a: queue.Queue() for a in range(config.attention_workers)}

    def attention(self, attention_id: int) -> InProcessAttention:
        if attention_id not in self.to_attn:
            raise ValueError(f"attention_id {attention_id} out of range")
        return InProcessAttention(self, attention_id)

    def ffn(self) -> InProcessFfn:
        return InProcessFfn(self)


class InProcessAttention(AfdConnector):
    def __init__(self, hub: InProcessHub, attention_id: int) -> None:
        self.hub = hub
        self.attention_id = attention_id
        self._inbox = hub.to_attn[attention_id]
        self._matcher = _ReplyMatcher()
        self._closed = False
        self._peer_gone = False

    def send_attn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        if self._closed or self._peer_gone:
            raise AfdPeerGone("AFD connector closed" if self._closed else "FFN side closed")
        if ctx.attention_id != self.attention_id or ctx.stage != STAGE_ATTN_OUTPUT:
            raise ValueError(f"ctx {ctx} is not this attention worker's attention output")
        _validate(self.hub.config, hidden, ctx)
        self.hub.to_ffn.put((ctx, hidden.clone()))

    def recv_ffn_output(self, ctx: AfdContext, timeout: float) -> torch.Tensor:
        held = self._matcher.take(ctx)
        if held is not None and held[1] is not None:
            return held[1]
        deadline = time.monotonic() + timeout
        while True:
            if self._peer_gone or self._closed:
                raise AfdPeerGone("FFN side closed")
            try:
                rem = _remaining(deadline)
                item = self._inbox.get(timeout=rem) if rem > 0 else self._inbox.get_nowait()
            except queue.Empty:
                raise AfdTimeout(f"no FFN output for {ctx} within {timeout}s") from None
            if item is None:
                self._peer_gone = True
                continue
            got, payload = item
            if self._matcher.offer(ctx, got, payload):
                return payload

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.hub.to_ffn.put(_Left(self.attention_id))


class InProcessFfn(AfdConnector):
    def __init__(self, hub: InProcessHub) -> None:
        self.hub = hub
        self._closed = False
        self._gone: set[int] = set()

    def recv_attn_output(self, timeout: float) -> tuple[torch.Tensor, AfdContext]:
        deadline = time.monotonic() + timeout
        while True:
            if self._closed:
                raise AfdPeerGone("AFD connector closed")
            try:
                rem = _remaining(deadline)
                item = self.hub.to_ffn.get(timeout=rem) if rem > 0 else self.hub.to_ffn.get_nowait()
            except queue.Empty:
                raise AfdTimeout(f"no attention output within {timeout}s") from None
            if isinstance(item, _Left):
                self._gone.add(item.attention_id)
                continue
            ctx, payload = item
            self._gone.discard(ctx.attention_id)
            return payload, ctx

    def send_ffn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        if self._closed:
            raise AfdPeerGone("AFD connector closed")
        if ctx.stage != STAGE_FFN_OUTPUT:
            raise ValueError(f"ctx {ctx} is not an FFN output")
        _validate(self.hub.config, hidden, ctx)
        if ctx.attention_id in self._gone:
            raise AfdPeerGone(f"attention worker {ctx.attention_id} left")
        self.hub.to_attn[ctx.attention_id].put((ctx, hidden.clone()))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for q in self.hub.to_attn.values():
                q.put(None)


# ---------------------------------------------------------------------------- shared memory


def shm_path(name: str) -> Path:
    return SHM_DIR / f"kvmesh-afd-{name}"


def _socket_address(name: str) -> str:
    return f"\0kvmesh-afd-{name}"


class _ShmSlots:
    """The mapped file: a float32 view per (attention_id, microbatch, stage)."""

    def __init__(self, path: Path, config: AfdTransportConfig, create: bool) -> None:
        self.config = config
        size = config.attention_workers * config.microbatches * 2 * config.slot_bytes()
        if create:
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
            actual = os.fstat(fd).st_size
            if actual != size:
                os.close(fd)
                raise ValueError(f"{path} is {actual} bytes, not {size}: the FFN side "
                                 "runs another AfdTransportConfig")
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        floats = config.max_tokens * config.hidden_size
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}
        for a in range(config.attention_workers):
            for m in range(config.microbatches):
                for s in (STAGE_ATTN_OUTPUT, STAGE_FFN_OUTPUT):
                    off = ((a * config.microbatches + m) * 2 + s) * config.slot_bytes()
                    self._views[(a, m, s)] = torch.frombuffer(
                        self._mm, dtype=torch.float32, count=floats, offset=off
                    ).view(config.max_tokens, config.hidden_size)

    def write(self, ctx: AfdContext, hidden: torch.Tensor) -> None:
        self._views[(ctx.attention_id, ctx.microbatch, ctx.stage)][:ctx.num_tokens].copy_(hidden)

    def read(self, ctx: AfdContext) -> torch.Tensor:
        return self._views[(ctx.attention_id, ctx.microbatch, ctx.stage)][:ctx.num_tokens].clone()

    def close(self) -> None:
        self._views.clear()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the GC unmaps it later
                pass
            self._mm = None


class ShmFfnConnector(AfdConnector):
    """The FFN side of the shared-memory transport (module docstring)."""

    def __init__(self, name: str, config: AfdTransportConfig) -> None:
        self.name = name
        self.config = config
        self._path = shm_path(name)
        self._slots = _ShmSlots(self._path, config, create=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(_socket_address(name))
        self._listener.listen(config.attention_workers + 4)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._conns: dict[int, socket.socket] = {}  # attention_id -> connection
        self._ready: collections.deque[AfdContext] = collections.deque()
        self._closed = False

    def _drop(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        for aid, c in list(self._conns.items()):
            if c is conn:
                del self._conns[aid]
        conn.close()

    def _pump(self, timeout: float) -> None:
        for key, _ in self._sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self._listener:
                conn, _ = self._listener.accept()
                self._sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = sock.recv(HEADER_BYTES)
            except OSError:
                data = b""
            if not data:
                self._drop(sock)
                continue
            ctx = unpack_context(data)
            if ctx.stage == STAGE_HELLO:
                if not 0 <= ctx.attention_id < self.config.attention_workers:
                    self._drop(sock)
                    continue
                old = self._conns.get(ctx.attention_id)
                if old is not None and old is not sock:
                    self._drop(old)
                self._conns[ctx.attention_id] = sock
            elif ctx.stage == STAGE_ATTN_OUTPUT and self._conns.get(ctx.attention_id) is sock:
                self._ready.append(ctx)
            else:  # a peer that breaks the protocol is dropped
                self._drop(sock)

    def recv_attn_output(self, timeout: float) -> tuple[torch.Tensor, AfdContext]:
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self._closed:
                raise AfdPeerGone("AFD connector closed")
            rem = _remaining(deadline)
            self._pump(rem)
            if not self._ready and rem == 0:
                raise AfdTimeout(f"no attention output within {timeout}s")
        ctx = self._ready.popleft()
        return self._slots.read(ctx), ctx

    def send_ffn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        if self._closed:
            raise AfdPeerGone("AFD connector closed")
        if ctx.stage != STAGE_FFN_OUTPUT:
            raise ValueError(f"ctx {ctx} is not an FFN output")
        _validate(self.config, hidden, ctx)
        conn = self._conns.get(ctx.attention_id)
        if conn is None:
            raise AfdPeerGone(f"attention worker {ctx.attention_id} is not connected")
        self._slots.write(ctx, hidden)
        try:
            conn.send(pack_context(ctx), socket.MSG_NOSIGNAL)
        except OSError as e:
            self._drop(conn)
            raise AfdPeerGone(f"attention worker {ctx.attention_id} left: {e}") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        self._sel.close()
        self._listener.close()
        self._slots.close()
        self._path.unlink(missing_ok=True)


class ShmAttentionConnector(AfdConnector):
    """The attention side of the shared-memory transport (module docstring)."""

    def __init__(self, name: str, attention_id: int, config: AfdTransportConfig,
                 connect_timeout: float = 30.0) -> None:
        if not 0 <= attention_id < config.attention_workers:
            raise ValueError(f"attention_id {attention_id} out of range "
                             f"(attention_workers={config.attention_workers})")
        self.attention_id = attention_id
        self.config = config
        self._matcher = _ReplyMatcher()
        self._closed = False
        deadline = time.monotonic() + connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(_socket_address(name))
                break
            except (ConnectionRefusedError, FileNotFoundError) as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise AfdTimeout(f"no AFD FFN worker at {name!r} within "
                                     f"{connect_timeout}s") from e
                time.sleep(0.02)  # retry pacing only; the deadline bounds it
        self._sock = sock
        self._slots = _ShmSlots(shm_path(name), config, create=False)
        self._send_header(AfdContext(attention_id, 0, 0, STAGE_HELLO, 0, 0))

    def _send_header(self, ctx: AfdContext) -> None:
        try:
            self._sock.send(pack_context(ctx), socket.MSG_NOSIGNAL)
        except OSError as e:
            raise AfdPeerGone(f"FFN worker gone: {e}") from e

    def send_attn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        if self._closed:
            raise AfdPeerGone("AFD connector closed")
        if ctx.attention_id != self.attention_id or ctx.stage != STAGE_ATTN_OUTPUT:
            raise ValueError(f"ctx {ctx} is not this attention worker's attention output")
        _validate(self.config, hidden, ctx)
        self._slots.write(ctx, hidden)
        self._send_header(ctx)

    def recv_ffn_output(self, ctx: AfdContext, timeout: float) -> torch.Tensor:
        held = self._matcher.take(ctx)
        if held is not None:
            return self._slots.read(held[0])
        deadline = time.monotonic() + timeout
        while True:
            if self._closed:
                raise AfdPeerGone("AFD connector closed")
            readable, _, _ = select.select([self._sock], [], [], _remaining(deadline))
            if not readable:
                raise AfdTimeout(f"no FFN output for {ctx} within {timeout}s")
            try:
                data = self._sock.recv(HEADER_BYTES)
            except OSError as e:
                raise AfdPeerGone(f"FFN worker gone: {e}") from e
            if not data:
                raise AfdPeerGone("FFN worker gone (connection closed)")
            got = unpack_context(data)
            if self._matcher.offer(ctx, got, None):
                return self._slots.read(got)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
            self._slots.close()


def make_shm_connector_pair_name() -> str:
    """A fresh transport name (pid and a counter), so concurrent tests never collide."""
    global _name_counter
    with _name_lock:
        _name_counter += 1
        return f"{os.getpid()}-{_name_counter}-{threading.get_ident() % 10000}"


_name_lock = threading.Lock()
_name_counter = 0
