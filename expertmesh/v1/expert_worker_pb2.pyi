from expertmesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("kind", "device", "dtype", "backend", "model_type", "hidden_size", "num_experts", "moe_layers", "slot_capacity", "host_id", "fast_paths", "generation", "device_uuid", "max_message_bytes", "weight_dtype", "weight_bytes", "peak_weight_bytes", "process_rss_bytes", "process_peak_rss_bytes", "device_allocated_bytes", "device_peak_allocated_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLOT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    FAST_PATHS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    device: str
    dtype: str
    backend: str
    model_type: str
    hidden_size: int
    num_experts: int
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    slot_capacity: int
    host_id: str
    fast_paths: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    device_uuid: str
    max_message_bytes: int
    weight_dtype: str
    weight_bytes: int
    peak_weight_bytes: int
    process_rss_bytes: int
    process_peak_rss_bytes: int
    device_allocated_bytes: int
    device_peak_allocated_bytes: int
    def __init__(self, kind: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., backend: _Optional[str] = ..., model_type: _Optional[str] = ..., hidden_size: _Optional[int] = ..., num_experts: _Optional[int] = ..., moe_layers: _Optional[_Iterable[int]] = ..., slot_capacity: _Optional[int] = ..., host_id: _Optional[str] = ..., fast_paths: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ..., device_uuid: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., weight_dtype: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., peak_weight_bytes: _Optional[int] = ..., process_rss_bytes: _Optional[int] = ..., process_peak_rss_bytes: _Optional[int] = ..., device_allocated_bytes: _Optional[int] = ..., device_peak_allocated_bytes: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("seq", "generation", "layer", "hidden", "slot_ids", "weights", "adapter_slots", "fast_path")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    generation: int
    layer: int
    hidden: _tensor_pb2.Tensor
    slot_ids: _tensor_pb2.Tensor
    weights: _tensor_pb2.Tensor
    adapter_slots: _tensor_pb2.Tensor
    fast_path: bytes
    def __init__(self, seq: _Optional[int] = ..., generation: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., slot_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., adapter_slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., fast_path: _Optional[bytes] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("seq", "output", "fast_path", "compute_ms")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    output: _tensor_pb2.Tensor
    fast_path: bytes
    compute_ms: float
    def __init__(self, seq: _Optional[int] = ..., output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., fast_path: _Optional[bytes] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class LayerSlots(_message.Message):
    __slots__ = ("layer", "experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ApplyPlacementRequest(_message.Message):
    __slots__ = ("phase", "generation", "layers", "lease_holder")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[ApplyPlacementRequest.Phase]
        PREPARE: _ClassVar[ApplyPlacementRequest.Phase]
        COMMIT: _ClassVar[ApplyPlacementRequest.Phase]
        ABORT: _ClassVar[ApplyPlacementRequest.Phase]
    PHASE_UNSPECIFIED: ApplyPlacementRequest.Phase
    PREPARE: ApplyPlacementRequest.Phase
    COMMIT: ApplyPlacementRequest.Phase
    ABORT: ApplyPlacementRequest.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    phase: ApplyPlacementRequest.Phase
    generation: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSlots]
    lease_holder: str
    def __init__(self, phase: _Optional[_Union[ApplyPlacementRequest.Phase, str]] = ..., generation: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSlots, _Mapping]]] = ..., lease_holder: _Optional[str] = ...) -> None: ...

class ApplyPlacementResponse(_message.Message):
    __slots__ = ("generation", "experts_loaded")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_LOADED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    experts_loaded: int
    def __init__(self, generation: _Optional[int] = ..., experts_loaded: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "adapter_slot", "tensors", "scaling", "source")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_slot: int
    tensors: _containers.MessageMap[str, _tensor_pb2.Tensor]
    scaling: float
    source: str
    def __init__(self, name: _Optional[str] = ..., adapter_slot: _Optional[int] = ..., tensors: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., scaling: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerStats(_message.Message):
    __slots__ = ("layer", "tokens_per_slot", "tokens_per_expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens_per_slot: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens_per_slot: _Optional[_Iterable[int]] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("requests", "tokens", "errors", "compute_seconds", "layers", "generation")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    requests: int
    tokens: int
    errors: int
    compute_seconds: float
    layers: _containers.RepeatedCompositeFieldContainer[LayerStats]
    generation: int
    def __init__(self, requests: _Optional[int] = ..., tokens: _Optional[int] = ..., errors: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., layers: _Optional[_Iterable[_Union[LayerStats, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class PlacementLeaseRequest(_message.Message):
    __slots__ = ("holder", "ttl_ms", "release", "observe")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_FIELD_NUMBER: _ClassVar[int]
    holder: str
    ttl_ms: int
    release: bool
    observe: bool
    def __init__(self, holder: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., release: _Optional[bool] = ..., observe: _Optional[bool] = ...) -> None: ...

class AdapterName(_message.Message):
    __slots__ = ("name", "adapter_slot", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_slot: int
    source: str
    def __init__(self, name: _Optional[str] = ..., adapter_slot: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class PlacementLeaseResponse(_message.Message):
    __slots__ = ("granted", "holder", "ttl_left_ms", "generation", "adapters")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_LEFT_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    holder: str
    ttl_left_ms: int
    generation: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterName]
    def __init__(self, granted: _Optional[bool] = ..., holder: _Optional[str] = ..., ttl_left_ms: _Optional[int] = ..., generation: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterName, _Mapping]]] = ...) -> None: ...

class LivePlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LivePlacementResponse(_message.Message):
    __slots__ = ("generation", "layers")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSlots]
    def __init__(self, generation: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSlots, _Mapping]]] = ...) -> None: ...
