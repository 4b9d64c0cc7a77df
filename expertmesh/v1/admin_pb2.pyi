from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListServersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("name", "address", "kind", "state", "device", "slot_capacity", "slots_used", "transport", "last_error", "layer_round_trips", "layer_round_trip_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLOT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAYER_ROUND_TRIPS_FIELD_NUMBER: _ClassVar[int]
    LAYER_ROUND_TRIP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    kind: str
    state: str
    device: str
    slot_capacity: int
    slots_used: int
    transport: str
    last_error: str
    layer_round_trips: int
    layer_round_trip_seconds: float
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., slot_capacity: _Optional[int] = ..., slots_used: _Optional[int] = ..., transport: _Optional[str] = ..., last_error: _Optional[str] = ..., layer_round_trips: _Optional[int] = ..., layer_round_trip_seconds: _Optional[float] = ...) -> None: ...

class ListServersResponse(_message.Message):
    __slots__ = ("servers", "coordinator")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    coordinator: CoordinatorStats
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ..., coordinator: _Optional[_Union[CoordinatorStats, _Mapping]] = ...) -> None: ...

class CoordinatorStats(_message.Message):
    __slots__ = ("requests_running", "requests_waiting", "kv_pages_used", "kv_pages_total", "kv_page_size", "requests_finished", "prompt_tokens", "generation_tokens", "steps", "preemptions", "uptime_seconds", "placement_generation")
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    requests_running: int
    requests_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    kv_page_size: int
    requests_finished: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    preemptions: int
    uptime_seconds: float
    placement_generation: int
    def __init__(self, requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., requests_finished: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., preemptions: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., placement_generation: _Optional[int] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerPlacement(_message.Message):
    __slots__ = ("layer", "phy2log", "owner", "local_slot")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SLOT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    owner: _containers.RepeatedScalarFieldContainer[int]
    local_slot: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., phy2log: _Optional[_Iterable[int]] = ..., owner: _Optional[_Iterable[int]] = ..., local_slot: _Optional[_Iterable[int]] = ...) -> None: ...

class PlacementInfo(_message.Message):
    __slots__ = ("generation", "servers", "layers")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    servers: _containers.RepeatedScalarFieldContainer[str]
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlacement]
    def __init__(self, generation: _Optional[int] = ..., servers: _Optional[_Iterable[str]] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ...) -> None: ...

class GetExpertLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerLoad(_message.Message):
    __slots__ = ("layer", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerLoad]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerLoad, _Mapping]]] = ...) -> None: ...
