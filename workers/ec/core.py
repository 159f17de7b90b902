"""The EC connector's pure parts: settings, descriptors, slot headers, slots, leases.

No vLLM, NIXL, I/O or clock here: callers pass ``now`` (seconds, any monotonic origin).

- :class:`EcSettings`: the connector's ``ec_connector_extra_config``, validated
  (:meth:`EcSettings.from_extra` names the bad field in its ValueError).
- :class:`Descriptor`: where one embedding lives on the producer (E): E's NIXL agent name
  and metadata, the registered address, the payload length, dtype and shape, the
  region file and offset of the slot, and the lease ``handle`` the consumer sends back
  when it has read it. ``to_params()`` / ``from_params()`` give the JSON-safe dict that
  travels in ``ec_transfer_params[mm_hash]["kvmesh"]`` (agent metadata in base64);
  ``from_params`` raises ValueError naming the bad field.
- Slot layout: ``[header (HEADER_BYTES)][payload]``. :func:`pack_header` /
  :func:`check_header`: magic, version, payload length and a digest of the ``mm_hash``;
  E writes the header after the payload and clears it when the slot is freed, so a
  consumer that read a freed or reused slot sees a mismatch, never wrong bytes.
- :func:`pack_stats` / :func:`unpack_stats`: E's live counters, kept in the first
  :data:`STATS_BYTES` of E's region so that anyone on the host who maps the region file
  (a test, the encoder service) can read them without asking EngineCore: the scheduler
  half's :data:`STATS_FIELDS` at 0, the worker half's :data:`WORKER_STATS_FIELDS` at
  :data:`WORKER_STATS_OFFSET` (``encodes``: vision encoder runs, one per ``save_caches``).
- :class:`SlotAllocator`: first-fit ranges of a fixed-size region, aligned; ``allocate``
  returns None when nothing fits (the caller then does not publish); ``free`` merges
  neighbours.
- :class:`LeaseBook`: E's delayed-free rule, the KV handoff's: a slot is kept while a
  live request uses it (``hold``), then per published handle until the consumer says it
  has read it (``release``) or the lease runs out (``expire``). Each operation returns the
  ``mm_hash``es that became free (no holder, no handle).
- :class:`RetainLru`: E's embedding cache after the delayed-free rule is met: slots with
  no holder and no live handle, kept (header intact) in LRU order within a byte budget
  (``retain_mib``) and evicted first when a new slot needs room. A retained slot is never
  pinned: a consumer reading it relies on the read protocol (header, payload, header
  again; see :mod:`workers.ec.scheduler`) to see an eviction, never wrong bytes.
- :class:`TransferReport`: what a consumer measured for one embedding of a request (its
  NIXL READ, or why it fell back to a local encode): the ``mm_hash``, the ``outcome``
  (:data:`OUTCOMES`: ``read``, ``shared`` (a READ another live request started) or
  ``fallback`` with its ``reason``), the payload bytes, wall-clock ``start_ns`` /
  ``end_ns`` (``time.time_ns``: one clock for every process on the host, so a span can
  be drawn from them elsewhere), the monotonic ``seconds`` in between, and E's NIXL
  ``agent``. The consumer's ``request_finished`` returns them as the request's
  ``ec_transfer_params[TRANSFERS_KEY]`` (a list of :meth:`TransferReport.to_dict`), which
  vLLM carries to the request's final ``RequestOutput`` whether EngineCore runs in the
  caller's process or not; :func:`transfer_reports` reads them back (ValueError naming
  the bad field).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HEADER_BYTES = 64
_MAGIC = b"KVEC"
_VERSION = 1
_HEADER = struct.Struct("<4sHHQ32s")  # magic, version, flags, payload bytes, digest
PARAMS_KEY = "kvmesh"  # ec_transfer_params[mm_hash][PARAMS_KEY] = Descriptor.to_params()
NOTIF_PREFIX = b"kvmesh-ec-read:"

STATS_FIELDS = ("published", "released", "expired", "freed", "held", "publish_failures",
                "retained", "evicted")
WORKER_STATS_FIELDS = ("encodes", "saves", "save_bytes", "save_mismatches")
WORKER_STATS_OFFSET = 64  # the worker half's block; the scheduler half's is at 0
STATS_BYTES = 128

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

TRANSFERS_KEY = "kvmesh_transfers"  # a consumer's ec_transfer_params[TRANSFERS_KEY]
OUTCOMES = ("read", "shared", "fallback")


@dataclass(frozen=True)
class EcSettings:
    """``ec_connector_extra_config`` of the kvmesh EC connector (see the module doc)."""

    pool_mib: int = 64  # E: embeddings held for consumers; consumer: staging for reads
    lease_s: float = 30.0  # E keeps an unread embedding this long after it was published
    transfer_timeout_s: float = 10.0  # consumer: a READ not done by then fails
    poll_interval_s: float = 0.005  # E: how often it polls NIXL notifications and leases
    region_dir: str = "/dev/shm"  # where the shared (scheduler <-> worker) regions live
    retain_mib: int = 0  # E: bytes of read or expired embeddings kept as a cache (0: none)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> EcSettings:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known - {"shared_storage_path"})
        if unknown:
            raise ValueError(f"ec_connector_extra_config: unknown keys {unknown}")
        try:
            s = cls(**{k: type(getattr(cls, k))(v) for k, v in extra.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"ec_connector_extra_config: {exc}") from exc
        s.validate()
        return s

    @property
    def pool_bytes(self) -> int:
        return self.pool_mib << 20

    def validate(self) -> None:
        if self.pool_mib <= 0:
            raise ValueError(f"pool_mib must be positive, got {self.pool_mib}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {self.lease_s}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be positive, got {self.transfer_timeout_s}")
        if not 0 < self.poll_interval_s <= 1:
            raise ValueError(f"poll_interval_s must be in (0, 1], got {self.poll_interval_s}")
        if not self.region_dir:
            raise ValueError("region_dir must not be empty")
        if not 0 <= self.retain_mib <= self.pool_mib:
            raise ValueError(f"retain_mib must be in 0..pool_mib ({self.pool_mib}), got "
                             f"{self.retain_mib}")

    @property
    def retain_bytes(self) -> int:
        return self.retain_mib << 20


def payload_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a dense tensor; ValueError for an unknown dtype or a negative dimension."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if any(int(d) < 0 for d in shape):
        raise ValueError(f"shape must not be negative, got {list(shape)}")
    return math.prod(int(d) for d in shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Descriptor:
    """Where one embedding lives on E (see the module docstring)."""

    agent: str
    agent_metadata: bytes
    addr: int  # E's address of the slot's header; the payload follows HEADER_BYTES later
    nbytes: int  # payload bytes
    dtype: str
    shape: tuple[int, ...]
    handle: str
    region: str = ""
    offset: int = 0

    @property
    def slot_bytes(self) -> int:
        return HEADER_BYTES + self.nbytes

    def to_params(self) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "agent": self.agent,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
            "addr": self.addr,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "handle": self.handle,
            "region": self.region,
            "offset": self.offset,
        }

    @classmethod
    def from_params(cls, params: Any) -> Descriptor:
        if not isinstance(params, Mapping):
            raise ValueError(f"descriptor must be a mapping, got {type(params).__name__}")
        if params.get("version") != _VERSION:
            raise ValueError(f"descriptor version must be {_VERSION}, got "
                             f"{params.get('version')!r}")
        for key, kind in (("agent", str), ("agent_metadata", str), ("handle", str),
                          ("dtype", str), ("addr", int), ("nbytes", int)):
            if not isinstance(params.get(key), kind) or isinstance(params.get(key), bool):
                raise ValueError(f"descriptor field {key!r} must be {kind.__name__}, got "
                                 f"{params.get(key)!r}")
        shape = params.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise ValueError(f"descriptor field 'shape' must be a list of int, got {shape!r}")
        if payload_bytes(params["dtype"], shape) != params["nbytes"]:
            raise ValueError(f"descriptor field 'nbytes' {params['nbytes']} does not match "
                             f"dtype {params['dtype']} and shape {shape}")
        if params["addr"] <= 0:
            raise ValueError(f"descriptor field 'addr' must be positive, got {params['addr']}")
        try:
            meta = base64.b64decode(params["agent_metadata"], validate=True)
        except ValueError as exc:
            raise ValueError(f"descriptor field 'agent_metadata' is not base64: {exc}") from exc
        return cls(params["agent"], meta, params["addr"], params["nbytes"], params["dtype"],
                   tuple(shape), params["handle"], str(params.get("region", "")),
                   int(params.get("offset", 0)))


def _digest(mm_hash: str) -> bytes:
    return hashlib.sha256(mm_hash.encode("utf-8")).digest()


def pack_header(mm_hash: str, nbytes: int) -> bytes:
    """The slot header for ``mm_hash``'s payload of ``nbytes`` (HEADER_BYTES long)."""
    return _HEADER.pack(_MAGIC, _VERSION, 0, nbytes, _digest(mm_hash)).ljust(HEADER_BYTES,
                                                                                b"\0")


def check_header(header: bytes, mm_hash: str, nbytes: int) -> str | None:
    """None when ``header`` announces ``mm_hash``'s payload of ``nbytes``; else why not."""
    if len(header) < _HEADER.size:
        return f"header too short ({len(header)} B)"
    magic, version, _flags, n, digest = _HEADER.unpack_from(header)
    if magic != _MAGIC:
        return "no embedding in the slot (never written, or freed)"
    if version != _VERSION:
        return f"header version {version}, expected {_VERSION}"
    if n != nbytes:
        return f"slot holds {n} B, descriptor says {nbytes} B"
    if digest != _digest(mm_hash):
        return "slot holds another embedding (freed and reused)"
    return None


def pack_stats(counters: Mapping[str, int], fields: Sequence[str] = STATS_FIELDS) -> bytes:
    """One half's counters (``fields``, missing ones 0) as its stats block (64 B)."""
    values = [int(counters.get(name, 0)) for name in fields]
    return struct.pack(f"<{len(fields)}Q", *values).ljust(WORKER_STATS_OFFSET, b"\0")


def unpack_stats(block: bytes) -> dict[str, int]:
    """The counters in a region's stats block (the worker half's too when ``block`` has
    all :data:`STATS_BYTES`)."""
    out = dict(zip(STATS_FIELDS, struct.unpack_from(f"<{len(STATS_FIELDS)}Q", block),
                   strict=True))
    if len(block) >= STATS_BYTES:
        out.update(zip(WORKER_STATS_FIELDS, struct.unpack_from(
            f"<{len(WORKER_STATS_FIELDS)}Q", block, WORKER_STATS_OFFSET), strict=True))
    return out


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass
class SlotAllocator:
    """First-fit allocation of ``[0, capacity)`` in ``alignment``-byte units."""

    capacity: int
    alignment: int = HEADER_BYTES
    _free: list[tuple[int, int]] = field(default_factory=list)  # sorted (start, length)
    _used: dict[int, int] = field(default_factory=dict)  # start -> length

    def __post_init__(self) -> None:
        if self.capacity <= 0 or self.alignment <= 0:
            raise ValueError("capacity and alignment must be positive")
        usable = self.capacity - self.capacity % self.alignment
        self._free = [(0, usable)] if usable else []

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a free range of at least ``nbytes``, or None when none fits."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        size = align_up(nbytes, self.alignment)
        for i, (start, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, length - size)
                self._used[start] = size
                return start
        return None

    def free(self, offset: int) -> None:
        """Return the range at ``offset``; KeyError if it is not allocated."""
        size = self._used.pop(offset)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged


@dataclass
class LeaseBook:
    """E's delayed-free bookkeeping per ``mm_hash`` (see the module docstring)."""

    lease_s: float
    _holders: dict[str, set[str]] = field(default_factory=dict)  # mm_hash -> live req ids
    _handles: dict[str, tuple[str, float]] = field(default_factory=dict)  # -> (hash, deadline)
    _known: set[str] = field(default_factory=set)
    released: int = 0
    expired: int = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._known

    def add(self, mm_hash: str) -> None:
        """A new slot for ``mm_hash`` (no holder, no handle yet)."""
        self._known.add(mm_hash)

    def hold(self, mm_hash: str, req_id: str) -> None:
        """Live request ``req_id`` uses ``mm_hash``'s slot: never free it before ``done``."""
        self._known.add(mm_hash)
        self._holders.setdefault(mm_hash, set()).add(req_id)

    def done(self, mm_hash: str, req_id: str, handle: str | None, now: float) -> list[str]:
        """``req_id`` finished; with ``handle`` its consumer may read until the lease ends."""
        holders = self._holders.get(mm_hash)
        if holders is not None:
            holders.discard(req_id)
            if not holders:
                del self._holders[mm_hash]
        if handle is not None:
            self._handles[handle] = (mm_hash, now + self.lease_s)
        return self._freeable([mm_hash])

    def release(self, handle: str) -> list[str]:
        """The consumer read ``handle``'s embedding; unknown or late handles are ignored."""
        entry = self._handles.pop(handle, None)
        if entry is None:
            return []
        self.released += 1
        return self._freeable([entry[0]])

    def expire(self, now: float) -> list[str]:
        """Drop every handle whose lease ended at or before ``now``."""
        late = [h for h, (_, deadline) in self._handles.items() if deadline <= now]
        hashes = []
        for h in late:
            hashes.append(self._handles.pop(h)[0])
        self.expired += len(late)
        return self._freeable(hashes)

    def pending(self) -> int:
        """Handles still waiting for their consumer."""
        return len(self._handles)

    def _freeable(self, hashes: Sequence[str]) -> list[str]:
        live = {h for h, _ in self._handles.values()}
        out = []
        for mm_hash in dict.fromkeys(hashes):
            if mm_hash in self._known and mm_hash not in self._holders and mm_hash not in live:
                self._known.discard(mm_hash)
                out.append(mm_hash)
        return out


@dataclass
class RetainLru:
    """E's retained slots, least recently used first (see the module docstring)."""

    budget: int
    _sizes: dict[str, int] = field(default_factory=dict)  # insertion order = LRU order
    bytes: int = 0
    evicted: int = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, mm_hash: str, nbytes: int) -> list[str]:
        """Retain ``mm_hash`` (most recent); returns what must be evicted to stay within
        the budget (``mm_hash`` itself when it alone is over it)."""
        self.take(mm_hash)
        self._sizes[mm_hash] = nbytes
        self.bytes += nbytes
        out = []
        while self.bytes > self.budget:
            victim = self.pop_oldest()
            assert victim is not None
            out.append(victim)
        return out

    def take(self, mm_hash: str) -> bool:
        """Stop retaining ``mm_hash`` (a request holds it again); False if not retained."""
        size = self._sizes.pop(mm_hash, None)
        if size is None:
            return False
        self.bytes -= size
        return True

    def pop_oldest(self) -> str | None:
        """Evict the least recently used slot (None when nothing is retained)."""
        if not self._sizes:
            return None
        victim = next(iter(self._sizes))
        self.take(victim)
        self.evicted += 1
        return victim


@dataclass(frozen=True)
class TransferReport:
    """One embedding of a request, as the consumer got it (see the module docstring)."""

    mm_hash: str
    outcome: str  # one of OUTCOMES
    reason: str = ""  # fallback: bad_descriptor, no_staging_space, read_error, timeout, ...
    nbytes: int = 0  # payload bytes READ (0 for a fallback)
    start_ns: int = 0  # wall clock (time.time_ns): the READ started (or the failure)
    end_ns: int = 0  # the READ was seen complete and verified (or failed)
    seconds: float = 0.0  # monotonic seconds from start to end
    agent: str = ""  # E's NIXL agent ("" when the descriptor was unreadable)

    def to_dict(self) -> dict[str, Any]:
        return {"mm_hash": self.mm_hash, "outcome": self.outcome, "reason": self.reason,
                "nbytes": self.nbytes, "start_ns": self.start_ns, "end_ns": self.end_ns,
                "seconds": self.seconds, "agent": self.agent}

    @classmethod
    def from_dict(cls, raw: Any) -> TransferReport:
        if not isinstance(raw, Mapping):
            raise ValueError(f"transfer report must be a mapping, got {type(raw).__name__}")
        if raw.get("outcome") not in OUTCOMES:
            raise ValueError(f"transfer report field 'outcome' must be one of {OUTCOMES}, "
                             f"got {raw.get('outcome')!r}")
        for key, kinds in (("mm_hash", (str,)), ("reason", (str,)), ("agent", (str,)),
                           ("nbytes", (int,)), ("start_ns", (int,)), ("end_ns", (int,)),
                           ("seconds", (int, float))):
            value = raw.get(key)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise ValueError(f"transfer report field {key!r} must be "
                                 f"{kinds[0].__name__}, got {value!r}")
        if raw["nbytes"] < 0 or raw["seconds"] < 0 or raw["end_ns"] < raw["start_ns"]:
            raise ValueError(f"transfer report of {raw['mm_hash']!r}: negative bytes or "
                             f"time ({raw['nbytes']} B, {raw['seconds']} s, "
                             f"{raw['start_ns']}..{raw['end_ns']} ns)")
        return cls(raw["mm_hash"], raw["outcome"], raw["reason"], raw["nbytes"],
                   raw["start_ns"], raw["end_ns"], float(raw["seconds"]), raw["agent"])


def transfer_reports(ec_transfer_params: Mapping[str, Any] | None) -> list[TransferReport]:
    """The consumer's reports in a request's final ``ec_transfer_params`` ([] when it
    has none); ValueError naming the bad field."""
    if not ec_transfer_params or TRANSFERS_KEY not in ec_transfer_params:
        return []
    raw = ec_transfer_params[TRANSFERS_KEY]
    if not isinstance(raw, list):
        raise ValueError(f"ec_transfer_params[{TRANSFERS_KEY!r}] must be a list, got "
                         f"{type(raw).__name__}")
    return [TransferReport.from_dict(r) for r in raw]
