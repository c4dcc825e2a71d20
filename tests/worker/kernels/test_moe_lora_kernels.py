"""Triton MoE-LoRA hooks (kernels/moe_lora.py) against the float32 flat-row references.

Without CUDA the kernels run in the Triton interpreter on small fp16/fp32 shapes (E=8, K=2, H=64, I=48: not
powers of two, so the masks are exercised); with CUDA bf16 runs at the Qwen3-30B-A3B shape and a CUDA graph
captured with one adapter and expert mix replays another. Weights are strided views of a uint8 slot buffer
with other bytes between the regions, as lora/gpu_pool.py lays them out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from worker.lora.weights import MoELoRAWeights  # noqa: E402
from worker.kernels import fused_moe as moe, reference  # noqa: E402
from worker.kernels.fused_moe import MoEWorkspace, fused_moe  # noqa: E402
from worker.kernels.moe_lora import (  # noqa: E402
    MoELoRAStep,
    MoELoRAWorkspace,
    add_down_lora,
    add_gate_up_lora,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# tolerance, relative to the largest reference magnitude: one rounding into the output dtype (bf16 also
# rounds xa for the tensor cores)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float16, torch.float32]
STRATEGIES = {"per-row": False, "grouped": True}


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int
    max_rank: int                 # R
    slot_ranks: tuple[int, ...]   # one per slot
    shared_slot: int = -1         # the slot whose gate/up A and down B serve every expert
    zero_scalings: tuple[tuple[int, int], ...] = ()   # (slot, projection) left alone with scaling 0


def _cpu_shape(max_rank: int) -> Shape:
    return Shape(8, 2, 64, 48, max_rank, (4, 1, max_rank, max_rank), shared_slot=2,
                 zero_scalings=((3, 1), (0, 2)))


QWEN3_30B = dict(experts=128, top_k=8, hidden=2048, inter=768, max_rank=64)


@dataclass(frozen=True)
class Scenario:
    num_tokens: int
    popularity: str          # distinct | identical | uniform: how tokens pick slots
    base_every: int = 0      # every n-th token is base only (-1); 0: none


SCENARIOS = {
    "T1": Scenario(1, "identical"),
    "T2-distinct": Scenario(2, "distinct"),
    "T5-uniform-base": Scenario(5, "uniform", base_every=2),
    "T40-distinct-base": Scenario(40, "distinct", base_every=5),
    "T40-identical-base": Scenario(40, "identical", base_every=3),
    "T40-uniform-base": Scenario(40, "uniform", base_every=4),
}


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device) * scale


def _token_slots(sc: Scenario, num_slots: int, gen: torch.Generator) -> list[int]:
    if sc.popularity == "distinct":
        perm = torch.randperm(num_slots, generator=gen, device=gen.device).tolist()
        slots = [perm[t % num_slots] for t in range(sc.num_tokens)]
    elif sc.popularity == "identical":
        slots = [int(torch.randint(num_slots, (1,), generator=gen, device=gen.device))] * sc.num_tokens
    else:
        slots = torch.randint(num_slots, (sc.num_tokens,), generator=gen, device=gen.device).tolist()
    return [-1 if sc.base_every and t % sc.base_every == 1 else w for t, w in enumerate(slots)]


def _topk_ids(num_tokens: int, shape: Shape, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int32, K distinct experts per token."""
    scores = torch.rand(num_tokens, shape.experts, generator=gen, device=gen.device)
    return scores.topk(shape.top_k, dim=1).indices.to(torch.int32).to(DEVICE).contiguous()


def _slot_pool(shape: Shape, dtype: torch.dtype, gen: torch.Generator) -> tuple[MoELoRAWeights, torch.Tensor]:
    """MoELoRAWeights as views of a [S, num_bytes] uint8 buffer (random bytes between the regions), filled with
    random weights zero-padded past each slot's rank; the shared slot's unused experts hold NaN."""
    e, h, i, r, s = shape.experts, shape.hidden, shape.inter, shape.max_rank, len(shape.slot_ranks)
    regions = {"gate_up_a": ((e, 2 * r, h), dtype), "gate_up_b": ((e, 2 * i, r), dtype),
               "down_a": ((e, r, i), dtype), "down_b": ((e, h, r), dtype),
               "scalings": ((3,), torch.float32), "shared_outer": ((), torch.int32)}
    offsets, offset = {}, 0
    for name, (dims, dt) in regions.items():
        offset += 256                                  # other data between regions
        offsets[name] = offset
        offset += -(-math.prod(dims) * dt.itemsize // 256) * 256
    pool = torch.randint(0, 256, (s, offset + 256), dtype=torch.uint8, generator=gen, device=gen.device)
    pool = pool.to(DEVICE)

    def view(name: str) -> torch.Tensor:
        dims, dt = regions[name]
        lo = offsets[name]
        return pool[:, lo:lo + math.prod(dims) * dt.itemsize].view(dt).unflatten(1, dims) if dims else \
            pool[:, lo:lo + dt.itemsize].view(dt)[:, 0]

    w = MoELoRAWeights(**{name: view(name) for name in regions})
    for slot, rank in enumerate(shape.slot_ranks):
        pad = torch.arange(r, device=DEVICE) >= rank                     # [R]
        a = _randn(e, 2, r, h, gen=gen, scale=h ** -0.5).to(DEVICE)
        a[:, :, pad] = 0
        b = _randn(e, 2 * i, r, gen=gen, scale=max(rank, 1) ** -0.5).to(DEVICE)
        b[:, :, pad] = 0
        da = _randn(e, r, i, gen=gen, scale=i ** -0.5).to(DEVICE)
        da[:, pad] = 0
        db = _randn(e, h, r, gen=gen, scale=max(rank, 1) ** -0.5).to(DEVICE)
        db[:, :, pad] = 0
        if slot == shape.shared_slot:
            a[1:], db[1:] = float("nan"), float("nan")
        w.gate_up_a[slot], w.gate_up_b[slot] = a.flatten(1, 2).to(dtype), b.to(dtype)
        w.down_a[slot], w.down_b[slot] = da.to(dtype), db.to(dtype)
        w.scalings[slot] = torch.rand(3, generator=gen, device=gen.device).to(DEVICE) + 0.5
        w.shared_outer[slot] = int(slot == shape.shared_slot)
    for slot, proj in shape.zero_scalings:
        w.scalings[slot, proj] = 0.0
    ranks = torch.tensor(shape.slot_ranks, dtype=torch.int32, device=DEVICE)
    return w, ranks


def _reference_slots(w: MoELoRAWeights, ranks: torch.Tensor) -> reference.MoELoRASlots:
    """The same slots in float32, as the references read them."""
    host_ranks = ranks.tolist()
    return reference.MoELoRASlots(
        w.gate_up_a.float(), w.gate_up_b.float(), w.down_a.float(), w.down_b.float(),
        [[r, r, r] for r in host_ranks], w.scalings.float().clone(), [bool(v) for v in w.shared_outer.tolist()])


def _workspace(shape: Shape, max_tokens: int) -> MoELoRAWorkspace:
    """A workspace full of garbage: the kernels must never read what an earlier call left."""
    ws = MoELoRAWorkspace(max_tokens, shape.experts, shape.top_k, shape.max_rank, len(shape.slot_ranks), DEVICE)
    ws.xa.fill_(float("nan"))
    for buf in (ws.counts, ws.tile_start, ws.row_pos, ws.sorted_rows, ws.tile_key):
        buf.fill_(7)
    return ws


def _step(w, ranks, slots: list[int], ws: MoELoRAWorkspace) -> MoELoRAStep:
    token_lora_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    used = [int(ranks[s]) for s in set(slots) if s >= 0]
    return MoELoRAStep(w, token_lora_slots, ranks, max(used, default=1), ws)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    magnitude = expected.abs().max().item()
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol * magnitude)


def _assert_base_rows_untouched(actual, before, slots: list[int], top_k: int) -> None:
    base = [t * top_k + j for t, w in enumerate(slots) if w < 0 for j in range(top_k)]
    assert torch.equal(actual[base], before[base]), "rows of base-only tokens must be bitwise unchanged"


def _check_gate_up(shape, w, ranks, sc, ws, dtype, grouped, gen) -> None:
    slots = _token_slots(sc, len(shape.slot_ranks), gen)
    x = _randn(sc.num_tokens, shape.hidden, gen=gen).to(DEVICE, dtype)
    topk_ids = _topk_ids(sc.num_tokens, shape, gen)
    h0 = _randn(sc.num_tokens * shape.top_k, 2 * shape.inter, gen=gen).to(DEVICE, dtype)
    h = h0.clone()

    add_gate_up_lora(h, x, topk_ids, _step(w, ranks, slots, ws), grouped=grouped)

    ref = reference.moe_lora_gate_up_flat(h0.float(), x.float(), topk_ids, slots, _reference_slots(w, ranks))
    _assert_close(h, ref, dtype)
    _assert_base_rows_untouched(h, h0, slots, shape.top_k)


def _check_down(shape, w, ranks, sc, ws, dtype, grouped, gen) -> None:
    slots = _token_slots(sc, len(shape.slot_ranks), gen)
    rows = sc.num_tokens * shape.top_k
    act = _randn(rows, shape.inter, gen=gen).to(DEVICE, dtype)
    topk_ids = _topk_ids(sc.num_tokens, shape, gen)
    y0 = _randn(rows, shape.hidden, gen=gen).to(DEVICE, dtype)
    y = y0.clone()

    add_down_lora(y, act, topk_ids, _step(w, ranks, slots, ws), grouped=grouped)

    ref = reference.moe_lora_down_flat(y0.float(), act.float(), topk_ids, slots, _reference_slots(w, ranks))
    _assert_close(y, ref, dtype)
    _assert_base_rows_untouched(y, y0, slots, shape.top_k)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("max_rank", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gate_up_hook_matches_flat_reference(dtype, max_rank, scenario, strategy):
    gen = torch.Generator().manual_seed(1)
    shape = _cpu_shape(max_rank)
    w, ranks = _slot_pool(shape, dtype, gen)
    sc = SCENARIOS[scenario]
    _check_gate_up(shape, w, ranks, sc, _workspace(shape, sc.num_tokens), dtype, STRATEGIES[strategy], gen)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("max_rank", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_down_hook_matches_flat_reference(dtype, max_rank, scenario, strategy):
    gen = torch.Generator().manual_seed(2)
    shape = _cpu_shape(max_rank)
    w, ranks = _slot_pool(shape, dtype, gen)
    sc = SCENARIOS[scenario]
    _check_down(shape, w, ranks, sc, _workspace(shape, sc.num_tokens), dtype, STRATEGIES[strategy], gen)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_workspace_reused_across_calls_and_strategies_without_stale_values(strategy):
    """One workspace (sized for 40 tokens) serves calls of other sizes, mixes and both hooks in turn."""
    gen = torch.Generator().manual_seed(3)
    shape = _cpu_shape(16)
    w, ranks = _slot_pool(shape, torch.float32, gen)
    ws = _workspace(shape, 40)
    storage = ws.xa.data_ptr(), ws.sorted_rows.data_ptr()
    for name in ("T40-uniform-base", "T5-uniform-base", "T40-identical-base", "T1"):
        _check_gate_up(shape, w, ranks, SCENARIOS[name], ws, torch.float32, STRATEGIES[strategy], gen)
        _check_down(shape, w, ranks, SCENARIOS[name], ws, torch.float32, not STRATEGIES[strategy], gen)
    assert (ws.xa.data_ptr(), ws.sorted_rows.data_ptr()) == storage


@pytest.mark.parametrize("sizes", [(40, 8, 2, 16, 4), (2048, 128, 8, 64, 16)], ids=["cpu", "qwen3-30b"])
def test_workspace_num_bytes_is_what_it_allocates(sizes):
    ws = MoELoRAWorkspace(*sizes, device="meta")
    buffers = (ws.xa, ws.counts, ws.tile_start, ws.row_pos, ws.sorted_rows, ws.tile_key)
    assert MoELoRAWorkspace.num_bytes(*sizes) == sum(b.numel() * b.element_size() for b in buffers)


def test_grouping_sorts_rows_into_padded_tiles_by_slot_and_expert():
    """The workspace's running example (E=4, keys [5, 1, 5, 5, -, 1]) at BLOCK_M=16: one tile per key."""
    from worker.kernels import moe_lora
    shape = Shape(4, 1, 16, 16, 8, (8, 8))
    w, ranks = _slot_pool(shape, torch.float32, torch.Generator().manual_seed(4))
    ws = _workspace(shape, 6)
    topk_ids = torch.tensor([[1], [1], [1], [1], [0], [1]], dtype=torch.int32, device=DEVICE)
    step = _step(w, ranks, [1, 0, 1, 1, -1, 0], ws)

    tiles = moe_lora._group_rows(topk_ids, step, block_m=16)

    assert tiles == moe_lora._max_tiles(6, 8, 16)
    assert ws.tile_key[:tiles].tolist() == [1, 5] + [-1] * (tiles - 2)
    assert ws.tile_start[[1, 5]].tolist() == [0, 1]
    rows = ws.sorted_rows[:16 * tiles].tolist()
    assert sorted(rows[:2]) == [1, 5] and sorted(rows[16:19]) == [0, 2, 3]
    assert rows[2:16] + rows[19:] == [-1] * (16 * tiles - 5)


def _moe_block_with_hooks(x, gate_up, down, topk_weights, topk_ids, step: MoELoRAStep, grouped: bool):
    """A flat-row MoE block in torch, the hooks called where fused_moe calls them. -> [T, H]"""
    num_tokens, k = topk_ids.shape
    experts = topk_ids.reshape(-1).long()                                          # [T*K]
    h = torch.bmm(gate_up[experts], x.repeat_interleave(k, 0)[:, :, None])[:, :, 0]   # [T*K, 2I]
    add_gate_up_lora(h, x, topk_ids, step, grouped=grouped)
    gate, up = h.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).contiguous()                      # [T*K, I]
    y = torch.bmm(down[experts], act[:, :, None])[:, :, 0]                         # [T*K, H]
    add_down_lora(y, act, topk_ids, step, grouped=grouped)
    return (y * topk_weights.reshape(-1, 1)).view(num_tokens, k, -1).sum(dim=1)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", ["T5-uniform-base", "T40-uniform-base"])
def test_hooks_in_a_moe_block_match_reference_moe_lora_experts(scenario, strategy):
    """Both hooks at their places in a flat-row MoE block (float32) equal reference.moe_lora_experts."""
    gen = torch.Generator().manual_seed(7)
    shape = _cpu_shape(16)
    w, ranks = _slot_pool(shape, torch.float32, gen)
    sc = SCENARIOS[scenario]
    slots = _token_slots(sc, len(shape.slot_ranks), gen)
    e, h, i = shape.experts, shape.hidden, shape.inter
    x = _randn(sc.num_tokens, h, gen=gen).to(DEVICE)
    gate_up = _randn(e, 2 * i, h, gen=gen, scale=h ** -0.5).to(DEVICE)
    down = _randn(e, h, i, gen=gen, scale=i ** -0.5).to(DEVICE)
    topk_ids = _topk_ids(sc.num_tokens, shape, gen)
    topk_weights = torch.rand(sc.num_tokens, shape.top_k, generator=gen).to(DEVICE)

    out = _moe_block_with_hooks(x, gate_up, down, topk_weights, topk_ids,
                                _step(w, ranks, slots, _workspace(shape, sc.num_tokens)), STRATEGIES[strategy])

    expected = reference.moe_lora_experts(x, gate_up, down, topk_weights, topk_ids, slots, _reference_slots(w, ranks))
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_ranks_share_of_the_intermediate_size_sums_to_the_whole_block(world_size):
    """Tensor parallelism (layers/sparse_moe.py): the experts and their LoRA cut to each rank's share of I (gate and up
    rows of gate_up and of gate_up_b, columns of down and of down_a), each rank's fused_moe run in a MoEWorkspace
    sized I / world_size (model.moe_intermediate_size_per_rank); the ranks' partial outputs sum to
    reference.moe_lora_experts of the whole block (float32)."""
    gen = torch.Generator().manual_seed(13)
    shape = _cpu_shape(8)
    w, ranks = _slot_pool(shape, torch.float32, gen)
    sc = SCENARIOS["T40-uniform-base"]
    slots = _token_slots(sc, len(shape.slot_ranks), gen)
    e, k, h, i = shape.experts, shape.top_k, shape.hidden, shape.inter
    x = _randn(sc.num_tokens, h, gen=gen).to(DEVICE)
    logits = _randn(sc.num_tokens, e, gen=gen).to(DEVICE)
    gate_up = _randn(e, 2 * i, h, gen=gen, scale=h ** -0.5).to(DEVICE)
    down = _randn(e, h, i, gen=gen, scale=i ** -0.5).to(DEVICE)
    weights, ids = reference.moe_route(logits, k, True)
    expected = reference.moe_lora_experts(x, gate_up, down, weights, ids, slots, _reference_slots(w, ranks))

    total = torch.zeros_like(x)
    length = i // world_size
    for rank in range(world_size):
        start = rank * length
        rows = torch.cat([torch.arange(start, start + length), torch.arange(i + start, i + start + length)]).to(DEVICE)
        share = MoELoRAWeights(w.gate_up_a, w.gate_up_b[:, :, rows].contiguous(),
                               w.down_a[..., start:start + length].contiguous(), w.down_b, w.scalings, w.shared_outer)
        step = _step(share, ranks, slots, _workspace(shape, sc.num_tokens))
        ws = MoEWorkspace(sc.num_tokens, e, k, h, length, torch.float32, DEVICE)
        total += fused_moe(x, logits, gate_up[:, rows].contiguous(), down[..., start:start + length].contiguous(), k,
                           True, False, ws, lora=step)
    _assert_close(total, expected, torch.float32)


# GPU: bf16 at the Qwen3-30B-A3B expert shape; name: (tokens, slot ranks, popularity, base-only every n-th)
GPU_CASES = {
    "T1-r64": (1, (64,), "identical", 0),
    "T32-8-adapters-r8-64": (32, (8, 16, 32, 64, 8, 16, 32, 64), "distinct", 9),
    "T32-16-adapters-shared": (32, (16,) * 8 + (64,) * 8, "uniform", 0),
    "T512-4-adapters": (512, (8, 64, 16, 32), "uniform", 7),
    "T512-1-adapter-r16": (512, (16,), "identical", 0),
}


def _gpu_shape(slot_ranks: tuple[int, ...]) -> Shape:
    return Shape(**QWEN3_30B, slot_ranks=slot_ranks, shared_slot=len(slot_ranks) - 1 if len(slot_ranks) > 8 else -1,
                 zero_scalings=((0, 1),) if len(slot_ranks) > 1 else ())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", GPU_CASES)
def test_hooks_match_reference_at_qwen3_30b_shape(case, strategy):
    tokens, slot_ranks, popularity, base_every = GPU_CASES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    shape = _gpu_shape(slot_ranks)
    w, ranks = _slot_pool(shape, torch.bfloat16, gen)
    ws = _workspace(shape, 512)
    sc = Scenario(tokens, popularity, base_every)
    _check_gate_up(shape, w, ranks, sc, ws, torch.bfloat16, STRATEGIES[strategy], gen)
    _check_down(shape, w, ranks, sc, ws, torch.bfloat16, STRATEGIES[strategy], gen)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hooks_replay_in_cuda_graph_with_other_adapters_and_experts(strategy):
    """Captured at T=32 with one adapter and expert mix; replays with others equal eager calls, no syncs."""
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    shape = _gpu_shape((8, 16, 32, 64) * 4)
    w, ranks = _slot_pool(shape, torch.bfloat16, gen)
    tokens, k = 32, shape.top_k
    ws, eager_ws = _workspace(shape, tokens), _workspace(shape, tokens)
    static = {"slots": torch.zeros(tokens, dtype=torch.int32, device=DEVICE),
              "ids": _topk_ids(tokens, shape, gen), "x": _randn(tokens, shape.hidden, gen=gen).bfloat16(),
              "act": _randn(tokens * k, shape.inter, gen=gen).bfloat16(),
              "h": torch.zeros(tokens * k, 2 * shape.inter, dtype=torch.bfloat16, device=DEVICE),
              "y": torch.zeros(tokens * k, shape.hidden, dtype=torch.bfloat16, device=DEVICE)}
    h0 = _randn(tokens * k, 2 * shape.inter, gen=gen).bfloat16()
    y0 = _randn(tokens * k, shape.hidden, gen=gen).bfloat16()
    grouped = STRATEGIES[strategy]

    def hooks(s: dict, step: MoELoRAStep) -> None:
        add_gate_up_lora(s["h"], s["x"], s["ids"], step, grouped=grouped)
        add_down_lora(s["y"], s["act"], s["ids"], step, grouped=grouped)

    graph_step = MoELoRAStep(w, static["slots"], ranks, 64, ws)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        hooks(static, graph_step)                    # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hooks(static, graph_step)
    for sc in (Scenario(tokens, "uniform", 5), Scenario(tokens, "identical", 3)):
        slots = torch.tensor(_token_slots(sc, len(shape.slot_ranks), gen), dtype=torch.int32, device=DEVICE)
        ids = _topk_ids(tokens, shape, gen)
        eager = dict(static, slots=slots, ids=ids, h=h0.clone(), y=y0.clone())
        torch.cuda.set_sync_debug_mode("error")
        try:
            static["slots"].copy_(slots)
            static["ids"].copy_(ids)
            static["h"].copy_(h0)
            static["y"].copy_(y0)
            graph.replay()
            hooks(eager, MoELoRAStep(w, slots, ranks, 64, eager_ws))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(static["h"], eager["h"], rtol=0, atol=0)
        torch.testing.assert_close(static["y"], eager["y"], rtol=0, atol=0)
        assert not torch.equal(static["h"], h0)


# --- fused_moe at one or two tokens: kernels/moe_gemv.py, the LoRA expand inside the expert GEMVs -------------------


def _fused_moe_case(shape: Shape, slots: list[int], dtype, gen, seed_logits: int = 0):
    """Inputs of a fused_moe call with LoRA: (x, logits, gate_up, down, weights, ranks, workspaces)."""
    num_tokens = len(slots)
    e, h, i = shape.experts, shape.hidden, shape.inter
    w, ranks = _slot_pool(shape, dtype, gen)
    x = _randn(num_tokens, h, gen=gen).to(DEVICE, dtype)
    logits = _randn(num_tokens, e, gen=gen).to(DEVICE, dtype)
    gate_up = _randn(e, 2 * i, h, gen=gen, scale=h ** -0.5).to(DEVICE, dtype)
    down = _randn(e, h, i, gen=gen, scale=i ** -0.5).to(DEVICE, dtype)
    ws = MoEWorkspace(max(num_tokens, 4), e, shape.top_k, h, i, dtype, DEVICE)
    return x, logits, gate_up, down, w, ranks, ws, _workspace(shape, max(num_tokens, 4))


def _reference_fused(x, logits, gate_up, down, shape, slots, w, ranks, float32_weights, compute_dtype=None):
    """reference.moe_route + reference.moe_lora_experts as layers/sparse_moe.py calls them (upcast first if asked; the
    reference reads the slots in float32)."""
    slot_view = _reference_slots(w, ranks)
    if compute_dtype is not None:
        x, logits, gate_up, down = (t.to(compute_dtype) for t in (x, logits, gate_up, down))
    weights, ids = reference.moe_route(logits, shape.top_k, True)
    if not float32_weights:
        weights = weights.to(x.dtype)
    return reference.moe_lora_experts(x, gate_up, down, weights, ids, slots, slot_view)


CPU_SMALL_SLOTS = {"T1-adapter": [0], "T1-shared-outer": [2], "T1-base": [-1], "T2-two-adapters": [3, 1],
                   "T2-base-and-shared": [-1, 2], "T2-one-adapter": [0, 0]}


@pytest.mark.parametrize("float32_weights", [False, True], ids=["qwen", "mixtral"])
@pytest.mark.parametrize("slots", CPU_SMALL_SLOTS.values(), ids=CPU_SMALL_SLOTS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_batch_fused_moe_with_lora_matches_reference_and_the_sorted_path(dtype, slots, float32_weights,
                                                                                monkeypatch):
    """T <= 2 runs kernels/moe_gemv.py (shrink, GEMV + expand + SiLU, shrink, GEMV + expand + weighted sum): equal
    to reference.moe_lora_experts within one rounding, and to the sorted path with its hooks (T > 2's) within
    the float32 summation order; slots of rank 1 and R, a shared-outer slot, zero scalings, base-only tokens."""
    gen = torch.Generator().manual_seed(11)
    shape = _cpu_shape(16)
    x, logits, gate_up, down, w, ranks, ws, lora_ws = _fused_moe_case(shape, slots, dtype, gen)
    step = _step(w, ranks, slots, lora_ws)

    small = moe.fused_moe(x, logits, gate_up, down, shape.top_k, True, float32_weights, ws, lora=step).clone()
    monkeypatch.setattr(moe, "SMALL_BATCH_MAX_TOKENS", 0)
    sorted_path = moe.fused_moe(x, logits, gate_up, down, shape.top_k, True, float32_weights, ws, lora=step)

    expected = _reference_fused(x, logits, gate_up, down, shape, slots, w, ranks, float32_weights,
                                compute_dtype=torch.float32 if dtype != torch.float32 else None)
    _assert_close(small, expected, dtype)
    torch.testing.assert_close(small.float(), sorted_path.float(), rtol=TOL[dtype] / 4,
                               atol=TOL[dtype] / 4 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_batch_base_token_is_bitwise_the_no_lora_output(dtype):
    """A base-only token beside an adapted one: its output is bitwise what fused_moe gives with LoRA off."""
    gen = torch.Generator().manual_seed(12)
    shape = _cpu_shape(8)
    slots = [1, -1]
    x, logits, gate_up, down, w, ranks, ws, lora_ws = _fused_moe_case(shape, slots, dtype, gen)
    with_lora = fused_moe(x, logits, gate_up, down, shape.top_k, True, False, ws,
                          lora=_step(w, ranks, slots, lora_ws)).clone()
    without = fused_moe(x, logits, gate_up, down, shape.top_k, True, False, ws)
    assert torch.equal(with_lora[1], without[1])
    assert not torch.equal(with_lora[0], without[0])


GPU_SMALL_CASES = {"T1-r16": ((16,), [0]), "T1-r64": ((8, 64), [1]), "T2-r8-r64": ((8, 64), [0, 1]),
                   "T2-base-and-r32": ((32,), [-1, 0]), "T2-shared-outer": ((16,) * 9, [8, 3])}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_SMALL_CASES)
def test_small_batch_fused_moe_with_lora_at_qwen3_30b_shape(case):
    """bf16 at Qwen3-30B-A3B's shape (E=128, top-8, H=2048, I=768, R=64) against the float32 reference of the
    same bf16 weights."""
    slot_ranks, slots = GPU_SMALL_CASES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    shape = _gpu_shape(slot_ranks)
    x, logits, gate_up, down, w, ranks, ws, lora_ws = _fused_moe_case(shape, slots, torch.bfloat16, gen)
    out = fused_moe(x, logits, gate_up, down, shape.top_k, True, False, ws, lora=_step(w, ranks, slots, lora_ws))
    expected = _reference_fused(x, logits, gate_up, down, shape, slots, w, ranks, False, compute_dtype=torch.float32)
    _assert_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_small_batch_fused_moe_replays_in_cuda_graph_with_other_adapters_and_experts(num_tokens):
    """Captured at R with one adapter mix; replays for other slots, ranks and routings equal eager calls
    bitwise, without host-device syncs (PDL edges included)."""
    gen = torch.Generator(device=DEVICE).manual_seed(14)
    shape = _gpu_shape((8, 16, 32, 64) * 4)
    slots = [0] * num_tokens
    x, logits, gate_up, down, w, ranks, ws, lora_ws = _fused_moe_case(shape, slots, torch.bfloat16, gen)
    static_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    graph_step = MoELoRAStep(w, static_slots, ranks, 64, lora_ws)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_moe(x, logits, gate_up, down, shape.top_k, True, False, ws, lora=graph_step)     # compile first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, logits, gate_up, down, shape.top_k, True, False, ws, lora=graph_step)
    eager_ws = MoEWorkspace(ws.max_tokens, shape.experts, shape.top_k, shape.hidden, shape.inter, torch.bfloat16,
                            DEVICE)
    eager_lora_ws = _workspace(shape, 4)
    for new_slots in ([5, -1][:num_tokens], [15, 2][:num_tokens], [-1, 7][:num_tokens]):
        new_x = _randn(num_tokens, shape.hidden, gen=gen).bfloat16()
        new_logits = _randn(num_tokens, shape.experts, gen=gen).bfloat16()
        slots_t = torch.tensor(new_slots, dtype=torch.int32, device=DEVICE)
        torch.cuda.set_sync_debug_mode("error")
        try:
            x.copy_(new_x)
            logits.copy_(new_logits)
            static_slots.copy_(slots_t)
            graph.replay()
            eager = fused_moe(new_x, new_logits, gate_up, down, shape.top_k, True, False, eager_ws,
                              lora=MoELoRAStep(w, slots_t, ranks, 64, eager_lora_ws))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(captured, eager)
