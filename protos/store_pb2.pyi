from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_INITIALIZED: _ClassVar[ReplicaState]
    REPLICA_STATE_PROCESSING: _ClassVar[ReplicaState]
    REPLICA_STATE_COMPLETE: _ClassVar[ReplicaState]
    REPLICA_STATE_REMOVED: _ClassVar[ReplicaState]
    REPLICA_STATE_FAILED: _ClassVar[ReplicaState]

class Pin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIN_NONE: _ClassVar[Pin]
    PIN_SOFT: _ClassVar[Pin]
    PIN_HARD: _ClassVar[Pin]
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_INITIALIZED: ReplicaState
REPLICA_STATE_PROCESSING: ReplicaState
REPLICA_STATE_COMPLETE: ReplicaState
REPLICA_STATE_REMOVED: ReplicaState
REPLICA_STATE_FAILED: ReplicaState
PIN_NONE: Pin
PIN_SOFT: Pin
PIN_HARD: Pin

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class BatchKeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchStatusResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ItemStatus]
    def __init__(self, results: _Optional[_Iterable[_Union[ItemStatus, _Mapping]]] = ...) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutStartRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutStartRequest, _Mapping]]] = ...) -> None: ...

class PutStartResult(_message.Message):
    __slots__ = ("status", "replicas")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResult, _Mapping]]] = ...) -> None: ...

class GetReplicaListResult(_message.Message):
    __slots__ = ("status", "list")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    list: GetReplicaListResponse
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., list: _Optional[_Union[GetReplicaListResponse, _Mapping]] = ...) -> None: ...

class BatchGetReplicaListResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetReplicaListResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GetReplicaListResult, _Mapping]]] = ...) -> None: ...

class KeyRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("segment_id", "client_id", "endpoint", "offset", "address", "size", "state")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    client_id: str
    endpoint: str
    offset: int
    address: int
    size: int
    state: ReplicaState
    def __init__(self, segment_id: _Optional[str] = ..., client_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., offset: _Optional[int] = ..., address: _Optional[int] = ..., size: _Optional[int] = ..., state: _Optional[_Union[ReplicaState, str]] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("key", "size", "replicas", "pin", "preferred_segment")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    replicas: int
    pin: Pin
    preferred_segment: str
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., replicas: _Optional[int] = ..., pin: _Optional[_Union[Pin, str]] = ..., preferred_segment: _Optional[str] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class PutEndResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class PutRevokeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetReplicaListResponse(_message.Message):
    __slots__ = ("replicas", "size", "lease_until")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_UNTIL_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    size: int
    lease_until: float
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., size: _Optional[int] = ..., lease_until: _Optional[float] = ...) -> None: ...

class ExistKeyResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    def __init__(self, exists: _Optional[bool] = ...) -> None: ...

class BatchExistKeyRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchExistKeyResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveAllRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveAllResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class SetPinRequest(_message.Message):
    __slots__ = ("key", "pin")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    key: str
    pin: Pin
    def __init__(self, key: _Optional[str] = ..., pin: _Optional[_Union[Pin, str]] = ...) -> None: ...

class SetPinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment_id", "base", "size", "endpoint")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment_id: str
    base: int
    size: int
    endpoint: str
    def __init__(self, client_id: _Optional[str] = ..., segment_id: _Optional[str] = ..., base: _Optional[int] = ..., size: _Optional[int] = ..., endpoint: _Optional[str] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("mounted", "client_ttl_s")
    MOUNTED_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    mounted: bool
    client_ttl_s: float
    def __init__(self, mounted: _Optional[bool] = ..., client_ttl_s: _Optional[float] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("client_id", "segment_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    segment_id: str
    def __init__(self, client_id: _Optional[str] = ..., segment_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("replicas_lost", "objects_lost")
    REPLICAS_LOST_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_LOST_FIELD_NUMBER: _ClassVar[int]
    replicas_lost: int
    objects_lost: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replicas_lost: _Optional[int] = ..., objects_lost: _Optional[_Iterable[str]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("known", "client_ttl_s")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    known: bool
    client_ttl_s: float
    def __init__(self, known: _Optional[bool] = ..., client_ttl_s: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity", "used", "objects", "complete_objects", "segments", "clients", "puts_started", "puts_completed", "puts_revoked", "zombies_reclaimed", "objects_removed", "objects_evicted", "bytes_evicted", "eviction_runs", "allocation_failures", "clients_lost", "replicas_lost", "objects_lost", "leases_granted", "records_persisted", "persist_failures")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    PUTS_STARTED_FIELD_NUMBER: _ClassVar[int]
    PUTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PUTS_REVOKED_FIELD_NUMBER: _ClassVar[int]
    ZOMBIES_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    EVICTION_RUNS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_LOST_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_LOST_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_LOST_FIELD_NUMBER: _ClassVar[int]
    LEASES_GRANTED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PERSISTED_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FAILURES_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    used: int
    objects: int
    complete_objects: int
    segments: int
    clients: int
    puts_started: int
    puts_completed: int
    puts_revoked: int
    zombies_reclaimed: int
    objects_removed: int
    objects_evicted: int
    bytes_evicted: int
    eviction_runs: int
    allocation_failures: int
    clients_lost: int
    replicas_lost: int
    objects_lost: int
    leases_granted: int
    records_persisted: int
    persist_failures: int
    def __init__(self, capacity: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ..., complete_objects: _Optional[int] = ..., segments: _Optional[int] = ..., clients: _Optional[int] = ..., puts_started: _Optional[int] = ..., puts_completed: _Optional[int] = ..., puts_revoked: _Optional[int] = ..., zombies_reclaimed: _Optional[int] = ..., objects_removed: _Optional[int] = ..., objects_evicted: _Optional[int] = ..., bytes_evicted: _Optional[int] = ..., eviction_runs: _Optional[int] = ..., allocation_failures: _Optional[int] = ..., clients_lost: _Optional[int] = ..., replicas_lost: _Optional[int] = ..., objects_lost: _Optional[int] = ..., leases_granted: _Optional[int] = ..., records_persisted: _Optional[int] = ..., persist_failures: _Optional[int] = ...) -> None: ...
