"""An FP8 KV cache on the GPU: the Triton attention at real head dims in bf16 against the float32 reference of the same
quantized math (tests/worker/kernels/test_attention_fp8.py has the bound), a CUDA-graph replay equal to eager, no
host syncs, and the engine: graphs equal to eager, logits within the E4M3 bound of a bf16 cache, twice the blocks."""
from __future__ import annotations

import gc

import pytest
import torch

from tests.fp32_bounds import assert_same_until_a_tie
from tests.worker.kernels.test_attention_fp8 import K_SCALE, V_SCALE, attention_bound, expected, f32, fp8_batch
from worker.arch import ArchConfig
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.kernels import attention, fused, reference

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
E4M3_UNIT_ROUNDOFF = 2.0 ** -4


def run(batch, **kwargs) -> torch.Tensor:
    return batch.run(k_scale=f32(K_SCALE), v_scale=f32(V_SCALE), **kwargs).float().cpu()


def assert_within(actual: torch.Tensor, wanted: torch.Tensor, bound: float) -> None:
    err = (actual - wanted).abs().max().item()
    assert err <= bound, f"differs by {err:.3e}, over the bound {bound:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seqs", [
    [(4095 - 7 * i, 1) for i in range(8)],                              # decode, split over the keys
    [(0, 1000), (0, 17)],                                               # prefill
    [(0, 700), (1500, 300)] + [(3000 - 97 * i, 1) for i in range(24)],  # prefill, extend and decodes in one batch
], ids=["decode", "prefill", "mixed"])
def test_attention_over_an_fp8_cache_at_head_dim_128_matches_the_float32_reference(dtype, seqs):
    batch = fp8_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)
    assert_within(run(batch), expected(batch), attention_bound(batch, dtype))


def test_decode_over_an_fp8_cache_with_every_split_count_matches_the_reference():
    batch = fp8_batch([(2047 - 13 * i, 1) for i in range(4)], num_heads=32, num_kv_heads=8, head_dim=128,
                      block_size=16, dtype=torch.bfloat16)
    for splits in (1, 2, 16):
        assert_within(run(batch, num_kv_splits=splits), expected(batch), attention_bound(batch, torch.bfloat16))


def test_the_gpu_writes_the_reference_fp8_bytes():
    """CUDA's float8 cast turns values past 448 into NaN: the writers clamp first, as reference.store_kv does."""
    gen = torch.Generator().manual_seed(2)
    k = (torch.randn(64, 8, 128, generator=gen) * 200 * K_SCALE).to(torch.bfloat16)
    v = (torch.randn(64, 8, 128, generator=gen) * 200 * V_SCALE).to(torch.bfloat16)
    slots = torch.randperm(40 * 16, generator=gen)[:64]
    want_k = torch.zeros(40, 16, 8, 128, dtype=reference.KV_FP8_DTYPE)
    want_v = torch.zeros_like(want_k)
    reference.store_kv(k, v, want_k, want_v, slots, f32(K_SCALE), f32(V_SCALE))
    k_cache, v_cache = torch.zeros_like(want_k, device=DEVICE), torch.zeros_like(want_v, device=DEVICE)
    attention.store_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), k_scale=f32(K_SCALE),
                       v_scale=f32(V_SCALE))
    assert torch.equal(k_cache.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), want_v.view(torch.uint8))
    assert not k_cache.float().isnan().any()


class DecodeStep:
    """One layer's decode step over an FP8 pool in persistent buffers: rotary + FP8 K/V write, then attention."""

    def __init__(self, num_seqs: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.num_seqs = num_seqs
        self.qkv = (torch.randn(num_seqs, (32 + 16) * 128, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
        emb = torch.outer(torch.arange(4096).float(), 1e-4 ** (torch.arange(0, 128, 2).float() / 128)).repeat(1, 2)
        self.cos, self.sin = emb.cos().to(torch.bfloat16).to(DEVICE), emb.sin().to(torch.bfloat16).to(DEVICE)
        self.k_cache = torch.zeros(2048, 16, 8, 128, dtype=reference.KV_FP8_DTYPE, device=DEVICE)
        self.k_cache.copy_((torch.randn(self.k_cache.shape, generator=gen) * 30).to(reference.KV_FP8_DTYPE))
        self.v_cache = (torch.randn(self.k_cache.shape, generator=gen) * 30).to(reference.KV_FP8_DTYPE).to(DEVICE)
        self.block_tables = torch.randperm(2048, generator=gen)[:num_seqs * 128].view(num_seqs, 128).int().to(DEVICE)
        self.seq_lens = torch.randint(1, 2048, (num_seqs,), generator=gen).int().to(DEVICE)
        self.positions = (self.seq_lens - 1).long()
        slot_block = self.block_tables.gather(1, (self.positions // 16)[:, None].to(torch.int64))[:, 0]
        self.slots = (slot_block.long() * 16 + self.positions % 16)
        self.query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
        self.out = torch.empty(num_seqs, 32, 128, dtype=torch.bfloat16, device=DEVICE)

    def __call__(self) -> None:
        q = self.qkv[:, :32 * 128].view(-1, 32, 128)
        k = self.qkv[:, 32 * 128:40 * 128].view(-1, 8, 128)
        v = self.qkv[:, 40 * 128:].view(-1, 8, 128)
        fused.rotary_store_kv(self.positions, q, k, v, self.cos, self.sin, self.k_cache, self.v_cache, self.slots,
                              k_scale=f32(K_SCALE), v_scale=f32(V_SCALE))
        attention.paged_attention(q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                                  self.seq_lens, 128 ** -0.5, self.num_seqs, 1, out=self.out,
                                  k_scale=f32(K_SCALE), v_scale=f32(V_SCALE))

    def state(self) -> list[torch.Tensor]:
        return [self.qkv, self.k_cache, self.v_cache, self.out]


def test_an_fp8_decode_step_replays_from_a_cuda_graph_as_it_runs_eagerly():
    eager, graphed = DecodeStep(16, seed=5), DecodeStep(16, seed=5)
    eager()
    graphed()                                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed()
    for _ in range(3):                                          # K/V appended on top of what the last step wrote
        eager()
        graph.replay()
        for a, b in zip(eager.state(), graphed.state()):
            assert torch.equal(a.view(torch.uint8) if a.dtype == reference.KV_FP8_DTYPE else a,
                               b.view(torch.uint8) if b.dtype == reference.KV_FP8_DTYPE else b)


def test_an_fp8_decode_step_never_syncs_with_the_host():
    step = DecodeStep(8, seed=6)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def make_engine(model_dir, kv_cache_dtype: str, enforce_eager: bool = False, **cache) -> Engine:
    cache = CacheConfig(kv_cache_dtype=kv_cache_dtype, **({"num_gpu_blocks_override": 512} | cache))
    return Engine(WorkerConfig(ModelConfig(str(model_dir), dtype="bfloat16"), cache=cache,
                               scheduler=SchedulerConfig(max_num_seqs=16), device="cuda", enforce_eager=enforce_eager))


def greedy(engine: Engine, prompts: list[list[int]], steps: int = 24) -> tuple[dict, dict]:
    logits: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def capture(batch, prev=None):
        out = execute(batch, prev)
        for seq, row in zip((s for s in batch.seqs if s.samples), out.logits):
            logits.setdefault(seq.request.request_id, []).append(row.float().cpu())
        return out

    engine.runner.execute = capture
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, {r: torch.stack(rows) for r, rows in logits.items()}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n in (7, 23, 5, 40, 11)]


def test_fp8_engine_graphs_give_the_eager_tokens(hf_models):
    eager, _ = greedy(make_engine(hf_models["llama"], "fp8", enforce_eager=True), prompts())
    engine = make_engine(hf_models["llama"], "fp8")
    graphs, _ = greedy(engine, prompts())
    assert eager == graphs
    assert engine.runner.graph_runner.replays["decode"] > 0


def test_fp8_engine_logits_stay_within_the_e4m3_bound_of_a_bf16_cache(hf_models):
    """tests/worker/test_kv_cache_fp8.py states the bound (2 · num_layers · 2^-4 of the largest logit); bf16 adds
    nothing comparable to it."""
    fp8_tokens, fp8_logits = greedy(make_engine(hf_models["llama"], "fp8"), prompts())
    bf16_tokens, bf16_logits = greedy(make_engine(hf_models["llama"], "auto"), prompts())
    rtol = 2 * ArchConfig.from_dir(hf_models["llama"]).num_layers * E4M3_UNIT_ROUNDOFF
    for r in bf16_tokens:
        assert_same_until_a_tie(fp8_tokens[r], bf16_tokens[r], bf16_logits[r], fp8_logits[r], rtol, r)


def test_the_memory_plan_gives_an_fp8_cache_about_twice_the_blocks(hf_models):
    """The same budget, K/V counted at one byte an element instead of two: twice the blocks, less what the plan's
    profiling steps measure differently (their temporary pools are smaller with FP8, so rather more than less)."""
    blocks = {}
    for dtype in ("auto", "fp8"):
        engine = make_engine(hf_models["llama"], dtype, enforce_eager=True, num_gpu_blocks_override=None,
                             gpu_memory_utilization=0.15)
        blocks[dtype] = engine.num_kv_blocks
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    assert 1.95 <= blocks["fp8"] / blocks["auto"] <= 2.05, blocks
