from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "request_id", "stop", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "logprobs", "n")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: TokenIds
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    request_id: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logprobs: int
    n: int
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("ttft_s", "tpot_s", "queue_s", "prefill_s", "transfer_s", "transfer_bytes", "e2e_s", "num_preemptions", "abort_reason")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    tpot_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    e2e_s: float
    num_preemptions: int
    abort_reason: str
    def __init__(self, ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., e2e_s: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., abort_reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "metrics", "index", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("index", "request_id", "token_ids", "text", "finish_reason", "metrics", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, index: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "token_ids", "text", "finish_reason", "metrics", "logprobs", "samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_path", "vocab_size", "max_prompt_len", "max_model_len", "mesh", "eos_token_ids", "has_tokenizer", "dtype", "page_size", "fingerprint")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    vocab_size: int
    max_prompt_len: int
    max_model_len: int
    mesh: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_tokenizer: bool
    dtype: str
    page_size: int
    fingerprint: str
    def __init__(self, model_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_prompt_len: _Optional[int] = ..., max_model_len: _Optional[int] = ..., mesh: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_tokenizer: _Optional[bool] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("mesh", "queue_waiting", "slots_active", "slots_total", "pages_used", "pages_total", "transfers", "transfer_bytes", "transfer_s", "num_compiled_programs", "compiled_programs", "rejections", "rejections_queue_full", "rejections_slo", "preemptions", "finished", "aborted", "prefill_batches", "prefill_tokens", "decode_steps", "local_prefills", "prefill_s_per_token", "requests_in_flight", "transfer_failures", "decode_failovers", "prefill_failovers", "requests_submitted", "prefix_query_tokens", "prefix_hit_tokens", "prefix_evictions", "pages_cached", "prefix_saved_bytes", "prefix_skip_misses", "handoff_waits_expired", "prefill_cache_query_tokens", "prefill_cache_hit_tokens", "prefill_pages_cached", "resplits", "resplit_moved_requests", "prefill_devices", "decode_devices", "prefix_host_hit_tokens", "host_tier_stored_pages", "host_tier_restored_pages", "host_tier_corrupt_pages", "host_tier_pages", "host_tier_bytes", "migrations_out", "migrations", "migration_fallbacks", "prefill_cache_host_hit_tokens", "prefill_host_tier_stored_pages", "prefill_host_tier_restored_pages", "prefill_host_tier_corrupt_pages", "migration_failures", "host_tier_evicted_pages", "prefill_host_tier_evicted_pages", "prefill_host_tier_pages", "prefill_host_tier_bytes")
    class CompiledProgramsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MESH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAITING_FIELD_NUMBER: _ClassVar[int]
    SLOTS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPILED_PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    COMPILED_PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_QUEUE_FULL_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_SLO_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DECODE_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SKIP_MISSES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_WAITS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    RESPLITS_FIELD_NUMBER: _ClassVar[int]
    RESPLIT_MOVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DECODE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_STORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_RESTORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHE_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HOST_TIER_STORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HOST_TIER_RESTORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HOST_TIER_CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HOST_TIER_EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HOST_TIER_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    mesh: str
    queue_waiting: int
    slots_active: int
    slots_total: int
    pages_used: int
    pages_total: int
    transfers: int
    transfer_bytes: int
    transfer_s: float
    num_compiled_programs: int
    compiled_programs: _containers.ScalarMap[str, int]
    rejections: int
    rejections_queue_full: int
    rejections_slo: int
    preemptions: int
    finished: int
    aborted: int
    prefill_batches: int
    prefill_tokens: int
    decode_steps: int
    local_prefills: int
    prefill_s_per_token: float
    requests_in_flight: int
    transfer_failures: int
    decode_failovers: int
    prefill_failovers: int
    requests_submitted: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_evictions: int
    pages_cached: int
    prefix_saved_bytes: int
    prefix_skip_misses: int
    handoff_waits_expired: int
    prefill_cache_query_tokens: int
    prefill_cache_hit_tokens: int
    prefill_pages_cached: int
    resplits: int
    resplit_moved_requests: int
    prefill_devices: int
    decode_devices: int
    prefix_host_hit_tokens: int
    host_tier_stored_pages: int
    host_tier_restored_pages: int
    host_tier_corrupt_pages: int
    host_tier_pages: int
    host_tier_bytes: int
    migrations_out: int
    migrations: int
    migration_fallbacks: int
    prefill_cache_host_hit_tokens: int
    prefill_host_tier_stored_pages: int
    prefill_host_tier_restored_pages: int
    prefill_host_tier_corrupt_pages: int
    migration_failures: int
    host_tier_evicted_pages: int
    prefill_host_tier_evicted_pages: int
    prefill_host_tier_pages: int
    prefill_host_tier_bytes: int
    def __init__(self, mesh: _Optional[str] = ..., queue_waiting: _Optional[int] = ..., slots_active: _Optional[int] = ..., slots_total: _Optional[int] = ..., pages_used: _Optional[int] = ..., pages_total: _Optional[int] = ..., transfers: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., num_compiled_programs: _Optional[int] = ..., compiled_programs: _Optional[_Mapping[str, int]] = ..., rejections: _Optional[int] = ..., rejections_queue_full: _Optional[int] = ..., rejections_slo: _Optional[int] = ..., preemptions: _Optional[int] = ..., finished: _Optional[int] = ..., aborted: _Optional[int] = ..., prefill_batches: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., decode_steps: _Optional[int] = ..., local_prefills: _Optional[int] = ..., prefill_s_per_token: _Optional[float] = ..., requests_in_flight: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., decode_failovers: _Optional[int] = ..., prefill_failovers: _Optional[int] = ..., requests_submitted: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_evictions: _Optional[int] = ..., pages_cached: _Optional[int] = ..., prefix_saved_bytes: _Optional[int] = ..., prefix_skip_misses: _Optional[int] = ..., handoff_waits_expired: _Optional[int] = ..., prefill_cache_query_tokens: _Optional[int] = ..., prefill_cache_hit_tokens: _Optional[int] = ..., prefill_pages_cached: _Optional[int] = ..., resplits: _Optional[int] = ..., resplit_moved_requests: _Optional[int] = ..., prefill_devices: _Optional[int] = ..., decode_devices: _Optional[int] = ..., prefix_host_hit_tokens: _Optional[int] = ..., host_tier_stored_pages: _Optional[int] = ..., host_tier_restored_pages: _Optional[int] = ..., host_tier_corrupt_pages: _Optional[int] = ..., host_tier_pages: _Optional[int] = ..., host_tier_bytes: _Optional[int] = ..., migrations_out: _Optional[int] = ..., migrations: _Optional[int] = ..., migration_fallbacks: _Optional[int] = ..., prefill_cache_host_hit_tokens: _Optional[int] = ..., prefill_host_tier_stored_pages: _Optional[int] = ..., prefill_host_tier_restored_pages: _Optional[int] = ..., prefill_host_tier_corrupt_pages: _Optional[int] = ..., migration_failures: _Optional[int] = ..., host_tier_evicted_pages: _Optional[int] = ..., prefill_host_tier_evicted_pages: _Optional[int] = ..., prefill_host_tier_pages: _Optional[int] = ..., prefill_host_tier_bytes: _Optional[int] = ...) -> None: ...
