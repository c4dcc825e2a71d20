"""Triton MoE kernels (routing, grouping, expert GEMMs, weighted sum) against reference.moe_route and
reference.moe_experts.

Without CUDA the kernels run in the Triton interpreter on small fp16/fp32 shapes (the interpreter does
not emulate bf16 dots); with CUDA the `gpu` cases run in bf16 at Qwen3-30B-A3B and Mixtral shapes against a
float32 reference computed from the same bf16 weights, and a CUDA graph is captured and replayed.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from worker.kernels import fused_moe as moe, reference
from worker.kernels.fused_moe import MoEWorkspace, fused_moe

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# tolerance, relative to the largest reference magnitude
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SMALL = (8, 2, 64, 32)           # E, K, H, I
ODD = (8, 2, 80, 48)             # not multiples of the blocks: masks exercised
TOKENS = [1, 2, 3, 17, 40]
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def make_inputs(num_tokens, num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g) / 2
    logits = torch.randn(num_tokens, num_experts, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    return [t.to(dtype=dtype, device=DEVICE) for t in (x, logits, gate_up, down)]


def workspace(max_tokens, num_experts, top_k, hidden, inter, dtype):
    return MoEWorkspace(max_tokens, num_experts, top_k, hidden, inter, dtype, DEVICE)


def reference_moe(x, logits, gate_up, down, top_k, renormalize, float32_weights, compute_dtype=None):
    """moe_route + moe_experts as layers/sparse_moe.py calls them; compute_dtype: upcast everything first."""
    if compute_dtype is not None:
        x, logits, gate_up, down = (t.to(compute_dtype) for t in (x, logits, gate_up, down))
    weights, ids = reference.moe_route(logits, top_k, renormalize)
    if not float32_weights:
        weights = weights.to(x.dtype)
    return reference.moe_experts(x, gate_up, down, weights, ids)


def assert_close(out, ref, tol):
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * ref.float().abs().max().item(), f"max error {err}, max |ref| {ref.abs().max().item()}"


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (60, 4), (6, 6)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_reference_ids_and_weights(num_experts, top_k, renormalize):
    logits = torch.randn(9, num_experts, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ws = workspace(16, num_experts, top_k, 8, 8, torch.float32)
    moe.route(logits, top_k, renormalize, ws)
    ref_w, ref_ids = reference.moe_route(logits, top_k, renormalize)
    assert torch.equal(ws.topk_ids[:9].long(), ref_ids)
    torch.testing.assert_close(ws.topk_weights[:9], ref_w, rtol=1e-6, atol=1e-7)


def test_route_breaks_ties_by_lower_index():
    """torch.topk leaves the order of equal values open (the CPU puts index 2 before 0 here): the kernel
    picks the lower index first."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, -1.0, 0.0, 2.0]], device=DEVICE)
    ws = workspace(1, 8, 4, 8, 8, torch.float32)
    moe.route(logits, 4, False, ws)
    assert ws.topk_ids[0].tolist() == [1, 3, 4, 7]


def test_route_of_a_non_finite_row_still_names_experts():
    """A NaN or inf in the hidden state (the sampler ends such a request) must not send rows to an expert
    that does not exist: the expert GEMMs would read past the weights."""
    logits = torch.tensor([[float("nan")] * 6, [0.0, float("inf"), 1.0, 0.0, 0.0, 0.0],
                           [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], device=DEVICE)
    ws = workspace(3, 6, 3, 8, 8, torch.float32)
    moe.route(logits, 3, True, ws)
    ids = ws.topk_ids[:3]
    assert bool(((ids >= 0) & (ids < 6)).all())
    assert ids[0].tolist() == [0, 1, 2] and ids[2].tolist() == [5, 4, 3]


@pytest.mark.parametrize("shape", [SMALL, ODD], ids=["pow2", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("renormalize,float32_weights", [(True, False), (False, False), (True, True)],
                         ids=["qwen3", "qwen2", "mixtral"])
def test_fused_moe_matches_reference(shape, dtype, num_tokens, renormalize, float32_weights):
    e, k, h, i = shape
    x, logits, gate_up, down = make_inputs(num_tokens, e, h, i, dtype)
    ws = workspace(64, e, k, h, i, dtype)
    out = fused_moe(x, logits, gate_up, down, k, renormalize, float32_weights, ws)
    ref = reference_moe(x, logits, gate_up, down, k, renormalize, float32_weights)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_with_64_row_tiles(dtype):
    """More than 16 rows per expert on average: the grouped GEMMs run 64-row tiles."""
    x, logits, gate_up, down = make_inputs(40, 4, 80, 48, dtype, seed=7)
    assert moe._block_m(40 * 2, 4) == 64
    out = fused_moe(x, logits, gate_up, down, 2, False, True, workspace(40, 4, 2, 80, 48, dtype))
    assert_close(out, reference_moe(x, logits, gate_up, down, 2, False, True), TOL[dtype])


@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_batch_path_equals_sorted_path(num_tokens, dtype, monkeypatch):
    x, logits, gate_up, down = make_inputs(num_tokens, 8, 80, 48, dtype, seed=3)
    ws = workspace(8, 8, 2, 80, 48, dtype)
    per_row = fused_moe(x, logits, gate_up, down, 2, True, False, ws).clone()
    monkeypatch.setattr(moe, "SMALL_BATCH_MAX_TOKENS", 0)
    sorted_out = fused_moe(x, logits, gate_up, down, 2, True, False, ws)
    assert_close(per_row, sorted_out, TOL[dtype] / 2)


def test_grouping_pads_each_expert_to_whole_tiles():
    """Running example of kernels/moe_align.py, with BLOCK_M = 16: ids [2, 0, 2, 2, 0] over E = 3."""
    ws = workspace(5, 3, 1, 8, 8, torch.float32)
    ws.topk_ids[:, 0] = torch.tensor([2, 0, 2, 2, 0], dtype=torch.int32)
    n_blocks = moe.moe_align.align_by_expert(ws.topk_ids, 5, 3, 16, ws)
    assert ws.total_padded.item() == 32 and n_blocks >= 2
    assert ws.block_expert[:2].tolist() == [0, 2]
    assert ws.sorted_rows[:32].tolist() == [1, 4] + [5] * 14 + [0, 2, 3] + [5] * 13


def test_grouping_spans_several_chunks():
    """More rows than one chunk of the sort: every row lands once, grouped by expert, in flat order."""
    rows, num_experts = 3 * moe.moe_align.ROW_CHUNK + 5, 7
    ws = workspace(rows, num_experts, 1, 8, 8, torch.float32)
    ids = torch.randint(0, num_experts, (rows,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    ids[ids == 3] = 4                                                   # an expert with no rows
    ws.topk_ids[:, 0] = ids.to(DEVICE)
    n_blocks = moe.moe_align.align_by_expert(ws.topk_ids, rows, num_experts, 64, ws)
    total = ws.total_padded.item()
    slots = ws.sorted_rows[:total].cpu()
    experts = ws.block_expert[:total // 64].cpu().repeat_interleave(64)
    real = slots < rows
    assert total // 64 <= n_blocks
    assert sorted(slots[real].tolist()) == list(range(rows))
    assert torch.equal(ids[slots[real].long()], experts[real])
    for e in range(num_experts):
        assert slots[real & (experts == e)].tolist() == torch.where(ids == e)[0].tolist()


def test_second_call_reuses_workspace_without_stale_rows():
    dtype, (e, k, h, i) = torch.float32, (8, 2, 64, 32)
    ws = workspace(40, e, k, h, i, dtype)
    ptrs = {name: getattr(ws, name).data_ptr() for name in ("topk_ids", "gate_up_out", "act", "down_out",
                                                             "sorted_rows")}
    fused_moe(*make_inputs(40, e, h, i, dtype, seed=1), k, True, False, ws)
    for num_tokens, seed in ((17, 2), (1, 3), (23, 4)):
        x, logits, gate_up, down = make_inputs(num_tokens, e, h, i, dtype, seed=seed)
        out = fused_moe(x, logits, gate_up, down, k, True, False, ws)
        assert_close(out, reference_moe(x, logits, gate_up, down, k, True, False), TOL[dtype])
    assert ptrs == {name: getattr(ws, name).data_ptr() for name in ptrs}


def test_workspace_num_bytes_is_what_it_allocates():
    args = (48, 8, 2, 64, 32, torch.float16)
    ws = MoEWorkspace(*args, DEVICE)
    allocated = sum(t.numel() * t.element_size() for t in vars(ws).values() if isinstance(t, torch.Tensor))
    assert MoEWorkspace.num_bytes(*args) == allocated


def test_too_many_tokens_rejected():
    x, logits, gate_up, down = make_inputs(9, 8, 64, 32, torch.float32)
    with pytest.raises(AssertionError, match="exceed"):
        fused_moe(x, logits, gate_up, down, 2, True, False, workspace(8, 8, 2, 64, 32, torch.float32))


REAL = {"qwen3-30b-a3b": (128, 8, 2048, 768, True, False), "mixtral": (8, 2, 4096, 14336, True, True)}


@gpu
@pytest.mark.parametrize("model,num_tokens", [("qwen3-30b-a3b", t) for t in (1, 2, 32, 512)]
                         + [("mixtral", t) for t in (1, 32)])
def test_fused_moe_real_shapes_bf16(model, num_tokens):
    e, k, h, i, renormalize, float32_weights = REAL[model]
    x, logits, gate_up, down = make_inputs(num_tokens, e, h, i, torch.bfloat16)
    ws = workspace(512, e, k, h, i, torch.bfloat16)
    out = fused_moe(x, logits, gate_up, down, k, renormalize, float32_weights, ws)
    ref = reference_moe(x, logits, gate_up, down, k, renormalize, float32_weights, compute_dtype=torch.float32)
    assert_close(out, ref, TOL[torch.bfloat16])


@gpu
def test_cuda_graph_replay_equals_eager():
    e, k, h, i, renormalize, float32_weights = REAL["qwen3-30b-a3b"]
    x, logits, gate_up, down = make_inputs(32, e, h, i, torch.bfloat16, seed=1)
    ws = workspace(64, e, k, h, i, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, logits, gate_up, down, k, renormalize, float32_weights, ws)      # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, logits, gate_up, down, k, renormalize, float32_weights, ws)
    for seed in (2, 3):
        new_x, new_logits, _, _ = make_inputs(32, e, h, i, torch.bfloat16, seed=seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe(new_x, new_logits, gate_up, down, k, renormalize, float32_weights, ws)
        assert torch.equal(captured, eager)
