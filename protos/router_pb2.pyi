from protos import discovery_pb2 as _discovery_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "token_ids", "max_tokens", "exclude_instance_ids", "cache_salt", "mm_items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    exclude_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    mm_items: _containers.RepeatedCompositeFieldContainer[MmItem]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., exclude_instance_ids: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ..., mm_items: _Optional[_Iterable[_Union[MmItem, _Mapping]]] = ...) -> None: ...

class MmItem(_message.Message):
    __slots__ = ("mm_hash", "offset", "length")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    offset: int
    length: int
    def __init__(self, mm_hash: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class EncoderChoice(_message.Message):
    __slots__ = ("instance_id", "address", "affinity_items")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_ITEMS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    affinity_items: int
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., affinity_items: _Optional[int] = ...) -> None: ...

class WorkerChoice(_message.Message):
    __slots__ = ("instance_id", "address", "role", "handoff", "request_plane_address")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    role: _discovery_pb2.WorkerRole
    handoff: _discovery_pb2.KvHandoff
    request_plane_address: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[_discovery_pb2.WorkerRole, str]] = ..., handoff: _Optional[_Union[_discovery_pb2.KvHandoff, _Mapping]] = ..., request_plane_address: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker", "prefill", "policy", "reason", "disaggregated", "predicted_overlap_blocks", "predicted_prefill_overlap_blocks", "block_size", "predicted_overlap_by_tier", "predicted_prefill_overlap_by_tier", "overlap_source", "prompt_blocks", "encoder", "encoder_skipped")
    class PredictedOverlapByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PredictedPrefillOverlapByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PREFILL_OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OVERLAP_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PREFILL_OVERLAP_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    ENCODER_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerChoice
    prefill: WorkerChoice
    policy: str
    reason: str
    disaggregated: bool
    predicted_overlap_blocks: int
    predicted_prefill_overlap_blocks: int
    block_size: int
    predicted_overlap_by_tier: _containers.ScalarMap[str, int]
    predicted_prefill_overlap_by_tier: _containers.ScalarMap[str, int]
    overlap_source: str
    prompt_blocks: int
    encoder: EncoderChoice
    encoder_skipped: str
    def __init__(self, worker: _Optional[_Union[WorkerChoice, _Mapping]] = ..., prefill: _Optional[_Union[WorkerChoice, _Mapping]] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., disaggregated: _Optional[bool] = ..., predicted_overlap_blocks: _Optional[int] = ..., predicted_prefill_overlap_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., predicted_overlap_by_tier: _Optional[_Mapping[str, int]] = ..., predicted_prefill_overlap_by_tier: _Optional[_Mapping[str, int]] = ..., overlap_source: _Optional[str] = ..., prompt_blocks: _Optional[int] = ..., encoder: _Optional[_Union[EncoderChoice, _Mapping]] = ..., encoder_skipped: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillDoneRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class PrefillDoneResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_discovery_pb2.InstanceRecord]
    def __init__(self, workers: _Optional[_Iterable[_Union[_discovery_pb2.InstanceRecord, _Mapping]]] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("instance_id", "reason", "request_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    reason: str
    request_id: str
    def __init__(self, instance_id: _Optional[str] = ..., reason: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("replica_id", "seq", "workers", "leaving")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    seq: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerShare]
    leaving: bool
    def __init__(self, replica_id: _Optional[str] = ..., seq: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerShare, _Mapping]]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class WorkerShare(_message.Message):
    __slots__ = ("worker_id", "in_flight", "active_blocks", "pending_prefill_tokens", "decoding_alone")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODING_ALONE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    in_flight: int
    active_blocks: int
    pending_prefill_tokens: int
    decoding_alone: int
    def __init__(self, worker_id: _Optional[str] = ..., in_flight: _Optional[int] = ..., active_blocks: _Optional[int] = ..., pending_prefill_tokens: _Optional[int] = ..., decoding_alone: _Optional[int] = ...) -> None: ...
