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
    __slots__ = ("name", "address", "kind", "state", "device", "slot_capacity", "slots_used", "transport", "last_error", "link", "link_note", "layer_round_trips", "layer_round_trip_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLOT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    LINK_NOTE_FIELD_NUMBER: _ClassVar[int]
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
    link: str
    link_note: str
    layer_round_trips: int
    layer_round_trip_seconds: float
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., slot_capacity: _Optional[int] = ..., slots_used: _Optional[int] = ..., transport: _Optional[str] = ..., last_error: _Optional[str] = ..., link: _Optional[str] = ..., link_note: _Optional[str] = ..., layer_round_trips: _Optional[int] = ..., layer_round_trip_seconds: _Optional[float] = ...) -> None: ...

class ListServersResponse(_message.Message):
    __slots__ = ("servers", "coordinator")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    coordinator: CoordinatorStats
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ..., coordinator: _Optional[_Union[CoordinatorStats, _Mapping]] = ...) -> None: ...

class CoordinatorStats(_message.Message):
    __slots__ = ("requests_running", "requests_waiting", "kv_pages_used", "kv_pages_total", "kv_page_size", "requests_finished", "prompt_tokens", "generation_tokens", "steps", "preemptions", "uptime_seconds", "placement_generation", "prompt_tokens_cached", "kv_pages_cached", "linked_decode_steps")
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
    PROMPT_TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    LINKED_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
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
    prompt_tokens_cached: int
    kv_pages_cached: int
    linked_decode_steps: int
    def __init__(self, requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., requests_finished: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., preemptions: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., placement_generation: _Optional[int] = ..., prompt_tokens_cached: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., linked_decode_steps: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("generation", "servers", "layers", "coordinator_id", "placement_holder")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_HOLDER_FIELD_NUMBER: _ClassVar[int]
    generation: int
    servers: _containers.RepeatedScalarFieldContainer[str]
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlacement]
    coordinator_id: str
    placement_holder: str
    def __init__(self, generation: _Optional[int] = ..., servers: _Optional[_Iterable[str]] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ..., coordinator_id: _Optional[str] = ..., placement_holder: _Optional[str] = ...) -> None: ...

class GetExpertLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerLoad(_message.Message):
    __slots__ = ("layer", "tokens", "window_tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    window_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., window_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layers", "window_steps", "steps", "servers")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerLoad]
    window_steps: int
    steps: int
    servers: _containers.RepeatedCompositeFieldContainer[ServerLoad]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerLoad, _Mapping]]] = ..., window_steps: _Optional[int] = ..., steps: _Optional[int] = ..., servers: _Optional[_Iterable[_Union[ServerLoad, _Mapping]]] = ...) -> None: ...

class ServerLoad(_message.Message):
    __slots__ = ("name", "window_tokens", "compute_ms", "computed_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    window_tokens: _containers.RepeatedScalarFieldContainer[float]
    compute_ms: float
    computed_tokens: float
    def __init__(self, name: _Optional[str] = ..., window_tokens: _Optional[_Iterable[float]] = ..., compute_ms: _Optional[float] = ..., computed_tokens: _Optional[float] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class RebalanceOutcome(_message.Message):
    __slots__ = ("outcome", "trigger", "reason", "error", "generation", "token_balance_before", "token_balance_after", "time_before", "time_after", "weights_moved", "bytes_moved", "compute_ms", "prepare_ms", "commit_ms", "layers_kept", "layers_searched", "layers_scratch", "placement_json", "unix_time", "window_tokens", "load_source")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BALANCE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BALANCE_AFTER_FIELD_NUMBER: _ClassVar[int]
    TIME_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TIME_AFTER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_KEPT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_SEARCHED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_SCRATCH_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    trigger: str
    reason: str
    error: str
    generation: int
    token_balance_before: float
    token_balance_after: float
    time_before: float
    time_after: float
    weights_moved: int
    bytes_moved: int
    compute_ms: float
    prepare_ms: float
    commit_ms: float
    layers_kept: int
    layers_searched: int
    layers_scratch: int
    placement_json: str
    unix_time: float
    window_tokens: int
    load_source: str
    def __init__(self, outcome: _Optional[str] = ..., trigger: _Optional[str] = ..., reason: _Optional[str] = ..., error: _Optional[str] = ..., generation: _Optional[int] = ..., token_balance_before: _Optional[float] = ..., token_balance_after: _Optional[float] = ..., time_before: _Optional[float] = ..., time_after: _Optional[float] = ..., weights_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., compute_ms: _Optional[float] = ..., prepare_ms: _Optional[float] = ..., commit_ms: _Optional[float] = ..., layers_kept: _Optional[int] = ..., layers_searched: _Optional[int] = ..., layers_scratch: _Optional[int] = ..., placement_json: _Optional[str] = ..., unix_time: _Optional[float] = ..., window_tokens: _Optional[int] = ..., load_source: _Optional[str] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: RebalanceOutcome
    def __init__(self, outcome: _Optional[_Union[RebalanceOutcome, _Mapping]] = ...) -> None: ...

class SetPlacementRequest(_message.Message):
    __slots__ = ("placement_json",)
    PLACEMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    placement_json: str
    def __init__(self, placement_json: _Optional[str] = ...) -> None: ...

class SetPlacementResponse(_message.Message):
    __slots__ = ("generation", "weights_moved")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    weights_moved: int
    def __init__(self, generation: _Optional[int] = ..., weights_moved: _Optional[int] = ...) -> None: ...

class GetEplbStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EplbStatus(_message.Message):
    __slots__ = ("interval_steps", "window_steps", "redundant_slots", "replica_policy", "rebalanced", "skipped", "failed", "dry_runs", "history")
    INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    REDUNDANT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_POLICY_FIELD_NUMBER: _ClassVar[int]
    REBALANCED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    DRY_RUNS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    interval_steps: int
    window_steps: int
    redundant_slots: int
    replica_policy: str
    rebalanced: int
    skipped: int
    failed: int
    dry_runs: int
    history: _containers.RepeatedCompositeFieldContainer[RebalanceOutcome]
    def __init__(self, interval_steps: _Optional[int] = ..., window_steps: _Optional[int] = ..., redundant_slots: _Optional[int] = ..., replica_policy: _Optional[str] = ..., rebalanced: _Optional[int] = ..., skipped: _Optional[int] = ..., failed: _Optional[int] = ..., dry_runs: _Optional[int] = ..., history: _Optional[_Iterable[_Union[RebalanceOutcome, _Mapping]]] = ...) -> None: ...

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
