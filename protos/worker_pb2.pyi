from google.protobuf import struct_pb2 as _struct_pb2
from protos import common_pb2 as _common_pb2
from protos import encoder_pb2 as _encoder_pb2
from protos import kv_events_pb2 as _kv_events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "model", "kv_transfer", "cache_salt", "images", "embeddings", "whole", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    model: str
    kv_transfer: KvTransferParams
    cache_salt: str
    images: _containers.RepeatedCompositeFieldContainer[ImageItem]
    embeddings: _containers.RepeatedCompositeFieldContainer[_encoder_pb2.EmbeddingDescriptor]
    whole: bool
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., kv_transfer: _Optional[_Union[KvTransferParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageItem, _Mapping]]] = ..., embeddings: _Optional[_Iterable[_Union[_encoder_pb2.EmbeddingDescriptor, _Mapping]]] = ..., whole: _Optional[bool] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class GenerateFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[GenerateFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[GenerateFrame, _Mapping]]] = ...) -> None: ...

class GenerateReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[GenerateReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[GenerateReply, _Mapping]]] = ...) -> None: ...

class GenerateFrame(_message.Message):
    __slots__ = ("call_id", "request", "cancel", "metadata", "timeout_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: GenerateRequest
    cancel: bool
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    timeout_s: float
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("call_id", "response", "end")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: GenerateResponse
    end: CallStatus
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class ImageItem(_message.Message):
    __slots__ = ("data", "mm_hash")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mm_hash: str
    def __init__(self, data: _Optional[bytes] = ..., mm_hash: _Optional[str] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port", "tp_size", "transfer_mode", "remote_block_id_groups", "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "remote_block_size", "remote_prefill_cached_tokens", "remote_blocks_processed", "p_side_truncated", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_ID_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_EXPIRY_TIME_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    P_SIDE_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    do_remote_prefill: bool
    do_remote_decode: bool
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_host: str
    remote_port: int
    tp_size: int
    transfer_mode: str
    remote_block_id_groups: _containers.RepeatedCompositeFieldContainer[BlockIdGroup]
    dcp_size: int
    pp_size: int
    remote_num_tokens: int
    remote_blocks_expiry_time: float
    remote_block_size: int
    remote_prefill_cached_tokens: int
    remote_blocks_processed: bool
    p_side_truncated: bool
    extra: _containers.MessageMap[str, _struct_pb2.Value]
    def __init__(self, do_remote_prefill: _Optional[bool] = ..., do_remote_decode: _Optional[bool] = ..., remote_engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., tp_size: _Optional[int] = ..., transfer_mode: _Optional[str] = ..., remote_block_id_groups: _Optional[_Iterable[_Union[BlockIdGroup, _Mapping]]] = ..., dcp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., remote_num_tokens: _Optional[int] = ..., remote_blocks_expiry_time: _Optional[float] = ..., remote_block_size: _Optional[int] = ..., remote_prefill_cached_tokens: _Optional[int] = ..., remote_blocks_processed: _Optional[bool] = ..., p_side_truncated: _Optional[bool] = ..., extra: _Optional[_Mapping[str, _struct_pb2.Value]] = ...) -> None: ...

class BlockIdGroup(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "worker_id", "kv_transfer", "queue_s", "prefill_s", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    worker_id: str
    kv_transfer: KvTransferParams
    queue_s: float
    prefill_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., worker_id: _Optional[str] = ..., kv_transfer: _Optional[_Union[KvTransferParams, _Mapping]] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "num_running", "num_waiting", "kv_usage", "kv_total_blocks", "active_requests", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_total_blocks: int
    active_requests: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, worker_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_total_blocks: _Optional[int] = ..., active_requests: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...
