"""The kvmesh EC connector's scheduler halves (vLLM role SCHEDULER, inside EngineCore).

Each half owns its engine's NIXL :class:`~workers.ec.transport.Endpoint` and a shared
:class:`~workers.ec.transport.Region` that the worker half maps too (the worker holds
vLLM's encoder cache; the bytes cross between them by memcpy, between engines by NIXL).

:class:`ProducerScheduler` (E, ``ec_producer``: encoder only):

- ``build_connector_meta(scheduler_output)``: for every feature of every newly scheduled
  request, a slot of ``HEADER_BYTES + num_embeds × width × dtype`` in the region (width
  as vLLM measured it at start, ``get_encoder_output_width``; the model's dtype), unless
  the ``mm_hash`` already has one; the request holds it. New slots go to the worker as
  ``saves`` (their header cleared first), freed ones as ``drops``. A full region is not
  an error: the item is not published (counted, logged) and the consumer encodes it.
- ``request_finished(request)`` → ``(False, params)``: a request that finished normally
  publishes, per ``mm_hash``, ``{"kvmesh": Descriptor.to_params(), "metadata": ...,
  "item_indices": ...}`` (vLLM's per-item placeholder metadata,
  ``collect_ec_item_metadata``) as the request's ``ec_transfer_params``; the handle is
  leased for ``lease_s``. Aborted or failed requests publish nothing. vLLM may free its
  own encoder cache at once: the embedding lives in the region.
- A daemon thread, every ``poll_interval_s``, drives NIXL (consumers must be able to
  connect) and unpins slots per :class:`~workers.ec.core.LeaseBook`: on a consumer's
  read notification (``NOTIF_PREFIX + handle``, sent by its last READ), or when the
  handle's lease ran out. An unpinned slot whose header is written is *retained*
  (:class:`~workers.ec.core.RetainLru`, ``retain_mib``; 0: none) and otherwise freed; a
  retained slot is evicted (freed) when the budget is exceeded or a new slot does not
  fit, least recently used first, and is pinned again when a new request uses its
  ``mm_hash`` (no new encode is saved: the slot already holds it). A freed slot's header
  is cleared before its bytes can be reused (a late reader sees it). The thread also
  writes the counters into the region's stats block
  (:func:`~workers.ec.core.pack_stats`, the first ``STATS_BYTES``; slots follow).
- ``has_cache_item`` is False (E never loads); ``counters()``: published, publish
  failures, freed, released, expired, held and retained slots, evicted, slot bytes.
- Why a retained slot is safe to hand out again without a lease (the encoder service
  does, from its own index): a slot's bytes change only after its header was cleared,
  and a header never returns to the same value for different bytes (it names the
  ``mm_hash``, a content hash, and its length); the consumer reads the header a second
  time after the payload, so an eviction during its READ is seen as a mismatch.

:class:`ConsumerScheduler` (P or the aggregated worker, ``ec_consumer``):

- ``ensure_cache_available(request, num_computed_tokens)``: for each feature not yet
  behind ``num_computed_tokens`` whose ``ec_transfer_params[mm_hash]["kvmesh"]`` is a
  valid descriptor, starts one NIXL READ of E's slot (header + payload) into a staging
  slot, then polls it on later calls; False while a READ is in flight (vLLM defers the
  request). When it completes with a matching header, a second READ of the header alone
  (carrying the notification that releases E's handle) must find the same header: a
  slot freed or reused while the payload was read fails there. Then the item is
  *ready*. A bad
  descriptor, no staging space, a failed or timed-out READ or a header mismatch makes
  it *failed*: logged and counted, and vLLM encodes it locally (the consumer has the
  image), so a lost embedding never fails a request.
- ``has_cache_item(mm_hash)``: whether it is ready. ``update_state_after_alloc``: a
  ready item vLLM now expects from us becomes a ``load`` in the next
  :class:`~workers.ec.metadata.EcMeta`; the worker copies it into the encoder cache.
- ``request_finished`` → ``(False, params)``: the request's staging slots are freed when
  no other request uses them (a READ still in flight is parked until it ends); ``params``
  is ``{TRANSFERS_KEY: [TransferReport.to_dict(), ...]}`` with one
  :class:`~workers.ec.core.TransferReport` per distinct item of the request that came
  with a kvmesh descriptor and was looked at (``read`` by this request's READ,
  ``shared`` when another live request's READ brought it, ``fallback`` with the reason),
  or None when there is none. vLLM puts it on the request's final ``RequestOutput``
  (``ec_transfer_params``), across the EngineCore process boundary. Timing: the READ's
  start is when it was issued; its end is when a scheduling step polled it and found
  the verifying header READ done (so it includes up to one engine step of polling
  delay). Not reported: items whose tokens the prefix cache already held (no READ at
  all), and requests vLLM ends without a final EngineCore output (aborted, or stopped by
  a stop string, which the output processor detects and then aborts in EngineCore):
  their READs are still in ``counters()``.
- ``counters()``: reads, read bytes, read time (``read_us``), read failures by reason,
  local fallbacks.

``shutdown()`` (both): stops the thread, releases NIXL, unmaps and removes the region.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.ec.core import (
    HEADER_BYTES,
    NOTIF_PREFIX,
    PARAMS_KEY,
    STATS_BYTES,
    TRANSFERS_KEY,
    Descriptor,
    EcSettings,
    LeaseBook,
    RetainLru,
    SlotAllocator,
    TransferReport,
    check_header,
    pack_stats,
    payload_bytes,
)
from workers.ec.metadata import EcMeta, SlotItem
from workers.ec.transport import Endpoint, Region, region_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
_IN_FLIGHT = ("reading", "verifying")  # a consumer's READ of the item is in flight

Clock = Callable[[], float]
_ZERO_HEADER = bytes(HEADER_BYTES)


def _engine_id(vllm_config: VllmConfig) -> str:
    ec = vllm_config.ec_transfer_config
    assert ec is not None and ec.engine_id, "EC connector without ec_transfer_config"
    return str(ec.engine_id)


class _Half:
    """What both halves share: settings, region, endpoint, counters, shutdown."""

    side = ""

    base = 0  # bytes at the region's start that are not slots

    def __init__(self, vllm_config: VllmConfig, settings: EcSettings, clock: Clock) -> None:
        self.settings = settings
        self.engine_id = _engine_id(vllm_config)
        self._clock = clock
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self.region = Region.create(region_path(settings.region_dir, self.engine_id,
                                                self.side), settings.pool_bytes)
        try:
            self.endpoint = Endpoint(f"kvmesh-ec-{self.side}-{self.engine_id}", self.region)
        except Exception:
            self.region.close(unlink=True)
            raise
        self._alloc = SlotAllocator(settings.pool_bytes - self.base)
        self._closed = False

    def counters(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["slot_bytes"] = self._alloc.used_bytes
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.endpoint.close()
        self.region.close(unlink=True)


class ProducerScheduler(_Half):
    """E's scheduler half (see the module docstring)."""

    side = "producer"
    base = STATS_BYTES

    def __init__(self, vllm_config: VllmConfig, settings: EcSettings,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(vllm_config, settings, clock)
        self._vllm_config = vllm_config
        self._dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._slots: dict[str, SlotItem] = {}
        self._leases = LeaseBook(settings.lease_s)
        self._retained = RetainLru(settings.retain_bytes)
        self._req_hashes: dict[str, list[str]] = {}
        self._saves: list[SlotItem] = []
        self._drops: list[str] = []
        self._handles = itertools.count(1)
        self._resolver: Any = None
        self._stop = threading.Event()
        self._poll_errors = 0
        self._thread = threading.Thread(target=self._poll_loop, name="kvmesh-ec-leases",
                                        daemon=True)
        self._thread.start()

    # -- vLLM hooks ---------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EcMeta:
        with self._lock:
            for new in scheduler_output.scheduled_new_reqs:
                for feature in new.mm_features or []:
                    self._plan(new.req_id, feature)
            meta = EcMeta(self.region.path, self.region.nbytes, saves=self._saves,
                          drops=self._drops)
            self._saves, self._drops = [], []
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        hashes = list(dict.fromkeys(self._req_hashes.pop(request.request_id, [])))
        if not hashes:
            return False, None
        publish = request.status == RequestStatus.FINISHED_STOPPED
        params: dict[str, Any] = {}
        now = self._clock()
        with self._lock:
            for mm_hash in hashes:
                slot = self._slots.get(mm_hash)
                handle = None
                if publish and slot is not None:
                    handle = str(next(self._handles))
                    params[mm_hash] = {PARAMS_KEY: self._descriptor(slot, handle).to_params()}
                    self._counters["published"] += 1
                self._unpin(self._leases.done(mm_hash, request.request_id, handle, now))
        if params:
            for mm_hash, item in self._item_metadata(request).items():
                if mm_hash in params:
                    params[mm_hash].update(item)
        return False, params or None

    # -- internals ----------------------------------------------------------------------

    def _plan(self, req_id: str, feature: MultiModalFeatureSpec) -> None:
        """Under the lock: a slot for ``feature`` held by ``req_id`` (if it fits)."""
        from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
            get_encoder_output_width,
        )

        mm_hash = feature.identifier
        if mm_hash in self._retained:
            self._retained.take(mm_hash)  # held again; the slot already holds it
        if mm_hash not in self._slots:
            width = get_encoder_output_width(self._vllm_config, feature.modality)
            shape = (int(feature.mm_position.get_num_embeds()), int(width))
            nbytes = payload_bytes(self._dtype, shape)
            offset = self._alloc.allocate(HEADER_BYTES + nbytes)
            while offset is None and len(self._retained):
                self._free([self._retained.pop_oldest() or ""])  # make room
                offset = self._alloc.allocate(HEADER_BYTES + nbytes)
            if offset is not None:
                offset += self.base
            else:
                self._counters["publish_failures"] += 1
                log.warning("kvmesh EC: no room for %s (%d B; %d of %d B held): not "
                            "published, the consumer will encode it", mm_hash, nbytes,
                            self._alloc.used_bytes, self.region.nbytes)
                return
            self.region.write(offset, _ZERO_HEADER)
            slot = SlotItem(mm_hash, offset, nbytes, self._dtype, shape)
            self._slots[mm_hash] = slot
            self._leases.add(mm_hash)
            self._saves.append(slot)
        self._leases.hold(mm_hash, req_id)
        self._req_hashes.setdefault(req_id, []).append(mm_hash)

    def _descriptor(self, slot: SlotItem, handle: str) -> Descriptor:
        return Descriptor(self.endpoint.name, self.endpoint.metadata,
                          self.region.addr + slot.offset, slot.nbytes, slot.dtype,
                          slot.shape, handle, self.region.path, slot.offset)

    def _item_metadata(self, request: Request) -> dict[str, dict[str, Any]]:
        """vLLM's per-item placeholder metadata (lets a consumer skip preprocessing)."""
        from vllm.distributed.ec_transfer.ec_connector.utils import (
            PlaceholderMetadataResolver,
            collect_ec_item_metadata,
        )

        if self._resolver is None:
            self._resolver = PlaceholderMetadataResolver(self._vllm_config.model_config)
        return collect_ec_item_metadata(request.mm_features, self._resolver)

    def _unpin(self, hashes: list[str]) -> None:
        """Under the lock: retain the slots of ``hashes`` that hold their embedding (within
        the budget, evicting the least recently used), free the others."""
        for mm_hash in hashes:
            slot = self._slots.get(mm_hash)
            if slot is None:
                continue
            written = check_header(self.region.read(slot.offset, HEADER_BYTES), mm_hash,
                                   slot.nbytes) is None
            if self._retained.budget and written:
                self._free(self._retained.add(mm_hash, HEADER_BYTES + slot.nbytes))
            else:
                self._free([mm_hash])

    def _free(self, hashes: list[str]) -> None:
        """Under the lock: clear the header, return the range, tell the worker."""
        for mm_hash in hashes:
            slot = self._slots.pop(mm_hash, None)
            if slot is None:
                continue
            self.region.write(slot.offset, _ZERO_HEADER)
            self._alloc.free(slot.offset - self.base)
            self._drops.append(mm_hash)
            self._counters["freed"] += 1

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.settings.poll_interval_s):
            self.poll_once()

    def poll_once(self) -> None:
        """Drive NIXL, free slots whose handles were read or whose leases ran out."""
        try:
            msgs = self.endpoint.notifications()
        except Exception:
            self._poll_errors += 1
            if self._poll_errors == 1:
                log.exception("kvmesh EC: polling NIXL notifications failed")
            msgs = []
        with self._lock:
            for msg in msgs:
                if msg.startswith(NOTIF_PREFIX):
                    self._unpin(self._leases.release(msg[len(NOTIF_PREFIX):].decode()))
                else:
                    self._counters["unknown_notifications"] += 1
            self._unpin(self._leases.expire(self._clock()))
            self._counters["released"] = self._leases.released
            self._counters["expired"] = self._leases.expired
            self._counters["retained"] = len(self._retained)
            self._counters["evicted"] = self._retained.evicted
            self._counters["held"] = len(self._slots) - len(self._retained)
            self.region.write(0, pack_stats(self._counters))

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        super().shutdown()


@dataclass
class _Read:
    """One embedding on its way into (or in) the consumer's staging region."""

    desc: Descriptor | None
    offset: int = -1  # staging: [header][payload][header read again]
    state: str = "failed"  # "reading" | "verifying" | "ready" | "failed" | "done"
    xfer: Any = None
    deadline: float = 0.0
    started: float = 0.0
    holders: set[str] = field(default_factory=set)
    owner: str = ""  # the request whose READ this is (others get outcome "shared")
    reason: str = ""  # why it failed
    start_ns: int = 0  # wall clock, for the report
    end_ns: int = 0
    seconds: float = 0.0

    def report(self, mm_hash: str, req_id: str) -> TransferReport:
        d = self.desc
        if self.state == "failed":
            return TransferReport(mm_hash, "fallback", self.reason, 0, self.start_ns,
                                  max(self.end_ns, self.start_ns), self.seconds,
                                  d.agent if d is not None else "")
        assert d is not None
        outcome = "read" if req_id == self.owner else "shared"
        return TransferReport(mm_hash, outcome, "", d.nbytes, self.start_ns,
                              max(self.end_ns, self.start_ns), self.seconds, d.agent)


class ConsumerScheduler(_Half):
    """P's (or an aggregated worker's) scheduler half (see the module docstring)."""

    side = "consumer"

    def __init__(self, vllm_config: VllmConfig, settings: EcSettings,
                 clock: Clock = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        super().__init__(vllm_config, settings, clock)
        self._wall_ns = wall_ns
        self._items: dict[str, _Read] = {}
        self._loads: list[SlotItem] = []
        self._parked: list[tuple[Any, int]] = []  # (in-flight xfer, staging offset)

    # -- vLLM hooks ---------------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        params = request.ec_transfer_params or {}
        waiting = False
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue
            item = self._items.get(feature.identifier)
            if item is None:
                entry = params.get(feature.identifier)
                if not isinstance(entry, Mapping) or PARAMS_KEY not in entry:
                    continue  # not from a kvmesh E: vLLM encodes it here
                item = self._start(feature.identifier, entry[PARAMS_KEY],
                                   request.request_id)
                self._items[feature.identifier] = item
            item.holders.add(request.request_id)
            if item.state in _IN_FLIGHT:
                self._poll(feature.identifier, item)
            waiting |= item.state in _IN_FLIGHT
        return not waiting

    def has_cache_item(self, identifier: str) -> bool:
        item = self._items.get(identifier)
        return item is not None and item.state == "ready"

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        item = self._items.get(mm_hash)
        if item is None or item.state != "ready" or item.desc is None:
            return
        d = item.desc
        self._loads.append(SlotItem(mm_hash, item.offset, d.nbytes, d.dtype, d.shape))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EcMeta:
        self._poll_parked()
        meta = EcMeta(self.region.path, self.region.nbytes, loads=self._loads)
        self._loads = []
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        reports: dict[str, TransferReport] = {}
        for feature in request.mm_features:
            item = self._items.get(feature.identifier)
            if item is None or request.request_id not in item.holders:
                continue
            if item.state not in _IN_FLIGHT:
                reports[feature.identifier] = item.report(feature.identifier,
                                                          request.request_id)
            item.holders.discard(request.request_id)
            if not item.holders:
                del self._items[feature.identifier]
                self._release(item)
        if not reports:
            return False, None
        return False, {TRANSFERS_KEY: [r.to_dict() for r in reports.values()]}

    # -- internals ----------------------------------------------------------------------

    def _fail(self, mm_hash: str, item: _Read, reason: str, detail: str) -> None:
        self._release(item)  # before the state changes: an in-flight READ is parked
        item.state, item.reason = "failed", reason
        item.end_ns = self._wall_ns()
        if item.started:
            item.seconds = max(0.0, self._clock() - item.started)
        item.start_ns = item.start_ns or item.end_ns
        with self._lock:
            self._counters[f"read_failures_{reason}"] += 1
            self._counters["local_fallbacks"] += 1
        log.warning("kvmesh EC: embedding %s not loaded (%s: %s); encoding it here",
                    mm_hash, reason, detail)

    def _release(self, item: _Read) -> None:
        """Give the staging slot back (parked while a READ may still write into it)."""
        if item.offset < 0:
            return
        if item.state in _IN_FLIGHT:
            self._parked.append((item.xfer, item.offset))
        else:
            with self._lock:
                self._alloc.free(item.offset)
        item.offset, item.xfer = -1, None

    def _start(self, mm_hash: str, raw: Any, req_id: str) -> _Read:
        try:
            desc = Descriptor.from_params(raw)
        except ValueError as exc:
            item = _Read(None, owner=req_id)
            self._fail(mm_hash, item, "bad_descriptor", str(exc))
            return item
        item = _Read(desc, owner=req_id)
        with self._lock:
            offset = self._alloc.allocate(desc.slot_bytes + HEADER_BYTES)
        if offset is None:
            self._fail(mm_hash, item, "no_staging_space", f"{desc.slot_bytes} B")
            return item
        item.offset = offset
        now = self._clock()
        item.start_ns = self._wall_ns()
        try:
            item.xfer = self.endpoint.start_read(
                self.region.addr + offset, desc.addr, desc.slot_bytes, desc.agent,
                desc.agent_metadata, b"")
        except Exception as exc:  # NIXL raises its own error types
            self.endpoint.forget(desc.agent)
            self._fail(mm_hash, item, "read_error", str(exc))
            return item
        item.state, item.started = "reading", now
        item.deadline = now + self.settings.transfer_timeout_s
        return item

    def _poll(self, mm_hash: str, item: _Read) -> None:
        """One look at the item's READ: the payload READ, then the header READ again."""
        desc = item.desc
        assert desc is not None
        try:
            state = self.endpoint.poll(item.xfer)
        except Exception as exc:
            state = f"ERR ({exc})"
        if state == "PROC":
            if self._clock() > item.deadline:
                self._fail(mm_hash, item, "timeout", f"{self.settings.transfer_timeout_s} s")
            return
        item.xfer = None
        if state != "DONE":
            item.state = "done"  # nothing in flight any more: the staging slot is free
            self.endpoint.forget(desc.agent)
            self._fail(mm_hash, item, "read_error", state)
            return
        header = self.region.read(item.offset, HEADER_BYTES)
        if item.state == "reading":
            why = check_header(header, mm_hash, desc.nbytes)
            if why is not None:  # E's handle stays until its lease ends: the slot is bad
                item.state = "done"
                self._fail(mm_hash, item, "bad_slot", why)
                return
            try:  # the header again, after the payload; its notification releases E
                item.xfer = self.endpoint.start_read(
                    self.region.addr + item.offset + desc.slot_bytes, desc.addr,
                    HEADER_BYTES, desc.agent, desc.agent_metadata,
                    NOTIF_PREFIX + desc.handle.encode())
            except Exception as exc:
                item.state = "done"
                self.endpoint.forget(desc.agent)
                self._fail(mm_hash, item, "read_error", str(exc))
                return
            item.state = "verifying"
            return
        if self.region.read(item.offset + desc.slot_bytes, HEADER_BYTES) != header:
            item.state = "done"
            self._fail(mm_hash, item, "bad_slot", "the slot was freed while it was read")
            return
        item.state = "ready"
        item.end_ns = self._wall_ns()
        item.seconds = max(0.0, self._clock() - item.started)
        with self._lock:
            self._counters["reads"] += 1
            self._counters["read_bytes"] += desc.nbytes
            self._counters["read_us"] += int(item.seconds * 1e6)

    def _poll_parked(self) -> None:
        still = []
        for xfer, offset in self._parked:
            try:
                ended = self.endpoint.poll(xfer) != "PROC"
            except Exception:
                ended = True
            if ended:
                with self._lock:
                    self._alloc.free(offset)
            else:
                still.append((xfer, offset))
        self._parked = still
