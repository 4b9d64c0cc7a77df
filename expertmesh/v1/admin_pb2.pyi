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
    __slots__ = ("name", "address", "kind", "state", "device", "slot_capacity", "slots_used", "transport", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLOT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    kind: str
    state: str
    device: str
    slot_capacity: int
    slots_used: int
    transport: str
    last_error: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., slot_capacity: _Optional[int] = ..., slots_used: _Optional[int] = ..., transport: _Optional[str] = ..., last_error: _Optional[str] = ...) -> None: ...

class ListServersResponse(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ...) -> None: ...

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

class LoadLoRARequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoRAInfo(_message.Message):
    __slots__ = ("name", "path", "adapter_slot", "max_rank", "expert_layers", "modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    adapter_slot: int
    max_rank: int
    expert_layers: _containers.RepeatedScalarFieldContainer[int]
    modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., adapter_slot: _Optional[int] = ..., max_rank: _Optional[int] = ..., expert_layers: _Optional[_Iterable[int]] = ..., modules: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadLoRARequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoRAResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoRARequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoRAResponse(_message.Message):
    __slots__ = ("adapters", "max_loras")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAInfo]
    max_loras: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ...) -> None: ...
