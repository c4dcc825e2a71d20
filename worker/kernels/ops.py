"""The one place where an operation picks its device's kernels: the Triton kernels on CUDA, the torch references
(kernels/reference.py) elsewhere. Layers call these and never branch on the device; Triton is imported on the
first CUDA call, so CPU installs need none.

`delta` arguments are a projection's LoRA output left to the kernel that reads the projection next
(layers/lora/deferred.py): [num_tokens, out_features] float32, added as round(y + delta), exactly what the expand
would have written. Deltas are deferred on CUDA only (the Triton LoRA backend), so the references never see one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.batch import ForwardBatch
from worker.kernels import reference
from worker.kernels.choices import KernelChoices


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelChoices,
           beside_lora: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias): on a GPU, at most `kernels.gemv_row_limit` rows go through the small-batch kernel
    (kernels/gemv.py: no split-K, W read once at full bandwidth), up to `kernels.skinny_row_limit` through
    kernels/skinny_gemm.py (tensor-core tiles with W as the wide operand), everything else through cuBLAS
    (the CPU: torch). beside_lora: LoRA kernels run on a second stream beside this projection; the GEMV then does
    not launch early (kernels/gemv.py)."""
    rows = x.shape[0]
    gemv_rows, skinny_rows = kernels.gemv_row_limit, kernels.skinny_row_limit
    if x.is_cuda and 0 < rows <= max(gemv_rows, skinny_rows) and x.stride(1) == 1 and weight.is_contiguous():
        if rows <= gemv_rows:
            from worker.kernels.gemv import gemv
            return gemv(x, weight, bias, programmatic_launch=kernels.programmatic_launch,
                        early_launch=not beside_lora)
        from worker.kernels.skinny_gemm import skinny_gemm
        return skinny_gemm(x, weight, bias, kernels.skinny_counters, programmatic_launch=kernels.programmatic_launch)
    return F.linear(x, weight, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               block: tuple[int, int] | None, bias: torch.Tensor | None, kernels: KernelChoices,
               beside_lora: bool = False) -> torch.Tensor:
    """x @ W^T (+ bias) for an FP8 weight, W = weight [N, K] (float8_e4m3fn) times weight_scale (float32: [N] per
    output row, or [cdiv(N, bn), cdiv(K, bk)] per block when block = (bn, bk)); input_scale: the checkpoint's
    static activation scale [1], or None (dynamic). x: [M, K] in the compute dtype -> [M, N] in x's dtype.

    On a GPU, at most `kernels.fp8_gemv_row_limit` rows go through kernels/fp8_gemv.py, up to
    `kernels.fp8_skinny_row_limit` through kernels/fp8_skinny.py: both weight-only (x is not quantized: the bytes
    of W are the time); more rows are quantized to FP8 (per token, per 1 x bk group, or by input_scale) and run
    on the FP8 tensor cores (kernels/fp8_gemm.py). Elsewhere the reference (the CPU's weight schemes dequantize at
    load, so this is for completeness). beside_lora: as in `linear`."""
    rows = x.shape[0]
    weight_only = rows <= max(kernels.fp8_gemv_row_limit, kernels.fp8_skinny_row_limit)
    if not x.is_cuda:
        return reference.fp8_linear(x, weight, weight_scale, input_scale, block, bias, quantize_input=not weight_only)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight_only:
        if rows <= kernels.fp8_gemv_row_limit:
            from worker.kernels.fp8_gemv import fp8_gemv
            return fp8_gemv(x, weight, weight_scale, block, bias, programmatic_launch=kernels.programmatic_launch,
                            early_launch=not beside_lora)
        from worker.kernels.fp8_skinny import fp8_skinny_gemm
        return fp8_skinny_gemm(x, weight, weight_scale, block, bias, programmatic_launch=kernels.programmatic_launch)
    from worker.kernels.fp8_gemm import w8a8_linear
    return w8a8_linear(x, weight, weight_scale, input_scale, block, bias, kernels.programmatic_launch)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
             delta: torch.Tensor | None, kernels: KernelChoices) -> torch.Tensor:
    """RMSNorm of x (+ delta) over its last dim, in float32 and rounded back; with `residual` ([T, D]) it
    becomes x + residual in place and the norm is taken of that sum (kernels/fused.py: one launch)."""
    if x.is_cuda:
        from worker.kernels import fused
        return fused.rms_norm(x, weight, eps, residual, delta, kernels.programmatic_launch)
    assert delta is None, "deferred LoRA deltas exist on CUDA only"
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor, delta: torch.Tensor | None, kernels: KernelChoices) -> torch.Tensor:
    """[T, 2I] (gate | up, + delta) -> silu(gate) * up [T, I]."""
    if x.is_cuda:
        from worker.kernels import fused
        return fused.silu_and_mul(x, delta, kernels.programmatic_launch)
    assert delta is None, "deferred LoRA deltas exist on CUDA only"
    return reference.silu_and_mul(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_delta: torch.Tensor | None,
              kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
              scale: float, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
              kernels: KernelChoices, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Paged attention of one layer: q and k (+ their part of qkv_delta) normed per head (qk_norm: Qwen3's
    (q_norm weight, k_norm weight, eps)), rotated, this step's K/V written into the cache, then attended.
    q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq, D]. On CUDA the first steps are one kernel (fused.rotary_store_kv).
    kv_scales: the layer's (k_scale, v_scale), with which an FP8 cache stores and reads K/V (reference.store_kv);
    a cache in the model's dtype ignores them."""
    run = triton_attention if q.is_cuda else reference_attention
    return run(q, k, v, qkv_delta, kv_cache, batch, cos, sin, scale, qk_norm, kernels.programmatic_launch, kv_scales)


def triton_attention(q, k, v, qkv_delta, kv_cache, batch: ForwardBatch, cos, sin, scale: float, qk_norm,
                     programmatic_launch: bool, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """`attention` by the Triton kernels (the CUDA path; the CPU's Triton interpreter runs it in tests)."""
    from worker.kernels.attention import paged_attention
    from worker.kernels.fused import rotary_store_kv
    k_cache, v_cache = kv_cache                     # each [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale = kv_scales
    rotary_store_kv(batch.positions, q, k, v, cos, sin, k_cache, v_cache, batch.kv_slot_mapping, qkv_delta,
                    programmatic_launch=programmatic_launch, qk_norm=qk_norm, k_scale=k_scale, v_scale=v_scale)
    return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                           scale, batch.num_seqs, batch.max_query_len, programmatic_launch=programmatic_launch,
                           k_scale=k_scale, v_scale=v_scale)


def reference_attention(q, k, v, qkv_delta, kv_cache, batch: ForwardBatch, cos, sin, scale: float, qk_norm,
                        programmatic_launch: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """`attention` by the torch references (the CPU's), from the batch's host copies."""
    assert qkv_delta is None, "deferred LoRA deltas exist on CUDA only"
    k_cache, v_cache = kv_cache
    if qk_norm is not None:
        q, k = reference.rms_norm(q, qk_norm[0], qk_norm[2]), reference.rms_norm(k, qk_norm[1], qk_norm[2])
    reference.rotary(batch.positions, q, k, cos, sin)
    reference.store_kv(k, v, k_cache, v_cache, batch.kv_slot_mapping, *kv_scales)
    return reference.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc_host,
                                     batch.seq_lens_host, scale, *kv_scales)


def host_routing(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
                 float32_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and weights ([num_tokens, top_k] each) as Hugging Face routes them: the weights
    kept in float32 (Mixtral) or cast to the hidden dtype (Qwen)."""
    weights, ids = reference.moe_route(logits, top_k, renormalize)
    return (weights if float32_weights else weights.to(x.dtype)), ids


def sparse_experts(x: torch.Tensor, logits: torch.Tensor, experts, top_k: int, renormalize: bool,
                   float32_weights: bool, workspace, kernels: KernelChoices) -> torch.Tensor:
    """sum over each token's top-k experts of weight * expert(x): x [T, H], logits [T, E], `experts` a
    layers/weights/scheme.ExpertMatrices (gate_up [E, 2I, H], down [E, H, I]; FP8 with their scales when
    quantized) -> [T, H]. CUDA runs kernels/fused_moe.py once the model runner has attached its `workspace`
    (kernels/fused_moe.MoEWorkspace); until then, and on the CPU, the reference routes on the host."""
    if x.is_cuda and workspace is not None:
        from worker.kernels.fused_moe import fused_moe
        return fused_moe(x, logits, experts.gate_up, experts.down, top_k, renormalize, float32_weights, workspace,
                         programmatic_launch=kernels.programmatic_launch, gate_up_scale=experts.gate_up_scale,
                         down_scale=experts.down_scale, block=experts.block)
    weights, ids = host_routing(x, logits, top_k, renormalize, float32_weights)
    if experts.quantized:
        return reference.fp8_moe_experts(x, experts.gate_up, experts.gate_up_scale, experts.down, experts.down_scale,
                                         experts.block, weights, ids)
    return reference.moe_experts(x, experts.gate_up, experts.down, weights, ids)
