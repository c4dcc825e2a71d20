"""Which projections the fused-GEMM LoRA backend fuses (layers/lora/fused_gemm_backend.py); its kernel is tested in
tests/worker/kernels/test_lora_gemm.py, its tokens on the GPU in tests/gpu/test_engine_gpu.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worker.layers.lora.backend import choose_backend
from worker.layers.lora.fused_gemm_backend import FusedGemmLoRA
from worker.layers.weights.unquantized import UnquantizedLinear


def _layer(scheme=None, tp: int = 1, lora_tp: int = 1):
    return SimpleNamespace(scheme=scheme or UnquantizedLinear(), tp=SimpleNamespace(world_size=tp),
                           lora_tp=SimpleNamespace(world_size=lora_tp))


def _info(max_seg_len: int, tile_map: bool = False):
    return SimpleNamespace(max_seg_len=max_seg_len, tile_map=torch.zeros(2) if tile_map else None)


@pytest.mark.parametrize("layer,info,fused", [
    (_layer(), _info(7), True),                                  # a prefill's segments
    (_layer(), _info(1, tile_map=True), True),                   # a decode graph's rows grouped by adapter
    (_layer(), _info(1), False),                                 # one row a segment: the GEMV and lora_expand
    (_layer(scheme=object()), _info(7), False),                  # a quantized weight
    (_layer(tp=2), _info(7), False),                             # a sharded projection
    (_layer(lora_tp=2), _info(7), False),                        # fully sharded LoRA
], ids=["prefill", "grouped-decode", "decode", "quantized", "sharded", "fully-sharded"])
def test_fuses_unsharded_unquantized_projections_over_tiles_of_rows(layer, info, fused):
    assert FusedGemmLoRA.fuses(layer, info) is fused


def test_is_chosen_by_name_on_a_gpu_and_refused_on_the_cpu():
    with pytest.raises(ValueError, match="'fused_gemm' LoRA backend runs on cuda, not on cpu"):
        choose_backend("fused_gemm", torch.device("cpu"))
    assert type(choose_backend("fused_gemm", torch.device("cuda"))) is FusedGemmLoRA
