"""The FP8 kernels (kernels/fp8_quant.py, fp8_gemv.py, fp8_skinny.py, fp8_gemm.py, and FP8 experts in
fused_moe.py / moe_gemv.py) against float32 references of the same quantized math (kernels/reference.py).

FP8 dots need a GPU of compute capability 8.9 or later, and the Triton interpreter does not emulate them: every case
here skips elsewhere.

Bounds, per output y (terms t_k = X[m, k] * W[n, k] of the dequantized operands, as the reference forms them):
- rounding y to bf16 (fp16): at most 2^-8 (2^-11) of |y|;
- float32 sums of K terms (the weight-only kernels: CUDA-core FMAs, bf16 tensor cores with float32 accumulation):
  Higham's probabilistic bound λ·√K·u·Σ|t_k| (u = 2^-24; it fails with probability at most 2·exp(-λ²/2) per output,
  ~1e-14 at λ = 8), with K + 2 terms for the scale and bias products;
- FP8 tensor cores: Hopper's FP8 MMA keeps about 14 bits of its running sum (DeepSeek-V3 technical report,
  §3.3.2), which is why the kernels move every 128-product partial into float32. Each partial p_b is taken to be
  off by at most 2^-13·Σ_{k in b}|t_k|, the partials' errors independent: λ·2^-13·sqrt(Σ_b (Σ_{k in b}|t_k|)²).
The activations' quantization is no error term: the kernels quantize exactly as the reference does (checked byte
for byte here).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from worker.kernels import ops, reference  # noqa: E402
from worker.kernels.choices import KernelChoices  # noqa: E402

CUDA = torch.cuda.is_available()
FP8 = CUDA and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not FP8, reason="FP8 kernels need a CUDA device of compute capability 8.9+")
DEVICE = "cuda"
LAMBDA = 8.0
ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
MMA_UNIT, MMA_PARTIAL = 2.0 ** -13, 128
ROWS = [1, 2, 3, 16, 33, 256, 2048]
# (N, K, block): per-row scales on shapes off the 128 grid and off the 16 grid (Triton instead of _scaled_mm);
# block scales with a partial last row block, and K / 128 = 7 (where _scaled_mm's block mode fails)
SHAPES = {"row-384x1024": (384, 1024, None), "row-300x1000": (300, 1000, None),
          "block-328x1024": (328, 1024, (128, 128)), "block-256x896": (256, 896, (128, 128))}


def quantize_weight(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float32 -> (float8_e4m3fn, float32 scales) as checkpoints hold them: amax / 448 per row or
    per (bn x bk) block."""
    if block is None:
        scale = w.abs().amax(dim=-1) / 448
        return (w / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    n, k = w.shape[-2:]
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    blocks = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))             # [..., nb, bn, kb, bk]
    scale = blocks.abs().amax(dim=(-3, -1)) / 448                               # [..., nb, kb]
    expanded = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def activations(rows: int, k: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with a few outlier columns (a larger amax, as real hidden states have)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device=DEVICE)
    x[:, ::97] *= 20
    return x.to(dtype)


def layer(n: int, k: int, block, seed: int = 1):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=DEVICE) * k ** -0.5
    q, scale = quantize_weight(w, block)
    bias = torch.randn(n, generator=g, device=DEVICE).bfloat16()
    return q, scale, bias


def operands(x, weight, weight_scale, input_scale, block, quantized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """|X| and |W| of the dequantized operands the reference multiplies (float32)."""
    w = reference.fp8_dequantize(weight, weight_scale, block)
    if not quantized:
        return x.float().abs(), w.abs()
    group = block[1] if block is not None else None
    q, s = reference.fp8_quantize_activations(x, group, input_scale)
    return (q.float() * s.repeat_interleave(group or x.shape[1], dim=1)[:, :x.shape[1]]).abs(), w.abs()


def assert_within_bound(y, ref, x_abs, w_abs, fp8_mma: bool):
    """y (the kernel's, rounded) against ref (float32) within the module docstring's bound."""
    k = x_abs.shape[1]
    if fp8_mma:
        nb = -(-k // MMA_PARTIAL)
        pad = nb * MMA_PARTIAL - k
        xb = torch.nn.functional.pad(x_abs, (0, pad)).view(x_abs.shape[0], nb, MMA_PARTIAL)
        wb = torch.nn.functional.pad(w_abs, (0, pad)).view(w_abs.shape[0], nb, MMA_PARTIAL)
        per_block = torch.einsum("mbk,nbk->mnb", xb, wb)                    # [M, N, blocks]
        acc = LAMBDA * MMA_UNIT * per_block.square().sum(-1).sqrt()
    else:
        acc = LAMBDA * math.sqrt(k + 2) * 2.0 ** -24 * (x_abs @ w_abs.T)
    bound = ROUNDING[y.dtype] * (ref.abs() + acc) + acc
    err = (y.float() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1, f"error {worst:.2f}x the bound (max error {err.max().item():.3e}, max |y| " \
                       f"{ref.abs().max().item():.3e})"


def choices(gemv_rows=2, skinny_rows=32) -> KernelChoices:
    return KernelChoices(fp8_gemv_row_limit=gemv_rows, fp8_skinny_row_limit=skinny_rows, programmatic_launch=True)


@pytest.mark.parametrize("rows", [1, 3, 33, 256])
@pytest.mark.parametrize("k, group", [(4096, None), (1000, None), (1024, 128), (320, 128)])
@pytest.mark.parametrize("static", [False, True])
def test_activation_quantization_is_the_references_byte_for_byte(rows, k, group, static):
    from worker.kernels.fp8_quant import quantize_fp8
    x = activations(rows, k)
    x[0, :group or k] = 0                                      # an all-zero group: the amax floor, no NaN
    input_scale = torch.tensor([0.01], device=DEVICE) if static else None   # clamps the outliers
    q, scale = quantize_fp8(x, group, input_scale)
    ref_q, ref_scale = reference.fp8_quantize_activations(x, group, input_scale)
    assert q.shape == (rows, k) and scale.shape == (rows, -(-k // (group or k)))
    assert not q.float().isnan().any()
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_fp8_linear_matches_reference_of_its_path(rows, shape, static, bias):
    """ops.fp8_linear at each path's row counts: the weight-only GEMV (1, 2) and skinny GEMM (3, 16), W8A8 above."""
    n, k, block = SHAPES[shape]
    if static and block is not None:
        pytest.skip("block-wise checkpoints have dynamic activations")
    weight, scale, b = layer(n, k, block)
    x = activations(rows, k)
    input_scale = (x.float().abs().amax() / 448 * 0.5).reshape(1) if static else None   # half the range: clamps
    kernels = choices()
    y = ops.fp8_linear(x, weight, scale, input_scale, block, b if bias else None, kernels)
    quantized = rows > kernels.fp8_skinny_row_limit
    ref = reference.fp8_linear(x.float(), weight, scale, input_scale, block, b.float() if bias else None,
                               quantize_input=quantized)
    assert y.shape == (rows, n) and y.dtype == x.dtype
    assert_within_bound(y, ref, *operands(x, weight, scale, input_scale, block, quantized), fp8_mma=quantized)


@pytest.mark.parametrize("rows", [33, 256, 2048])
@pytest.mark.parametrize("gemm", ["triton", "scaled_mm"])
def test_per_row_w8a8_by_triton_and_by_scaled_mm(rows, gemm):
    """Both GEMMs that can serve per-token x per-row scales, on a shape both take."""
    from worker.kernels import fp8_gemm
    from worker.kernels.fp8_quant import quantize_fp8
    weight, scale, b = layer(384, 1024, None)
    x = activations(rows, 1024)
    xq, x_scale = quantize_fp8(x, None)
    run = fp8_gemm.w8a8_gemm if gemm == "triton" else \
        lambda *args: fp8_gemm.scaled_mm_rowwise(*args[:4], *args[5:])
    y = run(xq, x_scale, weight, scale, None, b, torch.bfloat16)
    ref = reference.fp8_linear(x.float(), weight, scale, None, None, b.float(), quantize_input=True)
    assert_within_bound(y, ref, *operands(x, weight, scale, None, None, True), fp8_mma=True)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, block", [(6144, 4096, None), (4096, 14336, (128, 128)), (200, 384, (64, 128))])
def test_fp8_gemv_at_llama_shapes_and_fp16(rows, dtype, n, k, block):
    from worker.kernels.fp8_gemv import fp8_gemv
    weight, scale, b = layer(n, k, block)
    x = activations(rows, k, dtype)
    y = fp8_gemv(x, weight, scale, block, b.to(dtype))
    ref = reference.fp8_linear(x.float(), weight, scale, None, block, b.to(dtype).float(), quantize_input=False)
    assert_within_bound(y, ref, *operands(x, weight, scale, None, block, False), fp8_mma=False)


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["row", "block"])
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_cuda_graph_replay_equals_eager(rows, block):
    weight, scale, b = layer(512, 1024, block)
    kernels = choices()
    x = activations(rows, 1024)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.fp8_linear(x, weight, scale, None, block, b, kernels)            # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.fp8_linear(x, weight, scale, None, block, b, kernels)
    for seed in (2, 3):
        x.copy_(activations(rows, 1024, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, ops.fp8_linear(x, weight, scale, None, block, b, kernels))


# FP8 experts: (E, H, I); I = 320 gives gate_up a partial last row block and down a partial last column block
EXPERT_SHAPES = {"e16-h256-i384": (16, 256, 384), "e64-h512-i320": (64, 512, 320)}
MOE_TOL = 2e-2      # test_moe_kernels.py's bf16 bound, relative to max|ref|: the roundings of h, act, y and out


def fp8_experts(num_experts, hidden, inter, block, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=DEVICE) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, inter, generator=g, device=DEVICE) * inter ** -0.5
    return (*quantize_weight(gate_up, block), *quantize_weight(down, block))


def moe_inputs(num_tokens, num_experts, hidden, seed=2):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=DEVICE).bfloat16()
    logits = torch.randn(num_tokens, num_experts, generator=g, device=DEVICE)
    return x, logits


def assert_moe_close(out, ref):
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= MOE_TOL * ref.abs().max().item(), f"max error {err:.3e}, max |ref| {ref.abs().max().item():.3e}"


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 40, 256])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("shape", EXPERT_SHAPES)
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["row", "block"])
def test_fp8_experts_match_dequantized_reference(num_tokens, top_k, shape, block):
    """ops.sparse_experts with FP8 ExpertMatrices: the small-batch GEMVs (1, 2 tokens), the grouped GEMMs above."""
    from worker.kernels.fused_moe import MoEWorkspace
    from worker.layers.weights.scheme import ExpertMatrices
    e, h, i = EXPERT_SHAPES[shape]
    gate_up, gate_up_scale, down, down_scale = fp8_experts(e, h, i, block)
    x, logits = moe_inputs(num_tokens, e, h)
    ws = MoEWorkspace(256, e, top_k, h, i, torch.bfloat16, torch.device(DEVICE))
    matrices = ExpertMatrices(gate_up, down, gate_up_scale, down_scale, block)
    out = ops.sparse_experts(x, logits, matrices, top_k, True, False, ws, choices())
    weights, ids = reference.moe_route(logits, top_k, True)
    ref = reference.fp8_moe_experts(x.float(), gate_up, gate_up_scale, down, down_scale, block,
                                    weights.bfloat16().float(), ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_moe_close(out, ref)


def test_bf16_experts_unchanged_by_the_fp8_arguments():
    """The bf16 path with scales None is the kernels' bf16 path: the same bits as before the FP8 arguments."""
    from worker.kernels.fused_moe import MoEWorkspace, fused_moe
    e, h, i = EXPERT_SHAPES["e16-h256-i384"]
    gate_up, gsc, down, dsc = fp8_experts(e, h, i, None)
    gate_up = reference.fp8_dequantize(gate_up, gsc, None).bfloat16()
    down = reference.fp8_dequantize(down, dsc, None).bfloat16()
    for num_tokens in (1, 40):
        x, logits = moe_inputs(num_tokens, e, h)
        ws = MoEWorkspace(64, e, 2, h, i, torch.bfloat16, torch.device(DEVICE))
        plain = fused_moe(x, logits, gate_up, down, 2, True, False, ws).clone()
        assert torch.equal(plain, fused_moe(x, logits, gate_up, down, 2, True, False, ws, gate_up_scale=None,
                                            down_scale=None, block=None))


@pytest.mark.parametrize("num_tokens", [1, 2, 40])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["row", "block"])
def test_fp8_experts_with_expert_lora(num_tokens, block):
    """Expert LoRA on an FP8 base: the shrinks read the bf16 activations, the expands add in bf16, as on a bf16
    base; against reference.moe_lora_experts on the dequantized experts."""
    from tests.worker.kernels.test_moe_lora_kernels import (Scenario, Shape, _reference_slots, _slot_pool, _step,
                                                            _token_slots, _workspace)
    from worker.kernels.fused_moe import MoEWorkspace, fused_moe
    e, h, i = EXPERT_SHAPES["e16-h256-i384"]
    shape = Shape(e, 8, h, i, 16, (16, 8, 4, 16), shared_slot=2, zero_scalings=((3, 1),))
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    w, ranks = _slot_pool(shape, torch.bfloat16, gen)
    slots = _token_slots(Scenario(num_tokens, "uniform", base_every=3), len(shape.slot_ranks), gen)
    gate_up, gate_up_scale, down, down_scale = fp8_experts(e, h, i, block)
    x, logits = moe_inputs(num_tokens, e, h)
    ws = MoEWorkspace(64, e, shape.top_k, h, i, torch.bfloat16, torch.device(DEVICE))
    out = fused_moe(x, logits, gate_up, down, shape.top_k, True, False, ws,
                    lora=_step(w, ranks, slots, _workspace(shape, num_tokens)), gate_up_scale=gate_up_scale,
                    down_scale=down_scale, block=block)
    weights, ids = reference.moe_route(logits, shape.top_k, True)
    ref = reference.moe_lora_experts(x.float(), reference.fp8_dequantize(gate_up, gate_up_scale, block),
                                     reference.fp8_dequantize(down, down_scale, block), weights.bfloat16().float(),
                                     ids, slots, _reference_slots(w, ranks))
    assert_moe_close(out, ref)
