from protos import kv_events_pb2 as _kv_events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FindMatchesRequest(_message.Message):
    __slots__ = ("token_ids", "block_size", "block_hashes", "cache_salt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class WorkerOverlap(_message.Message):
    __slots__ = ("worker_id", "blocks", "by_tier")
    class ByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BY_TIER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    blocks: int
    by_tier: _containers.ScalarMap[str, int]
    def __init__(self, worker_id: _Optional[str] = ..., blocks: _Optional[int] = ..., by_tier: _Optional[_Mapping[str, int]] = ...) -> None: ...

class FindMatchesResponse(_message.Message):
    __slots__ = ("overlaps", "query_blocks")
    OVERLAPS_FIELD_NUMBER: _ClassVar[int]
    QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    overlaps: _containers.RepeatedCompositeFieldContainer[WorkerOverlap]
    query_blocks: int
    def __init__(self, overlaps: _Optional[_Iterable[_Union[WorkerOverlap, _Mapping]]] = ..., query_blocks: _Optional[int] = ...) -> None: ...

class DumpRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DumpResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_kv_events_pb2.KvState]
    def __init__(self, workers: _Optional[_Iterable[_Union[_kv_events_pb2.KvState, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("blocks", "workers", "entries", "events_applied", "gaps", "resyncs", "workers_removed", "stream_entries", "unsigned_entries", "forged_entries", "bad_entries")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    STREAM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    UNSIGNED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FORGED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BAD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    workers: int
    entries: int
    events_applied: int
    gaps: int
    resyncs: int
    workers_removed: int
    stream_entries: int
    unsigned_entries: int
    forged_entries: int
    bad_entries: int
    def __init__(self, blocks: _Optional[int] = ..., workers: _Optional[int] = ..., entries: _Optional[int] = ..., events_applied: _Optional[int] = ..., gaps: _Optional[int] = ..., resyncs: _Optional[int] = ..., workers_removed: _Optional[int] = ..., stream_entries: _Optional[int] = ..., unsigned_entries: _Optional[int] = ..., forged_entries: _Optional[int] = ..., bad_entries: _Optional[int] = ...) -> None: ...
