from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_AGG: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_ENCODE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_AGG: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_ENCODE: WorkerRole

class InstanceRecord(_message.Message):
    __slots__ = ("instance_id", "component", "address", "role", "model", "model_path", "block_size", "max_model_len", "capabilities", "engine", "labels", "started_at_ms", "handoff", "kv_layout", "pid", "http_address", "metrics_address", "desired_replicas", "request_plane_address")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class DesiredReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    component: str
    address: str
    role: WorkerRole
    model: str
    model_path: str
    block_size: int
    max_model_len: int
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    engine: str
    labels: _containers.ScalarMap[str, str]
    started_at_ms: int
    handoff: KvHandoff
    kv_layout: str
    pid: int
    http_address: str
    metrics_address: str
    desired_replicas: _containers.ScalarMap[str, int]
    request_plane_address: str
    def __init__(self, instance_id: _Optional[str] = ..., component: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., model_path: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., capabilities: _Optional[_Iterable[str]] = ..., engine: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., started_at_ms: _Optional[int] = ..., handoff: _Optional[_Union[KvHandoff, _Mapping]] = ..., kv_layout: _Optional[str] = ..., pid: _Optional[int] = ..., http_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., desired_replicas: _Optional[_Mapping[str, int]] = ..., request_plane_address: _Optional[str] = ...) -> None: ...

class KvHandoff(_message.Message):
    __slots__ = ("mode", "engine_id", "side_channel_host", "side_channel_port", "tp_size", "kv_load_failure_policy")
    MODE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_HOST_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_PORT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    mode: str
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    tp_size: int
    kv_load_failure_policy: str
    def __init__(self, mode: _Optional[str] = ..., engine_id: _Optional[str] = ..., side_channel_host: _Optional[str] = ..., side_channel_port: _Optional[int] = ..., tp_size: _Optional[int] = ..., kv_load_failure_policy: _Optional[str] = ...) -> None: ...
