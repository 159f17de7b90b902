from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_CLEARED: _ClassVar[KvEventKind]
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind
KV_EVENT_KIND_CLEARED: KvEventKind

class KvEvent(_message.Message):
    __slots__ = ("event_id", "kind", "block_hashes", "tier")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    kind: KvEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: str
    def __init__(self, event_id: _Optional[int] = ..., kind: _Optional[_Union[KvEventKind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[str] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("worker_id", "events", "block_size", "started_at_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    block_size: int
    started_at_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., block_size: _Optional[int] = ..., started_at_ms: _Optional[int] = ...) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("tier", "block_hashes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tier: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KvStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvState(_message.Message):
    __slots__ = ("worker_id", "event_id", "tiers", "block_size", "started_at_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    event_id: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    block_size: int
    started_at_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., event_id: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ..., block_size: _Optional[int] = ..., started_at_ms: _Optional[int] = ...) -> None: ...
