"""Linear projections with fused output slices (qkv, gate_up) and per-token-segment LoRA deltas."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.batch import LoRABatchInfo
from worker.kernels import reference


@dataclass
class LoRAWeights:
    """One projection's slice of the LoRA slot pool (views owned by lora/gpu_pool.py).

    Slice s of adapter slot w uses rows [s*R, s*R + rank) of a[w] and rows
    [slice_offsets[s], slice_offsets[s+1]) of b[w]; slots are zero-padded to R = max_lora_rank.
    """
    a: torch.Tensor            # [num_slots, num_slices * R, in_features]
    b: torch.Tensor            # [num_slots, out_features, R]
    scalings: torch.Tensor     # [num_slots, num_slices] float32
    slice_offsets: tuple[int, ...]   # [num_slices + 1]; host ints the kernels compile in

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1


# (rows bucket, out_features, in_features) where the skinny GEMM kernel measured faster than cuBLAS;
# filled once per process by choose_gemm_kernels (start-up, before CUDA graphs are captured)
_SKINNY_GEMM: set[tuple[int, int, int]] = set()
SKINNY_ROW_BUCKETS = (1, 2, 4, 8, 16)


def _row_bucket(rows: int) -> int | None:
    return next((b for b in SKINNY_ROW_BUCKETS if b >= rows), None)


def uses_skinny_gemm(rows: int, out_features: int, in_features: int) -> bool:
    return (_row_bucket(rows), out_features, in_features) in _SKINNY_GEMM


@torch.inference_mode()
def choose_gemm_kernels(model: nn.Module) -> dict[tuple[int, int, int], tuple[float, float]]:
    """Time cuBLAS and the skinny GEMM kernel on every Linear shape of `model` at each row bucket and
    use the kernel where it is at least 3% faster. Each timing is one CUDA graph calling the op once per
    layer of that shape (its own weights, so nothing is served from L2 that a real step would read from
    memory). Returns {(rows, out, in): (cublas_ms, skinny_ms)} per call."""
    from worker.kernels.gemm import skinny_gemm
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            by_shape.setdefault(tuple(m.weight.shape), []).append(m)
    timings = {}
    for (out_features, in_features), modules in sorted(by_shape.items()):
        for rows in SKINNY_ROW_BUCKETS:
            x = torch.randn(rows, in_features, dtype=modules[0].weight.dtype, device=modules[0].weight.device)
            cublas = _graph_ms(lambda: [F.linear(x, m.weight, m.bias) for m in modules]) / len(modules)
            skinny = _graph_ms(lambda: [skinny_gemm(x, m.weight, m.bias) for m in modules]) / len(modules)
            key = (rows, out_features, in_features)
            timings[key] = (cublas, skinny)
            if skinny < 0.97 * cublas:
                _SKINNY_GEMM.add(key)
            else:
                _SKINNY_GEMM.discard(key)
    return timings


def _graph_ms(fn, replays: int = 5) -> float:
    """Mean time of fn() captured in a CUDA graph (after a warm-up call that compiles)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


class Linear(nn.Module):
    """y = x @ W^T (+ b), W stacked from `output_sizes` slices (q|k|v or gate|up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.slice_offsets = [0]
        for size in output_sizes:
            self.slice_offsets.append(self.slice_offsets[-1] + size)
        out = self.slice_offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self.lora: LoRAWeights | None = None   # attached by the LoRA pool when adapters are enabled

    def load_shard(self, param: str, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into the whole parameter (shard None) or into one output slice."""
        target = getattr(self, param)
        if shard is not None:
            target = target[self.slice_offsets[shard]:self.slice_offsets[shard + 1]]
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor, lora_info: LoRABatchInfo | None = None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> y: [num_tokens, out_features]
        if x.is_cuda and uses_skinny_gemm(x.shape[0], *self.weight.shape):
            from worker.kernels.gemm import skinny_gemm
            y = skinny_gemm(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora is not None and lora_info is not None and lora_info.max_rank > 0:
            self._add_lora(x, y, lora_info)
        return y

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor, info: LoRABatchInfo) -> None:
        w = self.lora
        if x.is_cuda:   # Triton kernels; imported here so CPU-only installs need no triton
            from worker.kernels.lora_expand import lora_expand
            from worker.kernels.lora_shrink import lora_shrink
            xa = lora_shrink(x, w.a, info.seg_indptr, info.weight_indices, info.ranks, w.num_slices,
                             info.num_segments, info.max_seg_len)
            lora_expand(y, xa, w.b, info.seg_indptr, info.weight_indices, info.ranks, w.scalings,
                        w.slice_offsets, info.num_segments, info.max_seg_len)
            return
        xa = reference.lora_shrink(x, w.a, info.seg_indptr_host, info.weight_indices_host,
                                   info.ranks_host, w.num_slices)
        reference.lora_expand(y, xa, w.b, info.seg_indptr_host, info.weight_indices_host,
                              info.ranks_host, w.scalings, w.slice_offsets)
