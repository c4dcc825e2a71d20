"""Tensor parallelism of the MoE models (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert and a dense layer), on
the CPU over gloo: every rank holds every expert, sharded along the expert intermediate size; TP=2 (and TP=4 on
Qwen2-MoE) gives the logits of the unsharded model within the fp32 summation-order bound (tests/fp32_bounds.py: at
most 2.5e-4 of the largest logit; both sides at one thread), prefill and decode, for the base model (per-expert and
fused checkpoints, dummy weights) and for a batch mixing base rows with expert adapters of every format (PEFT
target_parameters with attention, shared-expert and dense-MLP LoRA; per-expert modules, Mixtral's w1/w3/w2 included;
stacked; shared-outer). Each MoE block all-reduces once."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.moe_fixtures import HandExpertAdapter, PeftExpertAdapter, save_hand_expert_adapter, save_peft_expert_adapter
from tests.fp32_bounds import logits_bound
from tests.worker.distributed.test_tensor_parallel import assert_matches_tp1, case_rtol
from tests.worker.distributed.tp_ranks import MAX_RANK, Case, build_model, forward_batch, model_logits
from worker.lora.shards import shard_adapter
from worker.distributed.tensor_parallel import TensorParallel
from worker.lora.adapter import locate_adapter, read_adapter
from worker.lora.gpu_pool import GPULoRAPool
from worker.lora.slot_layout import SlotLayout
from worker.arch import ArchConfig
from worker.models.builder import lora_targets

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
HAND_ADAPTERS = (HandExpertAdapter("per-expert", "per_expert", (3, 5, 2), experts=(0, 2, 3)),
                 HandExpertAdapter("stacked", "stacked", (4, 4, 6)),
                 HandExpertAdapter("shared-outer", "stacked", (6, 6, 4), shared_outer=True))
# adapter i is slot i: 0 peft-attn, 1 peft-r8, 2 per-expert, 3 stacked, 4 shared-outer; base rows between them
MIXED_ROWS = ((9, None), (17, 0), (5, 2), (12, None), (20, 3), (7, 4), (3, None), (11, 1))
BASE_ROWS = ((9, None), (17, None), (5, None))


def peft_adapters(arch: str) -> tuple[PeftExpertAdapter, ...]:
    """Format (a); on Qwen2-MoE gate/up/down_proj also adapt the shared expert (layer 0) and the dense MLP (layer 1)."""
    mlp = ("gate_proj", "up_proj", "down_proj") if arch == "qwen2_moe" else ()
    return (PeftExpertAdapter("peft-attn", 4, alpha=8, modules=("q_proj", "v_proj", *mlp),
                              rank_pattern={"down_proj": 2}),
            PeftExpertAdapter("peft-r8", 8, alpha=16, use_rslora=True, rank_pattern={"gate_up_proj": 6}))


@pytest.fixture(scope="module")
def expert_adapters(hf_moe_models, tmp_path_factory) -> dict[str, tuple[tuple[str, str], ...]]:
    """arch -> ((name, directory) of each expert adapter, in slot order)."""
    out = {}
    for arch in ARCHS:
        model_dir, root = hf_moe_models[arch], tmp_path_factory.mktemp(f"tp-experts-{arch}")
        shape = lora_targets(ArchConfig.from_dir(model_dir)).experts
        sparse = [layer for layer in range(shape.num_layers) if layer not in shape.dense_layers]
        adapters = []
        for i, spec in enumerate(peft_adapters(arch)):
            save_peft_expert_adapter(model_dir, spec, root / spec.name, seed=200 + i)
            adapters.append((spec.name, str(root / spec.name)))
        for i, spec in enumerate(HAND_ADAPTERS):
            save_hand_expert_adapter(spec, sparse, shape, arch == "mixtral", root / spec.name, seed=300 + i)
            adapters.append((spec.name, str(root / spec.name)))
        out[arch] = tuple(adapters)
    return out


def fused_checkpoint(model_dir: Path, out: Path) -> Path:
    """The checkpoint with each layer's experts fused as transformers 5 holds them: gate_up_proj [E, 2I, H] (gate
    rows first), down_proj [E, H, I]."""
    cfg = ArchConfig.from_dir(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    for layer in range(cfg.num_layers):
        block = "block_sparse_moe" if cfg.architecture == "MixtralForCausalLM" else "mlp"
        prefix = f"model.layers.{layer}.{block}.experts."
        names = ("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
        if f"{prefix}0.{names[0]}.weight" not in tensors:
            continue
        gate, up, down = ([tensors.pop(f"{prefix}{e}.{name}.weight") for e in range(cfg.num_experts)]
                          for name in names)
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [torch.stack(gate), torch.stack(up)], dim=1)
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(down)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    shutil.copy(model_dir / "config.json", out / "config.json")
    return out


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["default-lora", "fully-sharded-lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_equal_tp1_for_a_batch_mixing_base_rows_and_expert_adapters(hf_moe_models, expert_adapters, arch,
                                                                               fully_sharded, tmp_path):
    """Every expert LoRA format in one batch with base rows: gate/up B and down A cut to each rank's share of I.
    Fully sharded: the attention's (and Qwen2-MoE's shared expert's) LoRA fully sharded, the experts' as by default."""
    case = Case(str(hf_moe_models[arch]), "auto", expert_adapters[arch], MIXED_ROWS, fully_sharded=fully_sharded)
    assert_matches_tp1(case, 2, tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_equal_tp1_for_the_base_model(hf_moe_models, arch, tmp_path):
    """The per-expert checkpoint transformers saves (Mixtral's w1/w3/w2 names included)."""
    assert_matches_tp1(Case(str(hf_moe_models[arch]), "auto", (), BASE_ROWS), 2, tmp_path)


def test_tp2_loads_the_fused_expert_layout(hf_moe_models, tmp_path):
    fused = fused_checkpoint(hf_moe_models["qwen2_moe"], tmp_path / "fused")
    (tmp_path / "ranks").mkdir()
    assert torch.equal(model_logits(Case(str(fused), "auto", (), BASE_ROWS)),
                       model_logits(Case(str(hf_moe_models["qwen2_moe"]), "auto", (), BASE_ROWS)))
    assert_matches_tp1(Case(str(fused), "auto", (), BASE_ROWS), 2, tmp_path / "ranks")


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_weights_are_the_same_moe_model_at_every_tp_size(hf_moe_models, arch, tmp_path):
    (tmp_path / "model").mkdir()
    shutil.copy(hf_moe_models[arch] / "config.json", tmp_path / "model" / "config.json")
    assert_matches_tp1(Case(str(tmp_path / "model"), "dummy", (), BASE_ROWS), 2, tmp_path)


def test_tp4_qwen2_moe_with_expert_adapters_matches_tp1(hf_moe_models, expert_adapters, tmp_path):
    """Expert intermediate 32 in shares of 8, the shared expert's 48 in 12, the dense layer's 96 in 24; 2 KV heads
    replicated over 4 ranks."""
    case = Case(str(hf_moe_models["qwen2_moe"]), "auto", expert_adapters["qwen2_moe"], MIXED_ROWS[:6])
    assert_matches_tp1(case, 4, tmp_path)


def test_expert_adapters_change_the_logits(hf_moe_models, expert_adapters):
    """Guards the comparisons above: the adapter rows would pass them with LoRA dropped on both sides. Each adapter
    moves its rows by over 100 times the bound (a tenth of one LoRA lost on a rank is caught); base rows stay under
    that."""
    model_dir = hf_moe_models["mixtral"]
    case = Case(str(model_dir), "auto", expert_adapters["mixtral"], MIXED_ROWS)
    with_lora = model_logits(case)
    base = model_logits(Case(str(model_dir), "auto", (), tuple((n, None) for n, _ in MIXED_ROWS)))
    bound, rows = logits_bound(base, case_rtol(case)), len(MIXED_ROWS)
    for step in range(2):
        for i, (_, adapter) in enumerate(MIXED_ROWS):
            diff = (with_lora[step * rows + i] - base[step * rows + i]).abs().max().item()
            assert (diff > 100 * bound) == (adapter is not None), f"row {i}, step {step}: {diff:.2e}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_each_rank_loads_its_share_of_the_experts(hf_moe_models, arch):
    """Rank 1 of 2 (no collective is needed to build and load): gate rows [16, 32) and up rows [16, 32) of each
    expert's [32, 64] gate and up, down columns [16, 32) of its [64, 32]; the router whole."""
    model_dir = hf_moe_models[arch]
    whole = {k.removeprefix("model."): v for k, v in load_file(model_dir / "model.safetensors").items()}
    model = build_model(Case(str(model_dir), "auto", (), ()), TensorParallel(rank=1, world_size=2))
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    gate_name, up_name, down_name = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe = model.moe_block(1)
    assert moe.experts.gate_up_proj.shape == (4, 32, 64) and moe.experts.down_proj.shape == (4, 64, 16)
    assert model.moe_intermediate_size_per_rank == 16
    for e in range(4):
        prefix = f"layers.1.{block}.experts.{e}."
        gate, up = moe.experts.gate_up_proj[e].split([16, 16])
        assert torch.equal(gate, whole[prefix + f"{gate_name}.weight"][16:32])
        assert torch.equal(up, whole[prefix + f"{up_name}.weight"][16:32])
        assert torch.equal(moe.experts.down_proj[e], whole[prefix + f"{down_name}.weight"][:, 16:32])
    assert torch.equal(moe.gate.weight, whole[f"layers.1.{block}.gate.weight"])


def test_qwen2_moe_shards_the_shared_expert_and_keeps_its_gate_whole(hf_moe_models):
    """Rank 1 of 2: shared expert gate/up rows [24, 48) of 48, down columns [24, 48); the dense layer's MLP
    (intermediate 96) rows [48, 96)."""
    model_dir = hf_moe_models["qwen2_moe"]
    whole = {k.removeprefix("model."): v for k, v in load_file(model_dir / "model.safetensors").items()}
    model = build_model(Case(str(model_dir), "auto", (), ()), TensorParallel(rank=1, world_size=2))
    shared = model.moe_block(0).shared_expert
    gate, up = shared.gate_up_proj.weight.split([24, 24])
    assert torch.equal(gate, whole["layers.0.mlp.shared_expert.gate_proj.weight"][24:48])
    assert torch.equal(up, whole["layers.0.mlp.shared_expert.up_proj.weight"][24:48])
    assert torch.equal(shared.down_proj.weight, whole["layers.0.mlp.shared_expert.down_proj.weight"][:, 24:48])
    assert not shared.down_proj.reduce_results
    assert torch.equal(model.moe_block(0).shared_expert_gate.weight, whole["layers.0.mlp.shared_expert_gate.weight"])
    dense = model.layers[1].mlp
    assert torch.equal(dense.down_proj.weight, whole["layers.1.mlp.down_proj.weight"][:, 48:96])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_expert_slot_holds_its_share_of_the_whole_slot(hf_moe_models, expert_adapters, rank):
    """Every expert format, packed for rank `rank` of 2, equals the unsharded slot cut to the rank's share of I:
    gate/up B's rows and down A's columns narrowed, gate/up A, down B, scalings and the shared-outer flag whole."""
    model_dir = hf_moe_models["qwen2_moe"]
    cfg = ArchConfig.from_dir(model_dir)
    whole_model = build_model(Case(str(model_dir), "dummy", (), ()), TensorParallel())
    shard_model = build_model(Case(str(model_dir), "dummy", (), ()), TensorParallel(rank=rank, world_size=2))
    pools = [GPULoRAPool(m, len(expert_adapters["qwen2_moe"]), MAX_RANK, torch.float32, torch.device("cpu"))
             for m in (whole_model, shard_model)]
    for slot, (name, path) in enumerate(expert_adapters["qwen2_moe"]):
        adapter = read_adapter(name, path, lora_targets(cfg), MAX_RANK, torch.float32)
        for pool, model in zip(pools, (whole_model, shard_model)):
            pool.start_load(slot, pool.layout.pack(shard_adapter(model, adapter)), adapter.spec.rank, name)
    whole, shard = pools[0].expert_weights[0], pools[1].expert_weights[0]
    i, start = 16, 16 * rank
    gate_b, up_b = whole.gate_up_b.split([32, 32], dim=2)                      # [S, E, I, R] each
    assert torch.equal(shard.gate_up_b, torch.cat([gate_b[:, :, start:start + i], up_b[:, :, start:start + i]], 2))
    assert torch.equal(shard.down_a, whole.down_a[..., start:start + i])
    for name in ("gate_up_a", "down_b", "scalings", "shared_outer"):
        assert torch.equal(getattr(shard, name), getattr(whole, name)), name
    assert shard.shared_outer.tolist() == [0, 0, 0, 0, 1]
    assert shard.down_a.abs().sum() > 0 and shard.gate_up_b.abs().sum() > 0


def test_an_expert_adapter_read_in_place_into_a_ranks_slot_is_refused(hf_moe_models, expert_adapters):
    """SlotLayout.read_packed reads whole matrices; a rank's smaller expert regions take shard_adapter + pack."""
    model_dir = hf_moe_models["qwen3_moe"]
    model = build_model(Case(str(model_dir), "dummy", (), ()), TensorParallel(rank=0, world_size=2))
    name, path = expert_adapters["qwen3_moe"][3]                              # stacked, experts only
    source = locate_adapter(name, path, lora_targets(ArchConfig.from_dir(model_dir)), MAX_RANK)
    with pytest.raises(ValueError, match="read_adapter, shard_adapter and SlotLayout.pack it"):
        SlotLayout(model, MAX_RANK, torch.float32).read_packed(source)


@dataclass(frozen=True)
class CountingTP(TensorParallel):
    """Rank 0 of a pretend group: records each all-reduce's shape instead of reducing (the values are then wrong,
    the count is what is checked)."""
    reduced: list = field(default_factory=list)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced.append(tuple(x.shape))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.world_size, dim=-1)


@torch.inference_mode()
def test_each_moe_block_all_reduces_once_with_its_shared_expert_and_expert_lora(hf_moe_models, expert_adapters):
    """Qwen2-MoE (layer 0 sparse with a shared expert, layer 1 dense), a batch with expert and shared-expert LoRA:
    the embedding once, then per layer o_proj and the MLP or MoE block once each."""
    model_dir = hf_moe_models["qwen2_moe"]
    cfg = ArchConfig.from_dir(model_dir)
    tp = CountingTP(rank=0, world_size=2)
    model = build_model(Case(str(model_dir), "auto", (), ()), tp)
    pool = GPULoRAPool(model, 1, MAX_RANK, torch.float32, torch.device("cpu"))
    name, path = expert_adapters["qwen2_moe"][0]
    adapter = read_adapter(name, path, lora_targets(cfg), MAX_RANK, torch.float32)
    pool.start_load(0, pool.layout.pack(shard_adapter(model, adapter)), adapter.spec.rank, name)
    shape = (2, 16, model.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    model(forward_batch([([5, 6, 7, 8], 0)], [0], pool.ranks_host), kv)
    assert tp.reduced == [(4, 64)] * (1 + 2 * cfg.num_layers)


def _config_dir(model_dir: Path, out: Path, **changes) -> Path:
    config = json.loads((model_dir / "config.json").read_text()) | changes
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("arch, key", [("qwen3_moe", "moe_intermediate_size"), ("mixtral", "intermediate_size")])
def test_expert_intermediate_size_not_divisible_by_the_ranks_is_refused(hf_moe_models, tmp_path, arch, key):
    model_dir = _config_dir(hf_moe_models[arch], tmp_path / "model", **{key: 30})
    with pytest.raises(ValueError, match=r"MoE intermediate size \(30\) must be divisible by tensor parallel size "
                                         r"\(4\)"):
        build_model(Case(str(model_dir), "dummy", (), ()), TensorParallel(rank=0, world_size=4))


def test_shared_expert_intermediate_size_not_divisible_by_the_ranks_is_refused(hf_moe_models, tmp_path):
    model_dir = _config_dir(hf_moe_models["qwen2_moe"], tmp_path / "model", shared_expert_intermediate_size=42)
    with pytest.raises(ValueError, match=r"Intermediate size \(42\) must be divisible by tensor parallel size \(4\)"):
        build_model(Case(str(model_dir), "dummy", (), ()), TensorParallel(rank=0, world_size=4))


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_heads_not_divisible_by_the_ranks_are_refused(hf_moe_models, arch):
    with pytest.raises(ValueError, match=r"Total number of attention heads \(4\) must be divisible by tensor "
                                         r"parallel size \(3\)"):
        build_model(Case(str(hf_moe_models[arch]), "auto", (), ()), TensorParallel(rank=0, world_size=3))
