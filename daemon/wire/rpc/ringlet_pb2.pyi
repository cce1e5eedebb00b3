from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "steps_done", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_ids", "logit_bias_values", "logprobs", "top_logprobs", "grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    steps_done: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    logprobs: bool
    top_logprobs: int
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., steps_done: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class TokenScores(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Activation(_message.Message):
    __slots__ = ("request_id", "epoch", "step", "offset", "hidden", "token", "sampling", "release", "error", "sent_at", "stage", "more", "retry", "prefix_ids", "cache_scope", "token_ids", "prefix_miss", "prefix_holds", "behind", "scores", "batch_ids", "drafts", "tokens", "token_scores")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MISS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOLDS_FIELD_NUMBER: _ClassVar[int]
    BEHIND_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SCORES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    step: int
    offset: int
    hidden: Tensor
    token: int
    sampling: Sampling
    release: bool
    error: str
    sent_at: float
    stage: int
    more: bool
    retry: bool
    prefix_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_scope: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_miss: bool
    prefix_holds: int
    behind: bool
    scores: TokenScores
    batch_ids: _containers.RepeatedScalarFieldContainer[str]
    drafts: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    token_scores: _containers.RepeatedCompositeFieldContainer[TokenScores]
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., offset: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., token: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., release: _Optional[bool] = ..., error: _Optional[str] = ..., sent_at: _Optional[float] = ..., stage: _Optional[int] = ..., more: _Optional[bool] = ..., retry: _Optional[bool] = ..., prefix_ids: _Optional[_Iterable[int]] = ..., cache_scope: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prefix_miss: _Optional[bool] = ..., prefix_holds: _Optional[int] = ..., behind: _Optional[bool] = ..., scores: _Optional[_Union[TokenScores, _Mapping]] = ..., batch_ids: _Optional[_Iterable[str]] = ..., drafts: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., token_scores: _Optional[_Iterable[_Union[TokenScores, _Mapping]]] = ...) -> None: ...

class HopAck(_message.Message):
    __slots__ = ("received",)
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    received: int
    def __init__(self, received: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "max_tokens", "sampling", "stop_ids", "epoch", "steps_done", "cache_scope", "prediction")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    steps_done: int
    cache_scope: str
    prediction: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., stop_ids: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., steps_done: _Optional[int] = ..., cache_scope: _Optional[str] = ..., prediction: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "error", "progress", "ttft_s", "retry", "cached_tokens", "plan_epoch", "skew", "scores", "accepted_drafts", "rejected_drafts", "draft_trips")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SKEW_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TRIPS_FIELD_NUMBER: _ClassVar[int]
    token: int
    error: str
    progress: PrefillProgress
    ttft_s: float
    retry: bool
    cached_tokens: int
    plan_epoch: int
    skew: bool
    scores: TokenScores
    accepted_drafts: int
    rejected_drafts: int
    draft_trips: int
    def __init__(self, token: _Optional[int] = ..., error: _Optional[str] = ..., progress: _Optional[_Union[PrefillProgress, _Mapping]] = ..., ttft_s: _Optional[float] = ..., retry: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., plan_epoch: _Optional[int] = ..., skew: _Optional[bool] = ..., scores: _Optional[_Union[TokenScores, _Mapping]] = ..., accepted_drafts: _Optional[int] = ..., rejected_drafts: _Optional[int] = ..., draft_trips: _Optional[int] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("processed", "total", "cached")
    PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    processed: int
    total: int
    cached: int
    def __init__(self, processed: _Optional[int] = ..., total: _Optional[int] = ..., cached: _Optional[int] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("node_id", "start", "end", "grpc_address", "rebuild", "why", "hop_address", "lost")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    HOP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    start: int
    end: int
    grpc_address: str
    rebuild: bool
    why: str
    hop_address: str
    lost: bool
    def __init__(self, node_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., grpc_address: _Optional[str] = ..., rebuild: _Optional[bool] = ..., why: _Optional[str] = ..., hop_address: _Optional[str] = ..., lost: _Optional[bool] = ...) -> None: ...

class NodeInfoRequest(_message.Message):
    __slots__ = ("caller_id", "caller_address")
    CALLER_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    caller_id: str
    caller_address: str
    def __init__(self, caller_id: _Optional[str] = ..., caller_address: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "protocol_version", "cluster_id", "grpc_port", "api_port", "model", "num_layers", "plan", "epoch", "state", "probe_json", "record_version", "record_json", "incarnation", "plan_json", "leaving")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    API_PORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROBE_JSON_FIELD_NUMBER: _ClassVar[int]
    RECORD_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    protocol_version: int
    cluster_id: str
    grpc_port: int
    api_port: int
    model: str
    num_layers: int
    plan: _containers.RepeatedCompositeFieldContainer[LayerRange]
    epoch: int
    state: str
    probe_json: str
    record_version: int
    record_json: str
    incarnation: str
    plan_json: str
    leaving: bool
    def __init__(self, node_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., cluster_id: _Optional[str] = ..., grpc_port: _Optional[int] = ..., api_port: _Optional[int] = ..., model: _Optional[str] = ..., num_layers: _Optional[int] = ..., plan: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., epoch: _Optional[int] = ..., state: _Optional[str] = ..., probe_json: _Optional[str] = ..., record_version: _Optional[int] = ..., record_json: _Optional[str] = ..., incarnation: _Optional[str] = ..., plan_json: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class MemberDigest(_message.Message):
    __slots__ = ("node_id", "grpc_address", "record_version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECORD_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    grpc_address: str
    record_version: int
    def __init__(self, node_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., record_version: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sender_id", "incarnation", "record_version", "members", "committed_epoch", "plan_id", "grpc_address", "leaving", "membership_digest")
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RECORD_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    sender_id: str
    incarnation: str
    record_version: int
    members: _containers.RepeatedCompositeFieldContainer[MemberDigest]
    committed_epoch: int
    plan_id: str
    grpc_address: str
    leaving: bool
    membership_digest: str
    def __init__(self, sender_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., record_version: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberDigest, _Mapping]]] = ..., committed_epoch: _Optional[int] = ..., plan_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., leaving: _Optional[bool] = ..., membership_digest: _Optional[str] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("epoch", "proposer_id", "membership_digest", "plan_json", "model", "addresses", "tp_json", "previous")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TP_JSON_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    proposer_id: str
    membership_digest: str
    plan_json: str
    model: str
    addresses: _containers.RepeatedCompositeFieldContainer[LayerRange]
    tp_json: str
    previous: _containers.RepeatedCompositeFieldContainer[LayerRange]
    def __init__(self, epoch: _Optional[int] = ..., proposer_id: _Optional[str] = ..., membership_digest: _Optional[str] = ..., plan_json: _Optional[str] = ..., model: _Optional[str] = ..., addresses: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., tp_json: _Optional[str] = ..., previous: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ...) -> None: ...

class Vote(_message.Message):
    __slots__ = ("ok", "reason", "node_id", "newest_epoch", "kv_tokens", "members")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NEWEST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    node_id: str
    newest_epoch: int
    kv_tokens: int
    members: _containers.RepeatedCompositeFieldContainer[MemberDigest]
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., node_id: _Optional[str] = ..., newest_epoch: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberDigest, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("epoch", "proposer_id", "plan_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    proposer_id: str
    plan_id: str
    def __init__(self, epoch: _Optional[int] = ..., proposer_id: _Optional[str] = ..., plan_id: _Optional[str] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("payload", "sent_at", "echo")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    sent_at: float
    echo: bool
    def __init__(self, payload: _Optional[bytes] = ..., sent_at: _Optional[float] = ..., echo: _Optional[bool] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("model", "file", "digests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    file: str
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., file: _Optional[str] = ..., digests: _Optional[_Iterable[str]] = ...) -> None: ...

class ShardRegion(_message.Message):
    __slots__ = ("name", "offset", "size", "sha256", "missing")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    size: int
    sha256: bytes
    missing: bool
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., sha256: _Optional[bytes] = ..., missing: _Optional[bool] = ...) -> None: ...

class ShardFile(_message.Message):
    __slots__ = ("path", "size", "format", "header_bytes", "regions")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    format: str
    header_bytes: int
    regions: _containers.RepeatedCompositeFieldContainer[ShardRegion]
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., format: _Optional[str] = ..., header_bytes: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[ShardRegion, _Mapping]]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("model", "kind", "files")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model: str
    kind: str
    files: _containers.RepeatedCompositeFieldContainer[ShardFile]
    def __init__(self, model: _Optional[str] = ..., kind: _Optional[str] = ..., files: _Optional[_Iterable[_Union[ShardFile, _Mapping]]] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ShardRequest(_message.Message):
    __slots__ = ("model", "file", "ranges", "chunk_bytes", "resume_offset")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    model: str
    file: str
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    chunk_bytes: int
    resume_offset: int
    def __init__(self, model: _Optional[str] = ..., file: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ..., resume_offset: _Optional[int] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("offset", "data", "sha256")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    sha256: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class RankStart(_message.Message):
    __slots__ = ("leader_id", "plan_epoch", "group_epoch", "rank", "size", "backend", "control", "token", "dtype", "hb_interval", "prefill_chunk", "side_host", "files", "env", "layer_start", "layer_end")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HB_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SIDE_HOST_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    plan_epoch: int
    group_epoch: int
    rank: int
    size: int
    backend: str
    control: str
    token: str
    dtype: str
    hb_interval: float
    prefill_chunk: int
    side_host: str
    files: _containers.ScalarMap[str, str]
    env: _containers.ScalarMap[str, str]
    layer_start: int
    layer_end: int
    def __init__(self, leader_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., group_epoch: _Optional[int] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ..., backend: _Optional[str] = ..., control: _Optional[str] = ..., token: _Optional[str] = ..., dtype: _Optional[str] = ..., hb_interval: _Optional[float] = ..., prefill_chunk: _Optional[int] = ..., side_host: _Optional[str] = ..., files: _Optional[_Mapping[str, str]] = ..., env: _Optional[_Mapping[str, str]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class RankEvent(_message.Message):
    __slots__ = ("pid", "exit_code", "error")
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    pid: int
    exit_code: int
    error: str
    def __init__(self, pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class KVRequest(_message.Message):
    __slots__ = ("epoch", "start", "end", "node_id", "snapshot", "have")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start: int
    end: int
    node_id: str
    snapshot: bool
    have: _containers.RepeatedCompositeFieldContainer[KVHave]
    def __init__(self, epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., node_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., have: _Optional[_Iterable[_Union[KVHave, _Mapping]]] = ...) -> None: ...

class KVHave(_message.Message):
    __slots__ = ("scope", "tokens", "digest")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    scope: str
    tokens: int
    digest: bytes
    def __init__(self, scope: _Optional[str] = ..., tokens: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class BoundaryRequest(_message.Message):
    __slots__ = ("epoch", "layer", "node_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    layer: int
    node_id: str
    def __init__(self, epoch: _Optional[int] = ..., layer: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class BoundaryChunk(_message.Message):
    __slots__ = ("sequence", "first", "scope", "tokens", "inflight", "layer", "token_start", "hidden", "error")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    first: bool
    scope: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    inflight: bool
    layer: int
    token_start: int
    hidden: Tensor
    error: str
    def __init__(self, sequence: _Optional[int] = ..., first: _Optional[bool] = ..., scope: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., inflight: _Optional[bool] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("piece", "scope", "tokens", "inflight", "layer", "token_start", "keys", "values", "error", "from_token")
    PIECE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    piece: int
    scope: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    inflight: bool
    layer: int
    token_start: int
    keys: Tensor
    values: Tensor
    error: str
    from_token: int
    def __init__(self, piece: _Optional[int] = ..., scope: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., inflight: _Optional[bool] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ..., from_token: _Optional[int] = ...) -> None: ...
