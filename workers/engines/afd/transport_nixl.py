"""The NIXL transport of the AFD connector: one-sided WRITEs into pre-registered DRAM slots.

Contract (on top of :mod:`workers.engines.afd.connector`'s):

- ``NixlAfdConnector(role, config, attention_id=0, ...)`` creates one NIXL agent (UCX
  backend, progress thread off; the caller pins UCX to loopback first, e.g. with
  :data:`UCX_ENV` in the environment) and allocates and registers, once, an *inbound* and an
  *outbound* DRAM region of ``slots * config.slot_bytes()`` bytes each: attention side
  ``slots = config.microbatches`` (slot ``microbatch``), FFN side ``slots =
  config.attention_workers * config.microbatches`` (slot ``attention_id * microbatches +
  microbatch``). It also prepares the local descriptor list once: each slot is one strided
  descriptor of ``max_tokens`` rows of ``hidden_size * 4`` bytes, so the first ``n`` rows
  of a slot are ``n`` consecutive indices that NIXL merges into one contiguous descriptor.
  Nothing is registered after construction.
- ``info()`` returns the opaque bytes the peer needs (agent metadata, inbound base address,
  role, attention id, sizes, pid and host). The mesh carries them out of band (etcd/gRPC);
  ``connect(peer_info)`` adds the peer: the attention side connects to one FFN endpoint
  (connecting again replaces it, e.g. after an FFN restart), the FFN side to up to
  ``config.attention_workers`` attention endpoints, one per ``attention_id`` (a second one
  with the same id replaces the first: a restarted attention worker). Sizes must match
  exactly, else ValueError. ``connect`` prepares the remote descriptor list and wires the
  UCX endpoint up front; a transfer handle per ``(peer, slot, num_tokens)`` is made once
  (:meth:`nixl_agent.make_prepped_xfer`) and re-posted, so a steady-state message is one
  staging copy into the outbound slot plus one ``transfer`` (a WRITE carrying the 32-byte
  packed :class:`AfdContext` as its notification).
- In-band pairing (what the mesh uses, :mod:`workers.engines.afd.worker`): only the FFN's
  info travels out of band. The attention side calls ``connect(ffn_info)`` and then
  :meth:`announce`, a notification carrying its own ``info()``; the FFN side, inside any
  ``recv_attn_output`` (its own thread), connects that attention endpoint (replacing one
  of the same id) and answers *ack* — or *refused* with the reason (sizes differ, id out
  of range), then it stays unconnected. :meth:`wait_ready` (attention side) tells when
  the ack came: True; False on the timeout; ValueError with the FFN's reason on a refusal;
  AfdPeerGone when the FFN is known gone. Sending before the ack is allowed but the FFN
  drops messages of an endpoint it has not connected. NIXL delivers a notification from
  an agent whose metadata the receiver has not loaded (measured with NIXL 1.5.1), which
  is what makes the announcement possible.
- Protocol: the attention side WRITEs into the FFN's inbound slot for ``(attention_id,
  microbatch)``; the FFN side polls notifications, copies the slot out, and answers by
  WRITing into the attention side's inbound slot ``microbatch``. A slot is rewritten only
  after its previous message was answered (one outstanding layer per microbatch), so a
  reader never races a writer.
- Ordering: NIXL's UCX backend posts the data, then flushes the endpoint, and only sends the
  notification once the data and the flush have completed (``nixlUcxEngine::postXfer`` sends
  it at once when the WRITE completed inline, else ``checkXfer`` sends it when the request
  completes; ai-dynamo/nixl ``src/plugins/ucx/ucx_backend.cpp``). Hence a notification
  means its payload is complete, and a sender must poll its WRITE to completion before the
  notification leaves: every ``send_*`` returns only once its WRITE is DONE (within
  ``send_timeout_s``, else :class:`AfdTimeout`; the connection is then marked broken).
- Errors: a WRITE in state ERR (or a NIXL exception) → :class:`AfdPeerGone`, and the peer is
  marked gone until ``connect`` is called again. A ``recv_*`` polls (driving UCX progress)
  until a message, the timeout (:class:`AfdTimeout`), a goodbye notification from a peer
  that called ``close()``, or — for a peer on the same host — the peer's process having
  exited (checked about every ``liveness_interval_s``) → :class:`AfdPeerGone` on the
  attention side (:meth:`check_peers` runs that check at once, e.g. while idle). The FFN
  side keeps serving the other attention peers (as the shared-memory
  transport does): messages from a departed peer are dropped, ``send_ffn_output`` to it
  raises :class:`AfdPeerGone`, and ``recv_attn_output`` raises :class:`AfdPeerGone` only
  once this connector is closed. :meth:`peers` tells who is connected and who is gone.
  Stale answers (not the ``(layer, step)`` awaited, e.g. after a timeout) are dropped.
  Malformed notifications are logged and dropped. ``timeout=0`` polls once.
- Polling: NIXL offers no file descriptor to block on, so a recv polls: for ``spin_s`` after
  it starts it polls with ``sched_yield`` between rounds (measured here on 2 shared cores:
  a pure spin made the two sides wait out each other's scheduler time slices, ~4.5 ms per
  round trip), then sleeps between rounds (50 µs doubling to ``max_nap_s``), so an idle
  side does not hold a core.
- ``close()``: goodbye to every peer (best effort), release handles and descriptor lists,
  remove remote agents, deregister memory; idempotent. Calls after ``close`` raise
  :class:`AfdPeerGone`. NIXL 1.5.1 may segfault at interpreter exit, so a process that owns
  a connector ends with ``os._exit`` after ``close``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
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

log = logging.getLogger(__name__)

Role = Literal["attention", "ffn"]
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
_MAGIC = b"KVAFDNX1"
_INFO_HDR = struct.Struct("<8sI")  # magic, JSON length; the agent metadata follows the JSON
_BYE = b"kvmesh-afd-bye"
_HELLO = b"kvmesh-afd-hello:"  # attention -> FFN, followed by the attention's info()
_ACK = b"kvmesh-afd-ack"  # FFN -> attention: connected
_REFUSED = b"kvmesh-afd-refused:"  # FFN -> attention, followed by the reason (UTF-8)


@dataclass(frozen=True)
class EndpointInfo:
    """What one endpoint tells its peer (serialised by :meth:`to_bytes`)."""

    role: Role
    attention_id: int
    agent: str
    inbound_addr: int
    config: AfdTransportConfig
    pid: int
    host: str
    metadata: bytes

    def to_bytes(self) -> bytes:
        c = self.config
        head = json.dumps({
            "role": self.role, "attention_id": self.attention_id, "agent": self.agent,
            "inbound_addr": self.inbound_addr, "pid": self.pid, "host": self.host,
            "config": [c.hidden_size, c.max_tokens, c.microbatches, c.attention_workers],
        }).encode()
        return _INFO_HDR.pack(_MAGIC, len(head)) + head + self.metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> EndpointInfo:
        """Inverse of :meth:`to_bytes`; ValueError on anything else."""
        if len(data) < _INFO_HDR.size:
            raise ValueError("AFD endpoint info too short")
        magic, n = _INFO_HDR.unpack_from(data)
        if magic != _MAGIC or len(data) < _INFO_HDR.size + n:
            raise ValueError("not an AFD NIXL endpoint info")
        try:
            head = json.loads(data[_INFO_HDR.size:_INFO_HDR.size + n])
            role = head["role"]
            if role not in ("attention", "ffn"):
                raise ValueError(f"AFD endpoint info: bad role {role!r}")
            return cls(role, int(head["attention_id"]), str(head["agent"]),
                       int(head["inbound_addr"]), AfdTransportConfig(*map(int, head["config"])),
                       int(head["pid"]), str(head["host"]), data[_INFO_HDR.size + n:])
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"AFD endpoint info: {exc}") from exc


@dataclass
class _Peer:
    info: EndpointInfo
    name: str  # the remote agent name NIXL returned
    dlist: Any  # prepped remote descriptor list over the peer's inbound slots
    handles: dict[tuple[int, int], Any] = field(default_factory=dict)  # (slot, n) -> xfer
    gone: str = ""  # why the peer is unusable ("" while it is fine)


def pid_gone(pid: int) -> bool:
    """True iff process ``pid`` on this host has exited (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    except (OSError, IndexError):
        return False  # cannot tell: rely on the timeout
    return state in (b"Z", b"X")


_pid_gone = pid_gone  # its former name


class NixlAfdConnector(AfdConnector):
    """One AFD endpoint over NIXL/UCX (module docstring)."""

    def __init__(self, role: Role, config: AfdTransportConfig, attention_id: int = 0, *,
                 name: str | None = None, send_timeout_s: float = 5.0,
                 ucx_err_mode: str = "none", spin_s: float = 2e-3, max_nap_s: float = 1e-3,
                 liveness_interval_s: float = 0.05) -> None:
        if role not in ("attention", "ffn"):
            raise ValueError(f"role must be 'attention' or 'ffn', not {role!r}")
        if min(config.hidden_size, config.max_tokens, config.microbatches,
               config.attention_workers) < 1:
            raise ValueError(f"AfdTransportConfig fields must be >= 1: {config}")
        if role == "attention" and not 0 <= attention_id < config.attention_workers:
            raise ValueError(f"attention_id {attention_id} not in "
                             f"[0, {config.attention_workers})")
        if send_timeout_s <= 0:
            raise ValueError("send_timeout_s must be > 0")
        from workers.kv.store_client import make_agent

        self.role: Role = role
        self.config = config
        self.attention_id = attention_id if role == "attention" else -1
        self._send_timeout_s = send_timeout_s
        self._spin_s = spin_s
        self._max_nap_s = max_nap_s
        self._liveness_s = liveness_interval_s
        self._row_bytes = config.hidden_size * 4
        self._slots = config.microbatches * (config.attention_workers if role == "ffn" else 1)
        shape = (self._slots, config.max_tokens, config.hidden_size)
        self._in = torch.zeros(shape, dtype=torch.float32)
        self._out = torch.zeros(shape, dtype=torch.float32)
        self._closed = False
        self._peers: dict[int, _Peer] = {}  # attention_id (the FFN peer is key -1) -> peer
        self._by_agent: dict[str, int] = {}  # remote agent name -> key in _peers
        self._pending_ffn: deque[AfdContext] = deque()  # FFN side: arrived, not yet returned
        self._pending_attn: dict[int, AfdContext] = {}  # attention side: microbatch -> ctx
        self._acked = False  # attention side: the FFN acknowledged our announcement
        self._refused = ""  # attention side: why the FFN refused it
        self._refused_agents: set[str] = set()  # FFN side: loaded only to answer a refusal
        agent_name = name or f"afd-{role}-{max(attention_id, 0)}-{uuid.uuid4().hex[:8]}"
        self._agent: Any = make_agent(agent_name, ucx_err_mode)
        nbytes = self._slots * config.slot_bytes()
        self._reg = self._agent.register_memory(
            [(self._in.data_ptr(), nbytes, 0, ""), (self._out.data_ptr(), nbytes, 0, "")],
            "DRAM")
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._strided(self._out.data_ptr()), "DRAM")
        self._info = EndpointInfo(role, self.attention_id, agent_name, self._in.data_ptr(),
                                  config, os.getpid(), socket.gethostname(),
                                  self._agent.get_agent_metadata())

    # ------------------------------------------------------------------ setup
    def _strided(self, base: int, slots: int | None = None) -> np.ndarray:
        """One strided descriptor per slot: ``max_tokens`` rows of ``row_bytes``."""
        n = self._slots if slots is None else slots
        rows = np.zeros((n, 5), dtype=np.uint64)
        rows[:, 0] = base + np.arange(n, dtype=np.uint64) * self.config.slot_bytes()
        rows[:, 1] = self._row_bytes
        rows[:, 3] = self._row_bytes
        rows[:, 4] = self.config.max_tokens
        return rows

    def info(self) -> bytes:
        """This endpoint's info for the peer's :meth:`connect` (module docstring)."""
        return self._info.to_bytes()

    def connect(self, peer_info: bytes) -> None:
        """Add (or replace) the peer described by ``peer_info``; ValueError if it cannot pair
        with this endpoint (same role, other sizes, attention id out of range)."""
        self._check_open()
        info = EndpointInfo.from_bytes(peer_info)
        if info.role == self.role:
            raise ValueError(f"cannot pair two {self.role} endpoints")
        if info.config != self.config:
            raise ValueError(f"peer sizes {info.config} differ from ours {self.config}")
        if info.role == "attention" and not 0 <= info.attention_id < self.config.attention_workers:
            raise ValueError(f"peer attention_id {info.attention_id} out of range")
        key = info.attention_id if info.role == "attention" else -1
        if key in self._peers:
            self._drop(key)
        raw = self._agent.add_remote_agent(info.metadata)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        try:
            peer_slots = self.config.microbatches * (
                self.config.attention_workers if info.role == "ffn" else 1)
            dlist = self._agent.prep_xfer_dlist(
                name, self._strided(info.inbound_addr, peer_slots), "DRAM")
            self._agent.make_connection(name)
        except Exception:
            self._agent.remove_remote_agent(name)
            raise
        self._peers[key] = _Peer(info, name, dlist)
        self._by_agent[name] = key
        if info.role == "ffn":
            self._pending_attn.clear()
            self._acked, self._refused = False, ""

    def announce(self) -> None:
        """Attention side, after ``connect(ffn_info)``: send our info to the FFN, which
        connects us and acknowledges (module docstring, in-band pairing)."""
        self._check_open()
        if self.role != "attention":
            raise RuntimeError("announce is for the attention side")
        peer = self._peer(-1)
        self._acked, self._refused = False, ""
        try:
            self._agent.send_notif(peer.name, _HELLO + self.info())
        except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError
            peer.gone = f"AFD announcement to {peer.info.agent} failed: {exc}"
            raise AfdPeerGone(peer.gone) from exc

    def wait_ready(self, timeout: float) -> bool:
        """Attention side: True once the FFN acknowledged :meth:`announce`; False after
        ``timeout``; ValueError with its reason when it refused; AfdPeerGone when it is
        known gone."""
        self._check_open()
        if self.role != "attention":
            raise RuntimeError("wait_ready is for the attention side")

        def ready() -> bool | None:
            if self._refused:
                raise ValueError(f"the AFD FFN endpoint refused this one: {self._refused}")
            self._peer(-1)
            return True if self._acked else None

        try:
            return bool(self._wait(ready, timeout, "the FFN's acknowledgement"))
        except AfdTimeout:
            return False

    def _accept(self, name: str, info_bytes: bytes) -> None:
        """FFN side: connect an announced attention endpoint, then ack it (or tell it why
        not: its metadata is loaded just for that answer)."""
        try:
            info = EndpointInfo.from_bytes(info_bytes)
        except ValueError as exc:
            log.warning("AFD NIXL: unreadable announcement from %s dropped: %s", name, exc)
            return
        try:
            if info.agent != name:
                raise ValueError(f"announcement from {name} names agent {info.agent}")
            if name in self._refused_agents:  # refused before: connect loads it anew
                self._refused_agents.discard(name)
                self._agent.remove_remote_agent(name)
            self.connect(info_bytes)
        except Exception as exc:  # refused: answer it, serve on
            log.warning("AFD NIXL: announcement from %s refused: %s", name, exc)
            reason = str(exc).encode()

            def refuse() -> None:
                # The refused agent stays loaded (so the answer can leave: UCX progresses
                # only inside NIXL calls); refusals are rare, never retried in a loop.
                if name not in self._by_agent and name not in self._refused_agents:
                    self._agent.add_remote_agent(info.metadata)
                    self._refused_agents.add(name)
                self._agent.send_notif(name, _REFUSED + reason)

            _best_effort(refuse, "refuse an announcement")
            return
        log.info("AFD NIXL: attention endpoint %d (%s) connected", info.attention_id, name)
        _best_effort(lambda: self._agent.send_notif(name, _ACK), "acknowledge")

    def _drop(self, key: int) -> None:
        peer = self._peers.pop(key)
        self._by_agent.pop(peer.name, None)
        for h in peer.handles.values():
            _best_effort(h.release, "release xfer handle")
        _best_effort(peer.dlist.release, "release remote dlist")
        _best_effort(lambda: self._agent.remove_remote_agent(peer.name), "remove_remote_agent")
        if key >= 0:
            self._pending_ffn = deque(c for c in self._pending_ffn if c.attention_id != key)

    # ------------------------------------------------------------------ sending
    def _check_open(self) -> None:
        if self._closed:
            raise AfdPeerGone("AFD NIXL connector is closed")

    def _peer(self, key: int) -> _Peer:
        peer = self._peers.get(key)
        if peer is None:
            what = "FFN endpoint" if key < 0 else f"attention endpoint {key}"
            raise AfdPeerGone(f"no {what} connected")
        if peer.gone:
            raise AfdPeerGone(peer.gone)
        return peer

    def _check_tensor(self, hidden: torch.Tensor, ctx: AfdContext, stage: int) -> int:
        n = ctx.num_tokens
        if ctx.stage != stage:
            raise ValueError(f"ctx.stage is {ctx.stage}, expected {stage}")
        if not 0 <= ctx.microbatch < self.config.microbatches:
            raise ValueError(f"ctx.microbatch {ctx.microbatch} not in "
                             f"[0, {self.config.microbatches})")
        if not 1 <= n <= self.config.max_tokens:
            raise ValueError(f"num_tokens {n} not in [1, max_tokens={self.config.max_tokens}]")
        if tuple(hidden.shape) != (n, self.config.hidden_size) or hidden.dtype != torch.float32:
            raise ValueError(f"hidden must be float32 [{n}, {self.config.hidden_size}], got "
                             f"{hidden.dtype} {list(hidden.shape)}")
        return n

    def _write(self, key: int, local_slot: int, remote_slot: int, hidden: torch.Tensor,
               ctx: AfdContext) -> None:
        """Stage ``hidden`` in the outbound slot and WRITE it with ``ctx`` as the notif."""
        peer = self._peer(key)
        n = ctx.num_tokens
        self._out[local_slot, :n].copy_(hidden)
        handle = peer.handles.get((remote_slot, n))
        try:
            if handle is None:
                mt = self.config.max_tokens
                handle = self._agent.make_prepped_xfer(
                    "WRITE", self._local, np.arange(local_slot * mt, local_slot * mt + n,
                                                    dtype=np.int32),
                    peer.dlist, np.arange(remote_slot * mt, remote_slot * mt + n,
                                          dtype=np.int32))
                peer.handles[(remote_slot, n)] = handle
            state = self._agent.transfer(handle, pack_context(ctx))
            deadline = time.monotonic() + self._send_timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    peer.gone = (f"AFD WRITE to {peer.info.agent} stuck past "
                                 f"{self._send_timeout_s} s")
                    raise AfdTimeout(peer.gone)
                state = self._agent.check_xfer_state(handle)
        except AfdTimeout:
            raise
        except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError
            state = f"ERR ({type(exc).__name__}: {exc})"
        if state != "DONE":
            peer.handles.pop((remote_slot, n), None)
            if handle is not None:
                _best_effort(handle.release, "release failed xfer handle")
            peer.gone = f"AFD WRITE to {peer.info.agent} failed: {state}"
            raise AfdPeerGone(peer.gone)

    def send_attn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        """Attention side: WRITE ``hidden`` into the FFN's slot for this microbatch."""
        self._check_open()
        if self.role != "attention":
            raise RuntimeError("send_attn_output is for the attention side")
        if ctx.attention_id != self.attention_id:
            raise ValueError(f"ctx.attention_id {ctx.attention_id} is not ours "
                             f"({self.attention_id})")
        self._check_tensor(hidden, ctx, STAGE_ATTN_OUTPUT)
        self._pending_attn.pop(ctx.microbatch, None)
        remote = self.attention_id * self.config.microbatches + ctx.microbatch
        self._write(-1, ctx.microbatch, remote, hidden, ctx)

    def send_ffn_output(self, hidden: torch.Tensor, ctx: AfdContext) -> None:
        """FFN side: WRITE the answer into the attention side's slot ``ctx.microbatch``."""
        self._check_open()
        if self.role != "ffn":
            raise RuntimeError("send_ffn_output is for the FFN side")
        if not 0 <= ctx.attention_id < self.config.attention_workers:
            raise ValueError(f"ctx.attention_id {ctx.attention_id} out of range")
        self._check_tensor(hidden, ctx, STAGE_FFN_OUTPUT)
        local = ctx.attention_id * self.config.microbatches + ctx.microbatch
        self._write(ctx.attention_id, local, ctx.microbatch, hidden, ctx)

    # ------------------------------------------------------------------ receiving
    def _poll(self) -> None:
        """Drive UCX progress once and file every new notification."""
        for agent, msgs in self._agent.get_new_notifs().items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            key = self._by_agent.get(name)
            for msg in msgs:
                if self.role == "ffn" and msg.startswith(_HELLO):
                    self._accept(name, msg[len(_HELLO):])
                    key = self._by_agent.get(name)
                elif key is None:
                    log.warning("AFD NIXL: notification from unknown agent %s dropped", name)
                elif msg.startswith(_BYE):
                    self._peers[key].gone = f"AFD peer {name} closed"
                elif key < 0 and msg == _ACK:
                    self._acked = True
                elif key < 0 and msg.startswith(_REFUSED):
                    self._refused = msg[len(_REFUSED):].decode(errors="replace") or "refused"
                elif len(msg) != HEADER_BYTES:
                    log.warning("AFD NIXL: %d-byte notification from %s dropped", len(msg), name)
                else:
                    self._file(key, unpack_context(msg), name)

    def _file(self, key: int, ctx: AfdContext, name: str) -> None:
        ok_size = 1 <= ctx.num_tokens <= self.config.max_tokens
        ok_mb = 0 <= ctx.microbatch < self.config.microbatches
        if self.role == "ffn":
            if ctx.stage == STAGE_ATTN_OUTPUT and ctx.attention_id == key and ok_size and ok_mb:
                self._pending_ffn.append(ctx)
                return
        elif ctx.stage == STAGE_FFN_OUTPUT and ctx.attention_id == self.attention_id \
                and ok_size and ok_mb:
            self._pending_attn[ctx.microbatch] = ctx
            return
        log.warning("AFD NIXL: bad header %s from %s dropped", ctx, name)

    def _wait(self, ready: Any, timeout: float, what: str) -> Any:
        """Poll until ``ready()`` returns non-None; AfdTimeout / AfdPeerGone otherwise."""
        start = time.monotonic()
        deadline = start + timeout
        next_live = start + self._liveness_s
        nap = 5e-5
        while True:
            self._poll()
            got = ready()
            if got is not None:
                return got
            now = time.monotonic()
            if now >= next_live:
                self._check_liveness()
                next_live = now + self._liveness_s
            if now >= deadline:
                raise AfdTimeout(f"no {what} within {timeout} s")
            if now - start < self._spin_s:
                os.sched_yield()  # a peer sharing this core gets to run at once
            else:
                time.sleep(min(nap, max(deadline - now, 0.0)))
                nap = min(nap * 2, self._max_nap_s)

    def _check_liveness(self) -> None:
        host = socket.gethostname()
        for peer in self._peers.values():
            if not peer.gone and peer.info.host == host and pid_gone(peer.info.pid):
                peer.gone = f"AFD peer {peer.info.agent} (pid {peer.info.pid}) exited"

    def recv_ffn_output(self, ctx: AfdContext, timeout: float) -> torch.Tensor:
        """Attention side: the FFN's answer to ``ctx`` (same layer, microbatch, step)."""
        self._check_open()
        if self.role != "attention":
            raise RuntimeError("recv_ffn_output is for the attention side")
        mb = ctx.microbatch
        if not 0 <= mb < self.config.microbatches:
            raise ValueError(f"ctx.microbatch {mb} out of range")

        def ready() -> torch.Tensor | None:
            got = self._pending_attn.get(mb)
            if got is not None:
                if (got.layer, got.step, got.num_tokens) == (ctx.layer, ctx.step, ctx.num_tokens):
                    del self._pending_attn[mb]
                    return self._in[mb, :got.num_tokens].clone()
                log.warning("AFD NIXL: stale answer %s dropped (awaiting %s)", got, ctx)
                del self._pending_attn[mb]
            self._peer(-1)  # raises AfdPeerGone once the FFN is known gone
            return None

        out: torch.Tensor = self._wait(ready, timeout, f"FFN output for {ctx}")
        return out

    def recv_attn_output(self, timeout: float) -> tuple[torch.Tensor, AfdContext]:
        """FFN side: the oldest attention output not yet returned, from any attention peer."""
        self._check_open()
        if self.role != "ffn":
            raise RuntimeError("recv_attn_output is for the FFN side")

        def ready() -> tuple[torch.Tensor, AfdContext] | None:
            while self._pending_ffn:
                ctx = self._pending_ffn.popleft()
                peer = self._peers.get(ctx.attention_id)
                if peer is None or peer.gone:
                    continue  # its sender is gone: nobody awaits the answer
                slot = ctx.attention_id * self.config.microbatches + ctx.microbatch
                return self._in[slot, :ctx.num_tokens].clone(), ctx
            return None

        out: tuple[torch.Tensor, AfdContext] = self._wait(ready, timeout, "attention output")
        return out

    def check_peers(self) -> dict[int, str]:
        """Runs the same-host liveness check now (a NIXL progress round too, so a
        goodbye is seen), then :meth:`peers`."""
        self._check_open()
        self._poll()
        self._check_liveness()
        return self.peers()

    def peers(self) -> dict[int, str]:
        """Connected peers: attention id (-1 for the FFN peer) → why it is gone, or ""."""
        return {key: peer.gone for key, peer in self._peers.items()}

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Goodbye to the peers, release everything (module docstring); idempotent."""
        if self._closed:
            return
        self._closed = True
        for peer in self._peers.values():
            if not peer.gone:
                _best_effort(lambda p=peer: self._agent.send_notif(p.name, _BYE), "goodbye")
        for _ in range(3):  # let the goodbyes leave: UCX only progresses inside NIXL calls
            _best_effort(self._agent.get_new_notifs, "final progress")
        for key in list(self._peers):
            self._drop(key)
        for name in self._refused_agents:
            _best_effort(lambda n=name: self._agent.remove_remote_agent(n), "remove refused")
        _best_effort(self._local.release, "release local dlist")
        _best_effort(lambda: self._agent.deregister_memory(self._reg), "deregister_memory")


def _best_effort(fn: Any, what: str) -> None:
    try:
        fn()
    except Exception as exc:  # cleanup: the peer may be gone already
        log.debug("AFD NIXL %s: %s", what, exc)
