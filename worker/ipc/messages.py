"""Wire types between the gateway and the worker (msgspec structs; no torch here).

The gateway imports this module, so it must stay free of torch and of anything that imports it.
Gateway → worker: AddRequest, AbortRequest, AdapterCommand, Shutdown.
Worker → gateway: Ready, StartupFailed, OutputBatch (RequestOutputs), AdapterCommandResult, Stats.
AdapterState, LoRAStats and LoadedAdapter ride inside AdapterCommandResult ("list") and Stats.
"""
from __future__ import annotations

import msgspec

SAMPLING_EPS = 1e-5   # a temperature below this samples greedily, as vLLM does


class StructuredOutput(msgspec.Struct, frozen=True):
    """A constraint on the output, compiled by the worker (worker/structured/): `kind` is "json" (spec: a
    JSON schema), "json_object" (any JSON object; spec ""), "regex", "choice" (spec: a JSON list of
    strings) or "grammar" (spec: EBNF, as xgrammar reads it)."""
    kind: str
    spec: str
    any_whitespace: bool = True    # JSON: any whitespace between elements (vLLM's default); False: compact


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request generation settings, with vLLM's names and defaults."""
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0      # below SAMPLING_EPS (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None       # same tokens whatever the batch mates
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None         # None: no logprobs; k >= 0: sampled token + top-k alternatives
    prompt_logprobs: int | None = None  # None: none; k >= 0: per prompt token (first one has none)
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit, within [-100, 100]
    allowed_token_ids: list[int] | None = None     # only these may be sampled
    bad_words_token_ids: list[list[int]] = []      # a sequence's last token is banned right after the rest
    structured: StructuredOutput | None = None     # a grammar every sampled token must follow

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """One position's logprobs: the chosen token and the top-k alternatives (raw model distribution)."""
    token_id: int
    logprob: float
    rank: int                                  # 1 = the most likely token
    top: list[tuple[int, float]] = []          # [(token_id, logprob)] best first


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class AdapterCommand(msgspec.Struct, tag=True):
    """load | unload an adapter by name, list them all, or settle (wait until the adapters loaded so far are ready to
    be served beside steps: their host memory page-locked); the worker answers with AdapterCommandResult(command_id),
    whose `adapters` answer "list"."""
    command_id: int
    op: str                      # "load" | "unload" | "list" | "settle"
    name: str
    path: str | None = None
    load_inplace: bool = False
    pinned: bool = False
    warm: bool = False           # load: read it into the host cache now (the --lora-modules adapters)


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int


class StartupFailed(msgspec.Struct, tag=True):
    message: str


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one request since its previous output; finish_reason set on the last one. Encoded as an
    array (no field names, no tag): one goes through the ring per token of every stream, inside an OutputBatch.
    Never in a reference cycle, so left out of garbage collection (fewer collections at thousands a second)."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None   # once, with the first output
    finish_reason: str | None = None        # None | "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None          # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    error: str | None = None
    status_code: int | None = None          # with an error, its HTTP status: 400 the request, 404 its adapter, 500 ours
    queue_time: float | None = None         # seconds from arrival to its first scheduled step; with the first output
    num_cached_tokens: int | None = None    # prompt tokens found in the prefix cache; with the first output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputBatch(msgspec.Struct, tag=True):
    """Request outputs in one ring frame: those of one engine step (a step too large for one frame is split),
    or a single abort or rejection."""
    outputs: list[RequestOutput]


class AdapterState(msgspec.Struct, kw_only=True):
    """Where one registered adapter (its current version) stands in the worker."""
    name: str
    path: str
    version: int                        # 1 when first loaded, +1 per load_inplace
    residency: str                      # "gpu" | "host" | "disk": the fastest tier holding its weights
    loading: bool = False               # a copy into the next tier is in flight
    slot: int | None = None             # its GPU slot while it has one
    rank: int
    target_modules: list[str]
    pinned: bool = False
    last_used: float | None = None      # unix time of its latest request
    disk_load_ms: float | None = None   # its latest read from disk into the host cache
    gpu_load_ms: float | None = None    # its latest host -> GPU copy
    num_running: int = 0
    num_waiting: int = 0


class AdapterCommandResult(msgspec.Struct, tag=True):
    command_id: int
    ok: bool
    message: str = ""
    status_code: int = 200
    adapters: list[AdapterState] = []   # the answer to "list"


class LoRATierStats(msgspec.Struct, kw_only=True):
    """Counters of one adapter tier ("host": disk -> host cache, "gpu": host -> GPU slot)."""
    hits: int = 0                       # requests whose adapter was in the tier when they arrived
    misses: int = 0
    loads: int = 0                      # loads into the tier
    loaded_bytes: int = 0
    evictions: int = 0
    load_seconds_counts: list[int] = []  # per bucket of LoRAStats.load_seconds_buckets, then +Inf
    load_seconds_sum: float = 0.0


class LoadedAdapter(msgspec.Struct, array_like=True, frozen=True):
    """A registered adapter (its current version) whose weights are in a tier: vllm:lora_adapter_loaded's series."""
    name: str
    level: str                          # "gpu": in a GPU slot, its copy done; "cpu": only in the host cache
    pinned: bool
    rank: int


class LoRAStats(msgspec.Struct, kw_only=True):
    gpu_slots_used: int
    gpu_slots_total: int
    host_entries: int
    host_capacity: int | None           # None: no bound
    host_bytes: int
    load_seconds_buckets: list[float]   # upper bounds of the load-latency histograms
    host: LoRATierStats
    gpu: LoRATierStats
    loaded: list[LoadedAdapter] = []    # by name: the adapters in a GPU slot or in the host cache


class Stats(msgspec.Struct, tag=True):
    num_running: int
    num_waiting: int
    running_adapters: list[str] = []
    waiting_adapters: list[str] = []
    lora: LoRAStats | None = None       # None from engines without adapter tiers
    kv_cache_usage: float = 0.0         # fraction of KV blocks in use, 0 to 1
    num_preemptions: int = 0            # preemptions since the engine started
    prefix_cache_queries: int = 0       # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int = 0          # of those, tokens found cached
    num_adapters_loading: int = 0       # adapters whose read from disk into host memory is queued or running


ToWorker = AddRequest | AbortRequest | AdapterCommand | Shutdown
ToGateway = Ready | StartupFailed | OutputBatch | AdapterCommandResult | Stats
