"""Frozen configuration of the worker, one dataclass per subsystem.

Values computed at run time (the number of KV blocks, for one) are returned by the component
that computes them, never written back here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    path: str                        # Hugging Face directory: config.json + *.safetensors
    dtype: str = "auto"              # auto | float32 | float16 | bfloat16
    load_format: str = "auto"        # auto | dummy (random weights from config.json alone)
    max_model_len: int | None = None  # None: the model's own max_position_embeddings
    seed: int = 0
    tokenizer: str | None = None     # the tokenizer grammars are compiled for; None: `path`


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9     # share of device memory the worker may use (CUDA)
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; CPU default: cpu_kv_cache_bytes
    cpu_kv_cache_bytes: int = 256 << 20
    num_blocks_override: int | None = None  # tests: an exact pool size
    enable_prefix_caching: bool = True      # reuse the KV of full blocks of earlier prompts (per adapter)


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 4            # GPU slots; also the cap on distinct adapters in one batch
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # host cache entries; None: no bound
    enable_lora_overlap_loading: bool = True  # False: adapters load inside the step that admits them
    lora_eviction_policy: str = "lru"         # lru | fifo, among GPU slots no running request uses
    fully_sharded_loras: bool = False         # tensor parallelism: split lora_A of column-parallel and lora_B of
                                              # row-parallel projections too (layers/linear.py); vLLM's flag
    lora_dirs: tuple[str, ...] = ()           # roots where an unknown adapter name is looked up on first use
    lora_load_workers: int = 2                # threads reading adapters from disk into the host cache
    lora_read_threads: int = 4                # with overlap loading, one adapter's file reads are split
                                              # across this many threads (blocking loads read in the loop)

    def find_adapter_dir(self, name: str) -> str | None:
        """The directory `root/name` holding adapter_config.json under the first root that has one;
        `name` is relative and must stay inside the root, and so must the adapter's files (a symlink out of
        the root is not followed)."""
        if Path(name).is_absolute():
            return None
        for root in (Path(r).resolve() for r in self.lora_dirs):
            path = (root / name).resolve()
            files = [(path / f).resolve() for f in ("adapter_config.json", "adapter_model.safetensors")]
            if (path.is_relative_to(root) and path != root and files[0].is_file()
                    and all(f.is_relative_to(root) for f in files)):
                return str(path)
        return None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048   # per-step token budget (chunked prefill splits above it)
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
    programmatic_launch: bool = True  # Hopper+: each Triton kernel of a step may start while the one before it
                                      # ends (kernels/pdl.py)
    lora_side_stream: bool = True     # each LoRA shrink (in decode graphs the expand too) runs on a second stream
                                      # beside its base GEMM (False: in line)
    grouped_lora_min_rows: int = 32   # decode graphs of at least this many sequences also capture LoRA over rows
                                      # grouped by adapter (cuda_graph.py), replayed when rows share adapters (0: never)
    lora_tile_map_max_tokens: int = 1 << 20   # mixed-batch graphs of at most this many tokens (default: all) run
                                              # LoRA over 16-row tiles from the host's tile map, K split in the
                                              # shrink; larger ones search their tiles (0: all of them search)
    lora_backend: str = "auto"        # what runs LoRA in the forward pass (layers/lora/): "triton" (CUDA),
                                      # "reference" (torch, the CPU's); auto: the device's
    one_shot_all_reduce_bytes: int = 4 << 20   # tensor parallelism: all-reduces up to this size sum over NVLink
                                               # peer memory in one shot (distributed/all_reduce.py); NCCL above (0: all)
    all_reduce_kernel: str = "triton"     # what sums those: one launch (kernels/one_shot_all_reduce.py), or
                                          # "symm_mem", torch's op after a copy (faster from ~2 MiB: 256+ rows
                                          # of 4096; Triton's TP=2 servers at 1 and 32 streams step 4-7% faster)

    def __post_init__(self):
        if self.grouped_lora_min_rows < 0 or self.lora_tile_map_max_tokens < 0:
            raise ValueError(f"grouped_lora_min_rows and lora_tile_map_max_tokens must be >= 0 (0: never), got "
                             f"{self.grouped_lora_min_rows} and {self.lora_tile_map_max_tokens}")
        if self.one_shot_all_reduce_bytes < 0:
            raise ValueError(f"one_shot_all_reduce_bytes must be >= 0 (0: NCCL for every all-reduce), got "
                             f"{self.one_shot_all_reduce_bytes}")
        if self.all_reduce_kernel not in ("symm_mem", "triton"):
            raise ValueError(f"all_reduce_kernel must be 'symm_mem' or 'triton', got {self.all_reduce_kernel!r}")
        if self.gemv_row_limit < 0 or self.skinny_row_limit < 0:
            raise ValueError(f"gemv_row_limit and skinny_row_limit must be >= 0 (0 turns the kernel off), got "
                             f"{self.gemv_row_limit} and {self.skinny_row_limit}")


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    device: str = "auto"          # auto | cpu | cuda
    tensor_parallel_size: int = 1  # ranks the model is sharded over: this process and N - 1 followers, GPU r each
    enforce_eager: bool = False   # no CUDA graphs (the CPU path never uses them)
    async_scheduling: bool = True  # schedule and prepare step N+1 while step N runs on the device
    # with async scheduling on a GPU: the worker takes in requests until just before the step on the device ends,
    # then schedules the next one, so requests arriving meanwhile join it (worker/launch_pacer.py)
    late_launch: bool = True
    # CUDA graphs for batches with prefill tokens, up to this many tokens (capped by max_num_batched_tokens, so
    # by default every step the budget allows replays a graph); 0: such batches run eagerly (decode batches
    # still replay graphs unless enforce_eager)
    mixed_graph_max_tokens: int = 8192
