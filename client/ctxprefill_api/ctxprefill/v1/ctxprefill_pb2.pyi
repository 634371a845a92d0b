from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_BF16: _ClassVar[DataType]
    DATA_TYPE_FP16: _ClassVar[DataType]
    DATA_TYPE_FP32: _ClassVar[DataType]
    DATA_TYPE_FP8_E4M3: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]

class SharedMemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARED_MEMORY_KIND_UNSPECIFIED: _ClassVar[SharedMemoryKind]
    SHARED_MEMORY_KIND_SYSTEM: _ClassVar[SharedMemoryKind]
    SHARED_MEMORY_KIND_CUDA: _ClassVar[SharedMemoryKind]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_BF16: DataType
DATA_TYPE_FP16: DataType
DATA_TYPE_FP32: DataType
DATA_TYPE_FP8_E4M3: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_INT64: DataType
DATA_TYPE_UINT8: DataType
SHARED_MEMORY_KIND_UNSPECIFIED: SharedMemoryKind
SHARED_MEMORY_KIND_SYSTEM: SharedMemoryKind
SHARED_MEMORY_KIND_CUDA: SharedMemoryKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shared_memory")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared_memory: SharedMemoryRef
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared_memory: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class SharedMemoryRegion(_message.Message):
    __slots__ = ("name", "kind", "key", "offset", "byte_size", "device", "requests_in_flight", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: SharedMemoryKind
    key: str
    offset: int
    byte_size: int
    device: str
    requests_in_flight: int
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[SharedMemoryKind, str]] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., device: _Optional[str] = ..., requests_in_flight: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class RegisterSystemSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "key", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterSystemSharedMemoryResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: SharedMemoryRegion
    def __init__(self, region: _Optional[_Union[SharedMemoryRegion, _Mapping]] = ...) -> None: ...

class RegisterCudaSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "raw_handle", "device_id", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RAW_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    raw_handle: bytes
    device_id: int
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., raw_handle: _Optional[bytes] = ..., device_id: _Optional[int] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterCudaSharedMemoryResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: SharedMemoryRegion
    def __init__(self, region: _Optional[_Union[SharedMemoryRegion, _Mapping]] = ...) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetSharedMemoryStatusRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetSharedMemoryStatusResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[SharedMemoryRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[SharedMemoryRegion, _Mapping]]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Versions(_message.Message):
    __slots__ = ("server", "torch", "cuda", "cudnn", "python")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    CUDNN_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    server: str
    torch: str
    cuda: str
    cudnn: str
    python: str
    def __init__(self, server: _Optional[str] = ..., torch: _Optional[str] = ..., cuda: _Optional[str] = ..., cudnn: _Optional[str] = ..., python: _Optional[str] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("instance_id", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "softmax_scale", "cache_dtype", "block_size", "num_blocks", "k_scale", "bytes_per_slot", "kv_b_proj_dtype", "kv_b_proj_scale_format", "weights_source", "prefill_dtype", "attention_backend", "attention_backend_supports_out", "fused_kernels_active", "fused_kernels_reason", "workspace_tokens", "device", "versions", "max_message_bytes", "shard_index", "num_shards", "total_heads", "shared_memory_kinds", "shared_memory_max_regions", "shared_memory_max_bytes", "request_ring_max", "num_layers", "first_layer", "unpacked_keys", "request_ring_stream_order", "mps_client")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_NOPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SOFTMAX_SCALE_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    K_SCALE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    KV_B_PROJ_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_B_PROJ_SCALE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_SUPPORTS_OUT_FIELD_NUMBER: _ClassVar[int]
    FUSED_KERNELS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    FUSED_KERNELS_REASON_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HEADS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_KINDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_MAX_REGIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RING_MAX_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    UNPACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RING_STREAM_ORDER_FIELD_NUMBER: _ClassVar[int]
    MPS_CLIENT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    cache_dtype: str
    block_size: int
    num_blocks: int
    k_scale: float
    bytes_per_slot: int
    kv_b_proj_dtype: str
    kv_b_proj_scale_format: str
    weights_source: str
    prefill_dtype: str
    attention_backend: str
    attention_backend_supports_out: bool
    fused_kernels_active: bool
    fused_kernels_reason: str
    workspace_tokens: int
    device: str
    versions: Versions
    max_message_bytes: int
    shard_index: int
    num_shards: int
    total_heads: int
    shared_memory_kinds: _containers.RepeatedScalarFieldContainer[SharedMemoryKind]
    shared_memory_max_regions: int
    shared_memory_max_bytes: int
    request_ring_max: int
    num_layers: int
    first_layer: int
    unpacked_keys: bool
    request_ring_stream_order: bool
    mps_client: bool
    def __init__(self, instance_id: _Optional[str] = ..., num_heads: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_nope_head_dim: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ..., softmax_scale: _Optional[float] = ..., cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., k_scale: _Optional[float] = ..., bytes_per_slot: _Optional[int] = ..., kv_b_proj_dtype: _Optional[str] = ..., kv_b_proj_scale_format: _Optional[str] = ..., weights_source: _Optional[str] = ..., prefill_dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., attention_backend_supports_out: _Optional[bool] = ..., fused_kernels_active: _Optional[bool] = ..., fused_kernels_reason: _Optional[str] = ..., workspace_tokens: _Optional[int] = ..., device: _Optional[str] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., max_message_bytes: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., total_heads: _Optional[int] = ..., shared_memory_kinds: _Optional[_Iterable[_Union[SharedMemoryKind, str]]] = ..., shared_memory_max_regions: _Optional[int] = ..., shared_memory_max_bytes: _Optional[int] = ..., request_ring_max: _Optional[int] = ..., num_layers: _Optional[int] = ..., first_layer: _Optional[int] = ..., unpacked_keys: _Optional[bool] = ..., request_ring_stream_order: _Optional[bool] = ..., mps_client: _Optional[bool] = ...) -> None: ...

class WriteCacheRequest(_message.Message):
    __slots__ = ("slot_mapping", "kv_c", "k_pe", "expected_instance_id", "layer")
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    KV_C_FIELD_NUMBER: _ClassVar[int]
    K_PE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    slot_mapping: Tensor
    kv_c: Tensor
    k_pe: Tensor
    expected_instance_id: str
    layer: int
    def __init__(self, slot_mapping: _Optional[_Union[Tensor, _Mapping]] = ..., kv_c: _Optional[_Union[Tensor, _Mapping]] = ..., k_pe: _Optional[_Union[Tensor, _Mapping]] = ..., expected_instance_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class WriteCacheResponse(_message.Message):
    __slots__ = ("slots_written", "instance_id")
    SLOTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    slots_written: int
    instance_id: str
    def __init__(self, slots_written: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class ReadCacheRequest(_message.Message):
    __slots__ = ("slot_mapping", "expected_instance_id", "layer")
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    slot_mapping: Tensor
    expected_instance_id: str
    layer: int
    def __init__(self, slot_mapping: _Optional[_Union[Tensor, _Mapping]] = ..., expected_instance_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class ReadCacheResponse(_message.Message):
    __slots__ = ("slots", "instance_id")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    slots: Tensor
    instance_id: str
    def __init__(self, slots: _Optional[_Union[Tensor, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("query_len", "context_len", "block_table")
    QUERY_LEN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    query_len: int
    context_len: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, query_len: _Optional[int] = ..., context_len: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ...) -> None: ...

class ContextChunk(_message.Message):
    __slots__ = ("first_sequence", "num_sequences", "context_start", "context_len")
    FIRST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_START_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    first_sequence: int
    num_sequences: int
    context_start: _containers.RepeatedScalarFieldContainer[int]
    context_len: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_sequence: _Optional[int] = ..., num_sequences: _Optional[int] = ..., context_start: _Optional[_Iterable[int]] = ..., context_len: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillContextRequest(_message.Message):
    __slots__ = ("request_id", "q", "sequences", "workspace_tokens", "expected_instance_id", "plan", "output_region", "lse_region", "layer", "cache_write")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGION_FIELD_NUMBER: _ClassVar[int]
    LSE_REGION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CACHE_WRITE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    q: Tensor
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    workspace_tokens: int
    expected_instance_id: str
    plan: _containers.RepeatedCompositeFieldContainer[ContextChunk]
    output_region: SharedMemoryRef
    lse_region: SharedMemoryRef
    layer: int
    cache_write: CacheWrite
    def __init__(self, request_id: _Optional[str] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., workspace_tokens: _Optional[int] = ..., expected_instance_id: _Optional[str] = ..., plan: _Optional[_Iterable[_Union[ContextChunk, _Mapping]]] = ..., output_region: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., lse_region: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., layer: _Optional[int] = ..., cache_write: _Optional[_Union[CacheWrite, _Mapping]] = ...) -> None: ...

class CacheWrite(_message.Message):
    __slots__ = ("slot_mapping", "kv_c", "k_pe")
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    KV_C_FIELD_NUMBER: _ClassVar[int]
    K_PE_FIELD_NUMBER: _ClassVar[int]
    slot_mapping: Tensor
    kv_c: Tensor
    k_pe: Tensor
    def __init__(self, slot_mapping: _Optional[_Union[Tensor, _Mapping]] = ..., kv_c: _Optional[_Union[Tensor, _Mapping]] = ..., k_pe: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Fp8Path(_message.Message):
    __slots__ = ("cache_dtype", "kv_b_proj_dtype", "prefill_dtype")
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_B_PROJ_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    cache_dtype: str
    kv_b_proj_dtype: str
    prefill_dtype: str
    def __init__(self, cache_dtype: _Optional[str] = ..., kv_b_proj_dtype: _Optional[str] = ..., prefill_dtype: _Optional[str] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("num_chunks", "chunks", "kernel_launches", "path", "fp8_path", "stage_nanos", "total_nanos", "context_tokens", "query_tokens", "validate_nanos", "queue_nanos", "input_nanos", "compute_nanos", "output_nanos", "unpacked_keys", "queued")
    class KernelLaunchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StageNanosEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FP8_PATH_FIELD_NUMBER: _ClassVar[int]
    STAGE_NANOS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NANOS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_NANOS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NANOS_FIELD_NUMBER: _ClassVar[int]
    INPUT_NANOS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NANOS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NANOS_FIELD_NUMBER: _ClassVar[int]
    UNPACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    chunks: _containers.RepeatedCompositeFieldContainer[ContextChunk]
    kernel_launches: _containers.ScalarMap[str, int]
    path: str
    fp8_path: Fp8Path
    stage_nanos: _containers.ScalarMap[str, int]
    total_nanos: int
    context_tokens: int
    query_tokens: int
    validate_nanos: int
    queue_nanos: int
    input_nanos: int
    compute_nanos: int
    output_nanos: int
    unpacked_keys: bool
    queued: bool
    def __init__(self, num_chunks: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ContextChunk, _Mapping]]] = ..., kernel_launches: _Optional[_Mapping[str, int]] = ..., path: _Optional[str] = ..., fp8_path: _Optional[_Union[Fp8Path, _Mapping]] = ..., stage_nanos: _Optional[_Mapping[str, int]] = ..., total_nanos: _Optional[int] = ..., context_tokens: _Optional[int] = ..., query_tokens: _Optional[int] = ..., validate_nanos: _Optional[int] = ..., queue_nanos: _Optional[int] = ..., input_nanos: _Optional[int] = ..., compute_nanos: _Optional[int] = ..., output_nanos: _Optional[int] = ..., unpacked_keys: _Optional[bool] = ..., queued: _Optional[bool] = ...) -> None: ...

class PrefillContextResponse(_message.Message):
    __slots__ = ("output", "lse", "stats", "instance_id", "request_id", "slots_written")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    lse: Tensor
    stats: Stats
    instance_id: str
    request_id: str
    slots_written: int
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Union[Tensor, _Mapping]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., instance_id: _Optional[str] = ..., request_id: _Optional[str] = ..., slots_written: _Optional[int] = ...) -> None: ...

class PrefillContextStreamRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: PrefillContextRequest
    def __init__(self, request: _Optional[_Union[PrefillContextRequest, _Mapping]] = ...) -> None: ...

class PrefillContextStreamResponse(_message.Message):
    __slots__ = ("response", "error", "request_id")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    response: PrefillContextResponse
    error: RequestError
    request_id: str
    def __init__(self, response: _Optional[_Union[PrefillContextResponse, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AttachRequestRingRequest(_message.Message):
    __slots__ = ("region", "offset", "num_slots", "slot_bytes", "expected_instance_id", "ready_events")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    READY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    num_slots: int
    slot_bytes: int
    expected_instance_id: str
    ready_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., num_slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., expected_instance_id: _Optional[str] = ..., ready_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AttachRequestRingResponse(_message.Message):
    __slots__ = ("instance_id", "ring_id", "done_events")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RING_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    ring_id: str
    done_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, instance_id: _Optional[str] = ..., ring_id: _Optional[str] = ..., done_events: _Optional[_Iterable[bytes]] = ...) -> None: ...
