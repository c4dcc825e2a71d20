"""The fused-GEMM LoRA backend: where a step's rows come in tiles of one adapter, the projection is one GEMM whose
epilogue adds the LoRA expand before its single store (kernels/lora_gemm.py), after one shrink
(kernels/lora_shrink.py); y is never read back and no delta is kept. Chosen with
`--kernel-config '{"lora_backend": "fused_gemm"}'`.

It fuses steps whose segments are longer than one row (prefills, mixed steps) and decode graphs whose rows are
grouped by adapter (LoRABatchInfo.tile_map), on unquantized weights of a projection that is not sharded (its LoRA
neither: the delta of a row-parallel shard, or of a fully sharded one, meets a collective). Everything else, and the
experts of a sparse MoE block, runs as the Triton backend runs it (layers/lora/triton_backend.py).

Its GEMM is Triton's tiled product, not yet tuned against cuBLAS per shape: which backend is faster at which shape
is for bench measurements to say.
"""
from __future__ import annotations

import torch

from worker.batch import LoRABatchInfo
from worker.layers.lora.backend import register
from worker.layers.lora.deferred import Deferred
from worker.layers.lora.triton_backend import TritonLoRA
from worker.layers.weights.unquantized import UnquantizedLinear


@register
class FusedGemmLoRA(TritonLoRA):
    name = "fused_gemm"
    device_type = "cuda"

    def linear(self, layer, x: torch.Tensor, info: LoRABatchInfo,
               bias: torch.Tensor | None) -> torch.Tensor | Deferred:
        if not self.fuses(layer, info):
            return super().linear(layer, x, info, bias)
        from worker.kernels import lora_gemm, lora_shrink   # Triton; imported here so CPU installs need none
        w = layer.lora
        shrink_kw = {}
        if info.tile_map is not None:     # a graph's rows grouped by adapter: its 16-row tiles, one partial
            shrink_cfg, _ = lora_shrink.grouped_config(x.shape[1], layer.slice_offsets[-1])
            shrink_kw = dict(config=shrink_cfg, tile_map=info.tile_map)
        xa = lora_shrink.lora_shrink(x, w.a, info.seg_indptr, info.seg_lora_slots, info.ranks, w.num_slices,
                                     info.num_segments, info.max_seg_len, **shrink_kw)
        return lora_gemm.lora_gemm(x, layer.weight, bias, xa, w.b, info.seg_indptr, info.seg_lora_slots, info.ranks,
                                   w.scalings, w.slice_offsets, info.num_segments, info.max_seg_len,
                                   tile_map=info.tile_map)

    @staticmethod
    def fuses(layer, info: LoRABatchInfo) -> bool:
        """Whether `layer`'s projection over `info`'s rows runs as one fused GEMM (module docstring)."""
        return ((info.tile_map is not None or info.max_seg_len > 1) and isinstance(layer.scheme, UnquantizedLinear)
                and layer.tp.world_size == 1 and layer.lora_tp.world_size == 1)
