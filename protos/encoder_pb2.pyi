from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageInput(_message.Message):
    __slots__ = ("data", "data_url", "content_hash")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_URL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    data_url: str
    content_hash: str
    def __init__(self, data: _Optional[bytes] = ..., data_url: _Optional[str] = ..., content_hash: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "model", "images", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class NumberList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbeddingDescriptor(_message.Message):
    __slots__ = ("mm_hash", "agent", "agent_metadata", "addr", "nbytes", "dtype", "shape", "handle", "region", "offset", "num_tokens", "cache_hit", "placeholder_metadata", "content_hash")
    class PlaceholderMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: NumberList
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[NumberList, _Mapping]] = ...) -> None: ...
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_METADATA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    agent: str
    agent_metadata: bytes
    addr: int
    nbytes: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    handle: str
    region: str
    offset: int
    num_tokens: int
    cache_hit: bool
    placeholder_metadata: _containers.MessageMap[str, NumberList]
    content_hash: str
    def __init__(self, mm_hash: _Optional[str] = ..., agent: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., handle: _Optional[str] = ..., region: _Optional[str] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., placeholder_metadata: _Optional[_Mapping[str, NumberList]] = ..., content_hash: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings", "queue_s", "encode_s")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[EmbeddingDescriptor]
    queue_s: float
    encode_s: float
    def __init__(self, embeddings: _Optional[_Iterable[_Union[EmbeddingDescriptor, _Mapping]]] = ..., queue_s: _Optional[float] = ..., encode_s: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("hits", "misses", "evictions", "stale", "entries", "bytes", "budget_bytes", "encodes", "published", "refused", "retained", "retained_evicted")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_EVICTED_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    evictions: int
    stale: int
    entries: int
    bytes: int
    budget_bytes: int
    encodes: int
    published: int
    refused: int
    retained: int
    retained_evicted: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., stale: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., encodes: _Optional[int] = ..., published: _Optional[int] = ..., refused: _Optional[int] = ..., retained: _Optional[int] = ..., retained_evicted: _Optional[int] = ...) -> None: ...
