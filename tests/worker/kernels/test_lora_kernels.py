"""Triton LoRA shrink/expand against float32 references.

Without CUDA the kernels run in the Triton interpreter on small fp16/fp32 shapes (the interpreter does
not emulate bf16 dots); with CUDA they compile, bf16 is added, and the `gpu` cases run at 8B shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from worker.kernels import reference  # noqa: E402
from worker.kernels.lora_expand import lora_expand  # noqa: E402
from worker.kernels.lora_shrink import lora_shrink  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])
# tolerance, relative to the largest reference magnitude: one rounding into the output dtype
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
NUM_SLOTS, IN_DIM = 8, 80          # 80: not a multiple of the K block, so the K mask is exercised
SLICE_WIDTHS = {"o": (40,), "gate_up": (56, 56), "qkv": (64, 32, 32)}


@dataclass(frozen=True)
class Scenario:
    seg_lens: tuple[int, ...]
    base_only: tuple[int, ...]     # positions of base-only segments
    popularity: str                # distinct | uniform | identical | zipf
    slot_ranks: tuple[int, ...]    # cycled over the slots
    max_rank: int = 16             # R
    pad_segments: int = 0          # empty segments past the real ones (CUDA-graph bucket)
    pad_tokens: int = 0            # rows past the last segment (belong to no segment)
    num_slots: int = NUM_SLOTS
    seg_len_bound: int = 0         # max_seg_len passed to the kernels (a mixed graph's token count); 0: the real


SCENARIOS = {
    "decode-distinct-ranks4+16": Scenario((1,) * 6, (2, 5), "distinct", (4, 16)),
    "decode-uniform-ranks4+16": Scenario((1,) * 6, (0,), "uniform", (16, 4)),
    "decode-identical": Scenario((1,) * 6, (3,), "identical", (16,)),
    "decode-zipf-ranks4+16": Scenario((1,) * 6, (4,), "zipf", (4, 16)),
    "decode-graph-padded": Scenario((1,) * 5, (1,), "uniform", (4, 16), pad_segments=3, pad_tokens=3),
    "decode-zipf-R128": Scenario((1,) * 4, (2,), "zipf", (8, 24, 72, 128), max_rank=128),
    "decode-merged-uniform-ranks4+16": Scenario((3, 1, 5, 2, 1), (3,), "uniform", (4, 16)),  # runs of one adapter
    "prefill-distinct-ranks4+16": Scenario((19, 5, 33, 1), (1,), "distinct", (4, 16)),
    "prefill-identical": Scenario((40, 17), (), "identical", (16,)),
    "prefill-zipf-ranks4+16": Scenario((3, 21, 1, 18, 9), (2,), "zipf", (16, 4)),
    "prefill-uniform-R128": Scenario((20, 1, 9, 30), (1,), "uniform", (8, 24, 72, 128), max_rank=128),
    # a mixed-batch CUDA graph: rows and segments padded, max_seg_len the graph's token count
    "mixed-graph-padded": Scenario((19, 1, 1, 7), (1,), "zipf", (4, 16), pad_segments=4, pad_tokens=9,
                                   seg_len_bound=37),
    # more segments than one vector step of kernels/row_tiles.py reads (64)
    "mixed-70-segments": Scenario((1,) * 69 + (20,), (5, 30), "uniform", (4, 16), pad_segments=2, pad_tokens=3),
}


def _popular_slots(popularity: str, n: int, num_slots: int, gen: torch.Generator) -> list[int]:
    if popularity == "distinct":
        return torch.randperm(num_slots, generator=gen)[:n].tolist()
    if popularity == "uniform":
        return torch.randint(num_slots, (n,), generator=gen).tolist()
    if popularity == "identical":
        return [int(torch.randint(num_slots, (1,), generator=gen))] * n
    zipf = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.5
    return torch.multinomial(zipf, n, replacement=True, generator=gen).tolist()


@dataclass
class Batch:
    """One step's segments: host lists for the references, device tensors for the kernels."""
    seg_indptr: list[int]         # [num real segments + 1]
    slots: list[int]              # [num real segments]; -1 = base only
    slot_ranks: list[int]         # [num_slots]
    max_rank: int
    num_segments: int             # grid bound, counts the empty padding segments
    max_seg_len: int
    num_tokens: int

    def token_lora_slots(self) -> list[int | None]:
        """Adapter slot of each token row; None for rows in no segment."""
        rows: list[int | None] = [None] * self.num_tokens
        for i, w in enumerate(self.slots):
            rows[self.seg_indptr[i]:self.seg_indptr[i + 1]] = [w] * (self.seg_indptr[i + 1] - self.seg_indptr[i])
        return rows

    def device_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """seg_indptr, seg_lora_slots, ranks; padding segments are empty but name a real slot (0)."""
        pad = self.num_segments - len(self.slots)
        indptr = self.seg_indptr + [self.seg_indptr[-1]] * pad
        weights = self.slots + [0] * pad
        return tuple(torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (indptr, weights, self.slot_ranks))


def _make_batch(sc: Scenario, gen: torch.Generator) -> Batch:
    slots = _popular_slots(sc.popularity, len(sc.seg_lens), sc.num_slots, gen)
    slots = [-1 if i in sc.base_only else w for i, w in enumerate(slots)]
    indptr = [0]
    for n in sc.seg_lens:
        indptr.append(indptr[-1] + n)
    ranks = [sc.slot_ranks[i % len(sc.slot_ranks)] for i in range(sc.num_slots)]
    return Batch(indptr, slots, ranks, sc.max_rank, len(slots) + sc.pad_segments,
                 sc.seg_len_bound or max(sc.seg_lens), indptr[-1] + sc.pad_tokens)


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def _per_token_xa(x: torch.Tensor, a: torch.Tensor, batch: Batch, num_slices: int) -> torch.Tensor:
    """float32 xa, one token at a time; NaN on rows in no segment (the kernel must not write them)."""
    R = batch.max_rank
    xa = torch.zeros(batch.num_tokens, num_slices * R, device=x.device)
    for t, w in enumerate(batch.token_lora_slots()):
        if w is None:
            xa[t] = float("nan")
            continue
        if w < 0:
            continue
        r = batch.slot_ranks[w]
        for s in range(num_slices):
            xa[t, s * R:s * R + r] = a[w, s * R:s * R + r].float() @ x[t].float()
    return xa


def _per_token_y(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor, batch: Batch,
                 offsets: list[int]) -> torch.Tensor:
    """float32 y + scaled delta, one token at a time."""
    R, out = batch.max_rank, y.float().clone()
    for t, w in enumerate(batch.token_lora_slots()):
        if w is None or w < 0:
            continue
        r = batch.slot_ranks[w]
        for s in range(len(offsets) - 1):
            o0, o1 = offsets[s], offsets[s + 1]
            out[t, o0:o1] += scalings[w, s] * (b[w, o0:o1, :r].float() @ xa[t, s * R:s * R + r].float())
    return out


def _offsets(widths: tuple[int, ...]) -> list[int]:
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return offsets


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    magnitude = expected.nan_to_num().abs().max().item()
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol * magnitude, equal_nan=True)


def _expand_inputs(batch: Batch, widths: tuple[int, ...], gen: torch.Generator):
    """y, xa (random everywhere, also past each rank), b, scalings."""
    R, out_dim = batch.max_rank, sum(widths)
    y = _randn(batch.num_tokens, out_dim, gen=gen)
    xa = _randn(batch.num_tokens, len(widths) * R, gen=gen)
    num_slots = len(batch.slot_ranks)
    b = _randn(num_slots, out_dim, R, gen=gen, scale=R ** -0.5)
    scalings = (torch.rand(num_slots, len(widths), generator=gen) + 0.5).to(DEVICE)
    return y, xa, b, scalings


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("widths", SLICE_WIDTHS.values(), ids=SLICE_WIDTHS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_matches_per_token_reference(dtype, widths, scenario):
    gen = torch.Generator().manual_seed(1)
    batch = _make_batch(SCENARIOS[scenario], gen)
    ns, R = len(widths), batch.max_rank
    x = _randn(batch.num_tokens, IN_DIM, gen=gen).to(dtype)
    a = _randn(NUM_SLOTS, ns * R, IN_DIM, gen=gen, scale=IN_DIM ** -0.5).to(dtype)   # random past each rank too
    stale = torch.full((batch.num_tokens, ns * R), float("nan"), dtype=dtype, device=DEVICE)

    xa = lora_shrink(x, a, *batch.device_metadata(), ns, batch.num_segments, batch.max_seg_len, out=stale)

    expected = _per_token_xa(x, a, batch, ns)
    assert xa is stale
    _assert_close(xa, expected, dtype)
    assert (xa[expected == 0] == 0).all(), "base-only rows and columns past the rank must be exact zeros"


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("scenario", ["decode-distinct-ranks4+16", "decode-graph-padded", "prefill-zipf-ranks4+16",
                                      "prefill-uniform-R128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_shrink_over_a_share_of_the_rank_rows_stops_at_the_share(dtype, scenario, split_k):
    """A fully sharded rank's lora_A holds R / 2 rows a slice (layers/linear.py) while the slots' ranks go up to R:
    the shrink computes each slot's first min(rank, R / 2) rows of the share and writes zeros past them; the
    reference module agrees. (The kernel also clamps the rank it loads rows for to the share, so that it never reads
    past the region; the stores are masked to the share either way, so this test cannot see those loads.)"""
    gen = torch.Generator().manual_seed(9)
    batch = _make_batch(SCENARIOS[scenario], gen)
    ns, share = 3, batch.max_rank // 2
    x = _randn(batch.num_tokens, IN_DIM, gen=gen).to(dtype)
    a = _randn(NUM_SLOTS, ns * share, IN_DIM, gen=gen, scale=IN_DIM ** -0.5).to(dtype)
    indptr, weights, ranks = batch.device_metadata()

    xa = lora_shrink(x, a, indptr, weights, ranks, ns, batch.num_segments, max(batch.max_seg_len, 2 * (split_k > 1)),
                     split_k=split_k)
    xa = xa.sum(0) if split_k > 1 else xa

    within = Batch(batch.seg_indptr, batch.slots, [min(r, share) for r in batch.slot_ranks], share,
                   batch.num_segments, batch.max_seg_len, batch.num_tokens)
    expected = _per_token_xa(x, a, within, ns)
    rows = [t for t, w in enumerate(batch.token_lora_slots()) if w is not None]
    assert max(batch.slot_ranks) > share
    _assert_close(xa[rows], expected[rows], dtype if split_k == 1 else torch.float32)
    assert (xa[rows][expected[rows] == 0] == 0).all()
    ref = reference.lora_shrink(x.float().cpu(), a.float().cpu(), batch.seg_indptr, batch.slots, batch.slot_ranks, ns)
    _assert_close(ref[rows].to(DEVICE), expected[rows], torch.float32)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("widths", SLICE_WIDTHS.values(), ids=SLICE_WIDTHS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_matches_per_token_reference(dtype, widths, scenario):
    gen = torch.Generator().manual_seed(2)
    batch = _make_batch(SCENARIOS[scenario], gen)
    y0, xa, b, scalings = _expand_inputs(batch, widths, gen)
    y0, xa, b = y0.to(dtype), xa.to(dtype), b.to(dtype)
    offsets = _offsets(widths)
    y = y0.clone()

    lora_expand(y, xa, b, *batch.device_metadata(), scalings, offsets, batch.num_segments, batch.max_seg_len)

    _assert_close(y, _per_token_y(y0, xa, b, scalings, batch, offsets), dtype)
    untouched = [t for t, w in enumerate(batch.token_lora_slots()) if w is None or w < 0]
    assert torch.equal(y[untouched], y0[untouched]), "base-only rows and rows in no segment must be untouched"


@dataclass
class QKVProblem:
    """One qkv projection's LoRA inputs for a scenario: the kernels' operands in `dtype`."""
    batch: Batch
    ns: int                       # slices
    offsets: list[int]
    x: torch.Tensor               # [tokens, IN_DIM]
    a: torch.Tensor               # [NUM_SLOTS, ns * R, IN_DIM]
    y0: torch.Tensor              # [tokens, out]
    b: torch.Tensor               # [NUM_SLOTS, out, R]
    scalings: torch.Tensor


def _qkv_problem(scenario: str, dtype: torch.dtype, seed: int) -> QKVProblem:
    gen = torch.Generator().manual_seed(seed)
    batch = _make_batch(SCENARIOS[scenario], gen)
    widths = SLICE_WIDTHS["qkv"]
    ns, R = len(widths), batch.max_rank
    x = _randn(batch.num_tokens, IN_DIM, gen=gen).to(dtype)
    a = _randn(NUM_SLOTS, ns * R, IN_DIM, gen=gen, scale=IN_DIM ** -0.5).to(dtype)
    y0, _, b, scalings = _expand_inputs(batch, widths, gen)
    return QKVProblem(batch, ns, _offsets(widths), x, a, y0.to(dtype), b.to(dtype), scalings)


def _assert_delta_matches_reference(y: torch.Tensor, p: QKVProblem, dtype: torch.dtype) -> torch.Tensor:
    """y (the kernels' y0 + delta) against worker/kernels/reference.py in float32; returns the reference xa.
    xa is rounded to dtype before the expand: the tolerance allows that rounding on top of the output's own."""
    expected = p.y0.float()
    host = (p.batch.seg_indptr, p.batch.slots, p.batch.slot_ranks)
    xa_ref = reference.lora_shrink(p.x.float(), p.a.float(), *host, p.ns)
    reference.lora_expand(expected, xa_ref, p.b.float(), *host, p.scalings, p.offsets)
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    return xa_ref


@pytest.mark.parametrize("scenario", ["decode-distinct-ranks4+16", "decode-graph-padded", "decode-zipf-R128",
                                      "prefill-zipf-ranks4+16"])
@pytest.mark.parametrize("widths", SLICE_WIDTHS.values(), ids=SLICE_WIDTHS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_expand_write_mode_writes_the_delta_alone(dtype, widths, scenario):
    """accumulate=False (the deferred delta of layers/linear.py, float32 y): y = the delta whatever y held,
    exact zeros on base-only rows; rows in no segment are not written."""
    gen = torch.Generator().manual_seed(4)
    batch = _make_batch(SCENARIOS[scenario], gen)
    _, xa, b, scalings = _expand_inputs(batch, widths, gen)
    xa, b = xa.to(dtype), b.to(dtype)
    offsets = _offsets(widths)
    y = torch.full((batch.num_tokens, sum(widths)), float("nan"), device=DEVICE)

    lora_expand(y, xa, b, *batch.device_metadata(), scalings, offsets, batch.num_segments, batch.max_seg_len,
                accumulate=False)

    expected = _per_token_y(torch.zeros_like(y), xa, b, scalings, batch, offsets)
    slots = batch.token_lora_slots()
    expected[[t for t, w in enumerate(slots) if w is None]] = float("nan")
    _assert_close(y, expected, torch.float32)
    base_only = [t for t, w in enumerate(slots) if w is not None and w < 0]
    assert (y[base_only] == 0).all()


@pytest.mark.parametrize("widths", SLICE_WIDTHS.values(), ids=SLICE_WIDTHS.keys())
def test_expand_reads_slice_offsets_from_device_tensor_like_tuple(widths):
    gen = torch.Generator().manual_seed(3)
    batch = _make_batch(SCENARIOS["prefill-zipf-ranks4+16"], gen)
    y0, xa, b, scalings = _expand_inputs(batch, widths, gen)
    y0, xa, b = y0.half(), xa.half(), b.half()
    offsets = _offsets(widths)
    y_tuple, y_tensor = y0.clone(), y0.clone()
    meta = batch.device_metadata()

    lora_expand(y_tuple, xa, b, *meta, scalings, tuple(offsets), batch.num_segments, batch.max_seg_len)
    lora_expand(y_tensor, xa, b, *meta, scalings, torch.tensor(offsets, dtype=torch.int32, device=DEVICE),
                batch.num_segments, batch.max_seg_len)

    assert torch.equal(y_tensor, y_tuple)


@pytest.mark.parametrize("scenario", ["decode-distinct-ranks4+16", "decode-graph-padded",
                                      "decode-merged-uniform-ranks4+16", "prefill-zipf-ranks4+16",
                                      "prefill-uniform-R128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_then_expand_match_reference_module(dtype, scenario):
    """The kernels and worker/kernels/reference.py (run in float32) agree on the whole LoRA delta."""
    p = _qkv_problem(scenario, dtype, seed=4)
    batch, meta, y = p.batch, p.batch.device_metadata(), p.y0.clone()

    xa = lora_shrink(p.x, p.a, *meta, p.ns, batch.num_segments, batch.max_seg_len)
    lora_expand(y, xa, p.b, *meta, p.scalings, p.offsets, batch.num_segments, batch.max_seg_len)

    _assert_delta_matches_reference(y, p, dtype)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("tile_map", [False, True], ids=["searched-tiles", "host-tile-map"])
@pytest.mark.parametrize("scenario", ["decode-merged-uniform-ranks4+16", "mixed-graph-padded", "mixed-70-segments",
                                      "prefill-uniform-R128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_and_host_tile_map_give_the_reference_result(dtype, scenario, tile_map, split_k):
    """Shrink partial sums over split_k ranges of K (float32, added up by the expand) and row tiles read from
    the host's map (tiles.host_tile_map, the decode graphs' grouped rows) give the reference's delta."""
    from worker.kernels.row_tiles_host import host_tile_map, max_tiles
    p = _qkv_problem(scenario, dtype, seed=6)
    batch, meta, y = p.batch, p.batch.device_metadata(), p.y0.clone()
    max_seg_len = max(batch.max_seg_len, 2)
    shrink_cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
    expand_cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_R=16, BLOCK_R_HIGH=32, num_warps=4, num_stages=1)
    tiles = None
    if tile_map:
        num_tiles = max_tiles(batch.num_tokens, batch.num_segments, 16)
        tiles = torch.tensor(host_tile_map(batch.seg_indptr, 16, num_tiles), dtype=torch.int32, device=DEVICE)

    xa = lora_shrink(p.x, p.a, *meta, p.ns, batch.num_segments, max_seg_len, config=shrink_cfg, split_k=split_k,
                     tile_map=tiles)
    lora_expand(y, xa, p.b, *meta, p.scalings, p.offsets, batch.num_segments, max_seg_len, config=expand_cfg,
                tile_map=tiles)

    xa_ref = _assert_delta_matches_reference(y, p, dtype)
    if split_k > 1:
        assert xa.shape == (split_k, batch.num_tokens, p.ns * batch.max_rank) and xa.dtype == torch.float32
        rows = [t for lo, hi in zip(batch.seg_indptr, batch.seg_indptr[1:]) for t in range(lo, hi)]
        _assert_close(xa.sum(0)[rows], xa_ref[rows], torch.float32 if dtype == torch.float32 else torch.float16)


CONFIGS = [(dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=32, num_warps=4, num_stages=1),
            dict(BLOCK_M=1, BLOCK_N=32, BLOCK_R=16, BLOCK_R_HIGH=16, num_warps=4, num_stages=1)),
           (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2),
            dict(BLOCK_M=16, BLOCK_N=16, BLOCK_R=16, BLOCK_R_HIGH=32, num_warps=4, num_stages=2)),
           (dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=8, num_stages=3),
            dict(BLOCK_M=32, BLOCK_N=64, BLOCK_R=16, BLOCK_R_HIGH=64, num_warps=8, num_stages=2))]


@pytest.mark.parametrize("configs", CONFIGS, ids=["gemv", "tiles-16", "tiles-32"])
@pytest.mark.parametrize("scenario", ["decode-zipf-R128", "prefill-zipf-ranks4+16"])
def test_any_launch_config_gives_the_reference_result(scenario, configs):
    """A config passed in (what the LoRA benches sweep) changes only how rows, ranks and K are tiled."""
    gen = torch.Generator().manual_seed(5)
    batch = _make_batch(SCENARIOS[scenario], gen)
    widths = SLICE_WIDTHS["qkv"]
    ns, R, offsets = len(widths), batch.max_rank, _offsets(widths)
    x = _randn(batch.num_tokens, IN_DIM, gen=gen)
    a = _randn(NUM_SLOTS, ns * R, IN_DIM, gen=gen, scale=IN_DIM ** -0.5)
    y0, _, b, scalings = _expand_inputs(batch, widths, gen)
    y = y0.clone()
    meta = batch.device_metadata()

    xa = lora_shrink(x, a, *meta, ns, batch.num_segments, batch.max_seg_len, config=configs[0])
    lora_expand(y, xa, b, *meta, scalings, offsets, batch.num_segments, batch.max_seg_len, config=configs[1])

    expected_xa = _per_token_xa(x, a, batch, ns)
    _assert_close(xa, expected_xa, torch.float32)
    _assert_close(y, _per_token_y(y0, expected_xa, b, scalings, batch, offsets), torch.float32)


QKV_8B, GATE_UP_8B, DOWN_8B = (4096, 1024, 1024), (14336, 14336), (4096,)
RANKS_8_TO_128 = (8, 16, 32, 64, 128)
# name: (in_dim, slice widths, scenario); R = 128, slot ranks cycle over 8..128
GPU_CASES = {
    "qkv-decode-1": (4096, QKV_8B, Scenario((1,), (), "distinct", RANKS_8_TO_128, 128, num_slots=1)),
    "qkv-decode-32-distinct": (4096, QKV_8B, Scenario((1,) * 32, (5,), "distinct", RANKS_8_TO_128, 128,
                                                      num_slots=32)),
    "gate_up-decode-64-zipf": (4096, GATE_UP_8B, Scenario((1,) * 64, (0, 9), "zipf", RANKS_8_TO_128, 128,
                                                          num_slots=32)),
    "qkv-prefill-512": (4096, QKV_8B, Scenario((512,), (), "identical", (64,), 128, num_slots=4)),
    "down-mixed-prefill-decode": (14336, DOWN_8B, Scenario((300, 1, 1, 1, 150, 1, 37, 1), (2,), "uniform",
                                                           RANKS_8_TO_128, 128, num_slots=8)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernels_match_reference_at_model_shapes(dtype, case):
    in_dim, widths, sc = GPU_CASES[case]
    gen = torch.Generator().manual_seed(5)
    batch = _make_batch(sc, gen)
    ns, R, offsets = len(widths), batch.max_rank, _offsets(widths)
    x = _randn(batch.num_tokens, in_dim, gen=gen).to(dtype)
    a = _randn(sc.num_slots, ns * R, in_dim, gen=gen, scale=in_dim ** -0.5).to(dtype)
    y0, _, b, scalings = _expand_inputs(batch, widths, gen)
    y0, b = y0.to(dtype), b.to(dtype)
    meta, host = batch.device_metadata(), (batch.seg_indptr, batch.slots, batch.slot_ranks)

    xa = lora_shrink(x, a, *meta, ns, batch.num_segments, batch.max_seg_len)
    y = y0.clone()
    lora_expand(y, xa, b, *meta, scalings, offsets, batch.num_segments, batch.max_seg_len)

    _assert_close(xa, reference.lora_shrink(x.float(), a.float(), *host, ns), dtype)
    expected = y0.float()
    reference.lora_expand(expected, xa.float(), b.float(), *host, scalings, offsets)
    _assert_close(y, expected, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_kernels_replay_in_cuda_graph_with_new_metadata_without_syncs():
    """A decode bucket of 16 captured once; replays with other segments/adapters match eager launches."""
    in_dim, widths, bucket, R = 4096, QKV_8B, 16, 64
    ns, offsets, gen = len(widths), _offsets(widths), torch.Generator().manual_seed(6)
    x = _randn(bucket, in_dim, gen=gen).bfloat16()
    a = _randn(NUM_SLOTS, ns * R, in_dim, gen=gen, scale=in_dim ** -0.5).bfloat16()
    b = _randn(NUM_SLOTS, sum(widths), R, gen=gen, scale=R ** -0.5).bfloat16()
    y0 = _randn(bucket, sum(widths), gen=gen).bfloat16()
    scalings = (torch.rand(NUM_SLOTS, ns, generator=gen) + 0.5).to(DEVICE)
    static = {"indptr": torch.zeros(bucket + 1, dtype=torch.int32, device=DEVICE),
              "weights": torch.zeros(bucket, dtype=torch.int32, device=DEVICE),
              "xa": torch.empty(bucket, ns * R, dtype=x.dtype, device=DEVICE), "y": y0.clone()}
    ranks = torch.tensor([(8, 64)[i % 2] for i in range(NUM_SLOTS)], dtype=torch.int32, device=DEVICE)

    def step() -> None:
        lora_shrink(x, a, static["indptr"], static["weights"], ranks, ns, bucket, 1, out=static["xa"])
        lora_expand(static["y"], static["xa"], b, static["indptr"], static["weights"], ranks, scalings,
                    offsets, bucket, 1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                   # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for sc in (Scenario((1,) * 16, (3,), "zipf", (8, 64), R),
               Scenario((1,) * 10, (0,), "uniform", (8, 64), R, pad_segments=6, pad_tokens=6)):
        batch = _make_batch(sc, gen)
        indptr, weights, _ = batch.device_metadata()
        eager_y = y0.clone()
        torch.cuda.set_sync_debug_mode("error")
        try:
            static["indptr"].copy_(indptr)
            static["weights"].copy_(weights)
            static["y"].copy_(y0)
            graph.replay()
            xa = lora_shrink(x, a, indptr, weights, ranks, ns, bucket, 1)
            lora_expand(eager_y, xa, b, indptr, weights, ranks, scalings, offsets, bucket, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(static["y"], eager_y)
        real = batch.seg_indptr[-1]
        assert torch.equal(static["y"][real:], y0[real:]), "padding rows must be untouched"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_slot_offsets_past_two_to_the_31_elements():
    """A MoE adapter slot holds ~1.7 GB (Qwen3-30B-A3B experts at rank 16): the offset of slot w, w * (slot
    stride in elements), passes 2**31 from the third slot. Slots of 4.5 GB: the last slot's weights and
    scalings lie past 2**31 float32 elements from the pool's start."""
    num_slots, slot_bytes, out_dim, rank, tokens = 3, 4_500_000_000 // 256 * 256, 256, 16, 4
    slots = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device="cuda")
    b_bytes = out_dim * rank * 2
    b = slots[:, :b_bytes].view(torch.bfloat16).unflatten(1, (out_dim, rank))          # [S, out, R]
    scalings = slots[:, slot_bytes - 256:slot_bytes - 252].view(torch.float32)         # [S, 1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for w in range(num_slots):
        b[w].copy_(torch.randn(out_dim, rank, generator=gen, device="cuda"))
        scalings[w] = 0.5 + w
    xa = torch.randn(tokens, rank, generator=gen, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(tokens, out_dim, dtype=torch.bfloat16, device="cuda")
    seg = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    last = torch.tensor([num_slots - 1], dtype=torch.int32, device="cuda")
    ranks = torch.full((num_slots,), rank, dtype=torch.int32, device="cuda")
    lora_expand(y, xa, b, seg, last, ranks, scalings, (0, out_dim), 1, tokens)
    expected = reference.linear(xa.float(), b[num_slots - 1].float()) * (0.5 + num_slots - 1)
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)
