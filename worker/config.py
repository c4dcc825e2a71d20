"""Frozen configuration of the worker, one dataclass per subsystem.

Values computed at run time (the number of KV blocks, for one) are returned by the component
that computes them, never written back here. A field a user sets declares its vLLM flag and help in its
metadata (worker/config_flags.py); a field without one is an internal setting.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from worker.config_flags import flag, positive_int

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")     # a PEFT directory's files we read
# --kv-cache-dtype values (vLLM's names): auto keeps K/V in the model's dtype; fp8 and fp8_e4m3 store them as
# float8_e4m3fn with a per-tensor scale per layer (kv_cache/kv_dtype.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(name: str) -> str:
    """`name` if it is a --kv-cache-dtype we support, else ValueError saying which are."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported; choose auto (the model's dtype), fp8 or "
                         f"fp8_e4m3 (the same: FP8 E4M3 with per-tensor scales). vLLM's fp8_e5m2, fp8_inc and the "
                         f"other cache dtypes are not implemented here")
    return name


def kv_cache_dtype_arg(text: str) -> str:
    """An argparse `type` for --kv-cache-dtype: check_kv_cache_dtype's message as the parser's error."""
    try:
        return check_kv_cache_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class ModelConfig:
    # Hugging Face directory: config.json + *.safetensors
    path: str = field(metadata=flag("--model", help="Hugging Face model directory: config.json, weights, tokenizer"))
    # auto | float32 | float16 | bfloat16 (the command line takes half and float for the last two)
    dtype: str = field(default="auto", metadata=flag(
        "--dtype", choices=("auto", "float32", "float16", "bfloat16", "half", "float")))
    # auto | dummy (random weights from config.json alone)
    load_format: str = field(default="auto", metadata=flag(
        "--load-format", choices=("auto", "dummy"), help="dummy: random weights"))
    # None: the model's own max_position_embeddings
    max_model_len: int | None = field(default=None, metadata=flag(
        "--max-model-len", type=int, help="default: from config.json"))
    seed: int = field(default=0, metadata=flag("--seed", type=int))
    # None: the checkpoint's own format (config.json's quantization_config); fp8: quantize a full-precision
    # checkpoint's projections to E4M3 at load (layers/weights/format.py)
    quantization: str | None = field(default=None, metadata=flag(
        "--quantization", "-q", choices=("fp8", "compressed-tensors"),
        help="fp8: quantize the weights to FP8 at load; default: the checkpoint's quantization_config"))
    # the tokenizer the gateway encodes with and grammars are compiled for; None: `path`
    tokenizer: str | None = field(default=None, metadata=flag(
        "--tokenizer", help="tokenizer directory; default: the model directory"))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=flag("--block-size", type=int))
    # share of device memory the worker may use (CUDA)
    gpu_memory_utilization: float = field(default=0.9, metadata=flag("--gpu-memory-utilization", type=float))
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; CPU default: cpu_kv_cache_bytes
    cpu_kv_cache_bytes: int = 256 << 20
    # an exact KV pool size in blocks instead of what the memory plan gives (vLLM's flag; small pools exercise
    # preemption)
    num_gpu_blocks_override: int | None = field(default=None, metadata=flag(
        "--num-gpu-blocks-override", type=int,
        help="KV cache blocks to allocate, instead of what the memory profile leaves room for"))
    # reuse the KV of full blocks of earlier prompts (per adapter)
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        help="reuse the KV cache of full blocks of earlier prompts under the same adapter version (default on)"))
    # auto | fp8 | fp8_e4m3: how K/V are stored (KV_CACHE_DTYPES)
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "--kv-cache-dtype", type=kv_cache_dtype_arg, metavar="{auto,fp8,fp8_e4m3}",
        help="KV cache storage: auto (the model's dtype) or fp8 = fp8_e4m3 (float8 E4M3, per-tensor scales from the "
             "checkpoint's k_scale/v_scale, else 1.0; about twice the blocks in the same memory)"))

    def __post_init__(self):
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclass(frozen=True)
class LoRAConfig:
    # GPU slots; also the cap on distinct adapters in one batch
    max_loras: int = field(default=4, metadata=flag(
        "--max-loras", type=int, help="adapters resident on the GPU at once"))
    max_lora_rank: int = field(default=16, metadata=flag("--max-lora-rank", type=int))
    # host cache entries; None: no bound
    max_cpu_loras: int | None = field(default=None, metadata=flag(
        "--max-cpu-loras", type=int, help="adapters cached in host memory"))
    # False: adapters load inside the step that admits them
    enable_lora_overlap_loading: bool = field(default=True, metadata=flag(
        "--enable-lora-overlap-loading", action=argparse.BooleanOptionalAction,
        help="load adapters on a side stream while other requests run, prefetching for queued requests; "
             "--no-enable-lora-overlap-loading loads them inside the step that needs them"))
    # lru | fifo, among GPU slots no running request uses
    lora_eviction_policy: str = field(default="lru", metadata=flag(
        "--lora-eviction-policy", choices=("lru", "fifo"), help="which unused adapter leaves a full GPU slot pool"))
    # tensor parallelism: split lora_A of column-parallel and lora_B of row-parallel projections too
    # (layers/linear.py); vLLM's flag
    fully_sharded_loras: bool = field(default=False, metadata=flag(
        "--fully-sharded-loras", action="store_true",
        help="with tensor parallelism, also split lora_A of qkv/gate_up by rank and lora_B of o/down by output "
             "(one more collective per projection for less LoRA memory a GPU); --max-lora-rank must divide by "
             "--tensor-parallel-size"))
    # roots where an unknown adapter name is looked up on first use
    lora_dirs: tuple[str, ...] = field(default=(), metadata=flag(
        "--lora-dir", action="append",
        help="a directory runtime adapter loads may read from (repeatable); without any, runtime loads may read "
             "any path. With runtime loading on, a request naming an unknown model that is an adapter directory "
             "here loads it"))
    lora_load_workers: int = 2                # threads reading adapters from disk into the host cache
    lora_read_threads: int = 4                # with overlap loading, one adapter's file reads are split
                                              # across this many threads (blocking loads read in the loop)

    def root_of(self, path: str | Path) -> Path | None:
        """The --lora-dir root holding the adapter directory `path` and its files, symlinks followed; None
        if no root holds them all. The one rule for what a runtime load may read, named or found."""
        path = Path(path).resolve()
        files = [(path / f).resolve() for f in ADAPTER_FILES]
        for root in (Path(r).resolve() for r in self.lora_dirs):
            if path.is_relative_to(root) and all(f.is_relative_to(root) for f in files):
                return root
        return None

    def may_read(self, path: str | Path) -> bool:
        """Whether a runtime load may read `path`: any path without --lora-dir, else one a root holds."""
        return not self.lora_dirs or self.root_of(path) is not None

    def find_adapter_dir(self, name: str) -> str | None:
        """The directory `root/name` holding adapter_config.json under the first root that has one;
        `name` is relative and must stay inside the root, and so must the adapter's files (a symlink out of
        the root is not followed)."""
        if Path(name).is_absolute():
            return None
        for root in (Path(r).resolve() for r in self.lora_dirs):
            path = (root / name).resolve()
            if path != root and self.root_of(path) is not None and (path / ADAPTER_FILES[0]).is_file():
                return str(path)
        return None

    def adapter_name_of(self, path: str | Path) -> str | None:
        """The one name a --lora-dir adapter directory is served by: its real path relative to its root
        (`team/sql` for <root>/team/sql, whichever symlink or spelling led there)."""
        root = self.root_of(path)
        return None if root is None else Path(path).resolve().relative_to(root).as_posix()


@dataclass(frozen=True)
class SchedulerConfig:
    # None: vLLM's default for the device (worker/batch_defaults.py), set by the engine
    max_num_seqs: int | None = field(default=None, metadata=flag(
        "--max-num-seqs", type=positive_int, help="default: vLLM's for the device (CPU 128, GPU 256 or 1024)"))
    # per-step token budget (chunked prefill splits above it); None: vLLM's default for the device
    max_num_batched_tokens: int | None = field(default=None, metadata=flag(
        "--max-num-batched-tokens", type=positive_int,
        help="default: vLLM's for the device (CPU 2048, GPU 2048, 8192 or 16384)"))
    max_adapter_bypasses: int = 16       # later requests may overtake one waiting for a slot this often


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels the CUDA path routes work to; the CPU path runs the torch references whatever these say.
    models/builder.build_model resolves it for the device once (kernels/choices.py) and hands the result
    to the layers it builds. Turning a choice off gives the path it replaced (cuBLAS, plain launches, LoRA in
    line), which the GPU tests and bench.decode_step compare against."""
    gemv_row_limit: int = 2           # projections of at most this many rows run kernels/gemv.py (0: none)
    skinny_row_limit: int = 32        # larger ones up to this many rows kernels/skinny_gemm.py (0: none); cuBLAS
                                      # above
    fp8_gemv_row_limit: int = 2       # FP8 projections of at most this many rows run kernels/fp8_gemv.py (0: none)
    fp8_skinny_row_limit: int = 0     # larger ones up to this many rows (at most 64) kernels/fp8_skinny.py; both
                                      # weight-only. Above, activations are quantized for the FP8 tensor cores
                                      # (kernels/fp8_gemm.py), faster than the skinny GEMM at 8 and 32 rows on
                                      # every 8B shape (BENCHMARKS.md, FP8 projections): 0 by default
    programmatic_launch: bool = True  # Hopper+: each Triton kernel of a step may start while the one before it
                                      # ends (kernels/pdl.py)
    lora_side_stream: bool = True     # each LoRA shrink (in decode graphs the expand too) runs on a second stream
                                      # beside its base GEMM (False: in line)
    grouped_lora_min_rows: int = 32   # decode graphs of at least this many sequences also capture LoRA over rows
                                      # grouped by adapter (cuda_graph.py), replayed when rows share adapters (0: never)
    lora_tile_map_max_tokens: int = 1 << 20   # mixed-batch graphs of at most this many tokens (default: all) run
                                              # LoRA over 16-row tiles from the host's tile map, K split in the
                                              # shrink; larger ones search their tiles (0: all of them search)
    fp8_kernels: bool = True          # FP8 weights multiply as E4M3 on devices that have FP8 tensor cores (SM89+);
                                      # False: dequantized to the compute dtype at load, as on the CPU
    lora_backend: str = "auto"        # what runs LoRA in the forward pass (layers/lora/): "triton" (CUDA),
                                      # "reference" (torch, the CPU's); auto: the device's
    one_shot_all_reduce_bytes: int = 4 << 20   # tensor parallelism: all-reduces up to this size sum over NVLink
                                               # peer memory in one shot (distributed/all_reduce.py); NCCL above (0: all)

    def __post_init__(self):
        if self.grouped_lora_min_rows < 0 or self.lora_tile_map_max_tokens < 0:
            raise ValueError(f"grouped_lora_min_rows and lora_tile_map_max_tokens must be >= 0 (0: never), got "
                             f"{self.grouped_lora_min_rows} and {self.lora_tile_map_max_tokens}")
        if self.one_shot_all_reduce_bytes < 0:
            raise ValueError(f"one_shot_all_reduce_bytes must be >= 0 (0: NCCL for every all-reduce), got "
                             f"{self.one_shot_all_reduce_bytes}")
        if self.gemv_row_limit < 0 or self.skinny_row_limit < 0:
            raise ValueError(f"gemv_row_limit and skinny_row_limit must be >= 0 (0 turns the kernel off), got "
                             f"{self.gemv_row_limit} and {self.skinny_row_limit}")
        if self.fp8_gemv_row_limit < 0 or self.fp8_skinny_row_limit < 0:
            raise ValueError(f"fp8_gemv_row_limit and fp8_skinny_row_limit must be >= 0 (0 turns the kernel off), "
                             f"got {self.fp8_gemv_row_limit} and {self.fp8_skinny_row_limit}")


def config_from_json(text: str, config_type: type, flag_name: str, non_empty: bool = False):
    """A config dataclass from the JSON object a flag takes (vLLM's `--compilation-config` style): its fields, the
    rest at their defaults. Bad JSON, another JSON value (or an empty object, with `non_empty`), an unknown field, a
    value of another type than the field's, and what the dataclass itself refuses, all end in an
    argparse.ArgumentTypeError that names the flag."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"Invalid JSON for {flag_name}: {text} ({e})") from None
    if not isinstance(data, dict) or (non_empty and not data):
        raise argparse.ArgumentTypeError(f"{flag_name} takes a {'non-empty ' if non_empty else ''}JSON object of "
                                         f"fields, got {text}")
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise argparse.ArgumentTypeError(f"Unknown {flag_name} field(s) {', '.join(unknown)}; the fields are "
                                         f"{', '.join(fields)}")
    for key, value in data.items():
        kinds = _JSON_KINDS[fields[key].type]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise argparse.ArgumentTypeError(f"{flag_name} field {key} takes a {fields[key].type}, got {value!r}")
    try:
        return config_type(**data)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"Invalid {flag_name}: {e}") from None


# a config field's annotation -> the JSON values it takes (bool is an int in Python: told apart above)
_JSON_KINDS = {"bool": (bool,), "int": (int,), "str": (str,), "str | None": (str, type(None))}


def parse_kernel_config(text: str) -> KernelConfig:
    """`--kernel-config`: a JSON object of KernelConfig fields, the rest at their defaults, as vLLM takes
    `--compilation-config`: which kernels the GPU path uses, for A/B runs of a live server."""
    return config_from_json(text, KernelConfig, "--kernel-config", non_empty=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py, vLLM 0.33.0), same fields and defaults: KV-cache
    events for prefix-aware routers on a ZMQ PUB socket (worker/kv_events/publisher.py). Off by default."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None        # "zmq" | "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"      # PUB; bound when it holds "*" or "::" or is ipc/inproc, else dialled
    replay_endpoint: str | None = None  # ROUTER answering replay requests; None: no replay
    buffer_steps: int = 10_000          # batches kept for replay
    hwm: int = 100_000                  # the PUB socket's high-water mark
    max_queue_size: int = 100_000       # batches queued for the publisher thread; a full queue holds the step
    topic: str = ""                     # frame 0 of every message; llm-d reads `kv@<pod-ip>:<port>@<model>`

    def __post_init__(self):
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 0:
            raise ValueError("buffer_steps, hwm and max_queue_size must be >= 0")

    @property
    def publishes(self) -> bool:
        """Events are on and go to ZMQ (vLLM: the "null" publisher, or events off, sends nothing)."""
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config`: a JSON object of KVEventsConfig fields, the rest at their defaults."""
    return config_from_json(text, KVEventsConfig, "--kv-events-config")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config (vllm/config/structured_outputs.py, vLLM 0.33.0), as far as it means
    something here: grammars are compiled by xgrammar (worker/structured/)."""
    backend: str = "auto"                  # auto | xgrammar: both compile with xgrammar
    # every JSON grammar (json, json_object, response_format, a named or required tool call) admits no whitespace
    # between elements, whatever the request says
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False   # vLLM's guidance backend only: refused when set
    reasoning_parser: str = ""                    # no reasoning parser here: refused when set
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self):
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured outputs backend {self.backend!r} is not available: this server compiles "
                             "grammars with xgrammar (backend 'auto' or 'xgrammar')")
        if self.disable_any_whitespace and self.backend != "xgrammar":
            raise ValueError("disable_any_whitespace is only supported for xgrammar and guidance backends.")
        if self.disable_additional_properties:
            raise ValueError("disable_additional_properties is only supported for the guidance backend.")
        if self.reasoning_parser or self.reasoning_parser_plugin or self.enable_in_reasoning:
            raise ValueError("reasoning parsers are not supported by this server (reasoning_parser, "
                             "reasoning_parser_plugin and enable_in_reasoning must stay unset)")


def parse_structured_outputs_config(text: str) -> StructuredOutputsConfig:
    """`--structured-outputs-config`: a JSON object of StructuredOutputsConfig fields, as vLLM takes it."""
    return config_from_json(text, StructuredOutputsConfig, "--structured-outputs-config")


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig, metadata=flag(
        "--kernel-config", type=parse_kernel_config, metavar="JSON",
        help='which kernels the GPU path uses, as a JSON object of worker/config.py KernelConfig fields, e.g. '
             '\'{"lora_side_stream": false}\' (the rest keep their defaults); for A/B runs'))
    # auto | cpu | cuda
    device: str = field(default="auto", metadata=flag("--device", choices=("auto", "cpu", "cuda")))
    # ranks the model is sharded over: this process and N - 1 followers, GPU r each
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "--tensor-parallel-size", "-tp", type=positive_int,
        help="GPUs the model is sharded over (one worker process each, NCCL; gloo with --device cpu)"))
    # no CUDA graphs (the CPU path never uses them)
    enforce_eager: bool = field(default=False, metadata=flag("--enforce-eager", action="store_true",
                                                             help="no CUDA graphs"))
    # schedule and prepare step N+1 while step N runs on the device
    async_scheduling: bool = field(default=True, metadata=flag(
        "--async-scheduling", action=argparse.BooleanOptionalAction,
        help="schedule the next step while the current one runs on the device (default on)"))
    # with async scheduling on a GPU: the worker takes in requests until just before the step on the device ends,
    # then schedules the next one, so requests arriving meanwhile join it (worker/launch_pacer.py)
    late_launch: bool = field(default=True, metadata=flag(
        "--late-launch", action=argparse.BooleanOptionalAction,
        help="with async scheduling on a GPU, take in requests until just before the running step ends and only "
             "then schedule the next one, so requests arriving meanwhile join it; --no-late-launch schedules the "
             "next step as soon as the previous step's tokens are read (default on)"))
    # CUDA graphs for batches with prefill tokens, up to this many tokens (capped by max_num_batched_tokens, so
    # by default every step the budget allows replays a graph); 0: such batches run eagerly (decode batches
    # still replay graphs unless enforce_eager)
    mixed_graph_max_tokens: int = 8192
    # KV-cache events for prefix-aware routers (worker/kv_events/)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig, metadata=flag(
        "--kv-events-config", type=parse_kv_events_config, metavar="JSON",
        help='KV-cache events for prefix-aware routers, as vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": true, '
             '"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv@$(POD_IP):8000@<model>"}\' (fields: '
             'enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, '
             'topic; default off)'))
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig, metadata=flag(
        "--structured-outputs-config", type=parse_structured_outputs_config, metavar="JSON",
        help='vLLM\'s structured outputs settings as a JSON object, e.g. '
             '\'{"backend": "xgrammar", "disable_any_whitespace": true}\' (compact JSON from every JSON grammar)'))
