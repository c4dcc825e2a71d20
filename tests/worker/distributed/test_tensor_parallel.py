"""Tensor parallelism at the model level, on the CPU over gloo: the tiny Llama-family models sharded over 2 ranks
(spawned with torch.multiprocessing, MASTER_ADDR=127.0.0.1) give the logits of the unsharded model within the fp32
summation-order bound of tests/fp32_bounds.py (2.9e-4 of the largest logit; both sides at one thread), prefill and
decode, for the base model and for a batch mixing base rows with adapters of different ranks and targets (attention
and MLP); 4 ranks over 2 KV heads replicate each head; dummy weights are the same model at every size."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.fp32_bounds import assert_logits_close, forward_rtol, logits_bound
from tests.hf_fixtures import ADAPTERS, adapter_dir
from tests.worker.distributed.tp_ranks import (NUM_DECODE, Case, build_model, free_port, model_logits, one_thread,
                                               run_rank)
from worker.arch import ArchConfig
from worker.distributed.tensor_parallel import TensorParallel

# base rows between adapter rows; adapter i is slot i (r4-qv, r8-all, r16-mlp-rs)
MIXED_ROWS = ((9, None), (17, 0), (5, 1), (12, None), (20, 2), (7, 1), (3, None))
BASE_ROWS = ((9, None), (17, None), (5, None))


def tp_logits(case: Case, world_size: int, tmp_path) -> list[torch.Tensor]:
    """Each rank's logits, the model sharded over `world_size` ranks."""
    mp.spawn(run_rank, args=(world_size, free_port(), case, str(tmp_path)), nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def case_rtol(case: Case) -> float:
    """The summation-order bound (tests/fp32_bounds.py) of the case's model over its longest sequence."""
    return forward_rtol(ArchConfig.from_dir(case.model_dir), max(n for n, _ in case.rows) + NUM_DECODE)


def assert_matches_tp1(case: Case, world_size: int, tmp_path) -> None:
    """Every rank's logits within the bound of the TP=1 logits, which run at one thread as the ranks do."""
    with one_thread():
        expected = model_logits(case)
    for rank, logits in enumerate(tp_logits(case, world_size, tmp_path)):
        assert_logits_close(logits, expected, case_rtol(case), f"rank {rank}: TP={world_size} logits vs TP=1")


def adapters_of(model_dir) -> tuple[tuple[str, str], ...]:
    return tuple((a.name, str(adapter_dir(model_dir, a.name))) for a in ADAPTERS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_logits_equal_tp1_for_a_batch_mixing_base_rows_and_adapters(hf_models, arch, tmp_path):
    """llama: llama3 rope; qwen2: qkv bias, tied embeddings; qwen3: q/k norms. Adapters: q/v only, every
    projection with per-module ranks and alphas, and k/o/MLP with rsLoRA."""
    model_dir = hf_models[arch]
    assert_matches_tp1(Case(str(model_dir), "auto", adapters_of(model_dir), MIXED_ROWS), 2, tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fully_sharded_lora_logits_equal_tp1(hf_models, arch, world_size, tmp_path):
    """--fully-sharded-loras: lora_A of qkv/gate_up cut by rank (at 4 ranks of max rank 16 each holds 4 rows: the
    rank-4 adapter's lie on rank 0 alone, the others' are zeros) and lora_B of o/down by output, with the gather and
    the all-reduce of xa between shrink and expand; the same logits as the unsharded model."""
    model_dir = hf_models[arch]
    case = Case(str(model_dir), "auto", adapters_of(model_dir), MIXED_ROWS, fully_sharded=True)
    assert_matches_tp1(case, world_size, tmp_path)


def test_fully_sharded_lora_holds_a_smaller_share_of_each_adapter(hf_models):
    """Rank 1 of 2, max rank 16: qkv's lora_A keeps rows [8, 16) of each slice (a rank-16 k_proj's second half; a
    rank-8 q_proj's zero padding), o's lora_B its share of the output rows; the default scheme keeps both whole."""
    from worker.lora.adapter import read_adapter
    model_dir = hf_models["llama"]
    tp = TensorParallel(rank=1, world_size=2)
    default = build_model(Case(str(model_dir), "auto", (), ()), tp)
    full = build_model(Case(str(model_dir), "auto", (), (), fully_sharded=True), tp)

    def factors(adapter: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        targets = default.lora_targets(default.cfg)
        found = read_adapter(*adapters_of(model_dir)[adapter], targets, 16, torch.float32).modules[(0, target)]
        return (found.a.view(torch.float32).view(found.rank, found.in_features),
                found.b.view(torch.float32).view(found.out_features, found.rank))

    k_a, k_b = factors(2, "k_proj")            # r16-mlp-rs
    q_a, q_b = factors(1, "q_proj")            # r8-all
    assert k_a.shape[0] == 16 and q_a.shape[0] == 8
    a, _ = full.projection(0, "qkv_proj").shard_lora(1, k_a, k_b)
    assert torch.equal(a, k_a[8:])
    a, _ = full.projection(0, "qkv_proj").shard_lora(0, q_a, q_b)
    assert a.shape == (8, q_a.shape[1]) and not a.any()
    assert torch.equal(default.projection(0, "qkv_proj").shard_lora(1, k_a, k_b)[0], k_a)

    o_a, o_b = factors(2, "o_proj")
    half = o_b.shape[0] // 2
    assert torch.equal(full.projection(0, "o_proj").shard_lora(0, o_a, o_b)[1], o_b[half:])
    assert torch.equal(default.projection(0, "o_proj").shard_lora(0, o_a, o_b)[1], o_b)
    qkv_rows = default.projection(0, "qkv_proj").lora_slot_shape(16)[1]
    assert full.projection(0, "qkv_proj").lora_slot_shape(16) == (8, qkv_rows)
    assert full.projection(0, "o_proj").lora_slot_shape(16) == (16, (0, half))
    assert default.projection(0, "o_proj").lora_slot_shape(16) == (16, (0, 2 * half))


def test_fully_sharded_lora_refuses_a_rank_the_ranks_do_not_divide(hf_models):
    from worker.lora.shards import shard_loras_fully
    model = build_model(Case(str(hf_models["llama"]), "auto", (), ()), TensorParallel(rank=0, world_size=4))
    with pytest.raises(ValueError, match=r"max_lora_rank with fully sharded LoRA \(6\) must be divisible by tensor parallel size \(4\)"):
        shard_loras_fully(model, 6)


def test_tp2_logits_equal_tp1_for_the_base_model(hf_models, tmp_path):
    assert_matches_tp1(Case(str(hf_models["llama"]), "auto", (), BASE_ROWS), 2, tmp_path)


def test_tp4_replicates_kv_heads_and_matches_tp1(hf_models, tmp_path):
    """2 KV heads over 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1; vocab 320 in slices of 80."""
    model_dir = hf_models["llama"]
    assert_matches_tp1(Case(str(model_dir), "auto", adapters_of(model_dir), MIXED_ROWS[:4]), 4, tmp_path)


def test_dummy_weights_are_the_same_model_at_every_tp_size(hf_models, tmp_path):
    assert_matches_tp1(Case(str(hf_models["qwen3"]), "dummy", (), BASE_ROWS), 2, tmp_path)


def test_adapters_change_the_logits(hf_models):
    """Guards the comparisons above: the adapter rows would pass them with LoRA dropped on both sides. Each adapter
    moves its rows by over 100 times the bound (a tenth of one LoRA lost on a rank is caught); base rows stay under
    that."""
    model_dir = hf_models["llama"]
    case = Case(str(model_dir), "auto", adapters_of(model_dir), MIXED_ROWS)
    with_lora = model_logits(case)
    base = model_logits(Case(str(model_dir), "auto", (), tuple((n, None) for n, _ in MIXED_ROWS)))
    bound, rows = logits_bound(base, case_rtol(case)), len(MIXED_ROWS)
    for step in range(2):
        for i, (_, adapter) in enumerate(MIXED_ROWS):
            diff = (with_lora[step * rows + i] - base[step * rows + i]).abs().max().item()
            assert (diff > 100 * bound) == (adapter is not None), f"row {i}, step {step}: {diff:.2e}"


def test_each_rank_loads_its_share_of_the_checkpoint(hf_models):
    """Rank 2 of 4 (no collective is needed to build and load): heads 2 of 4, KV head 1 of 2, intermediate columns
    [56, 84) of 112, vocab rows [160, 240) of 320, read from the checkpoint's tensors."""
    from safetensors.torch import load_file
    model_dir = hf_models["llama"]
    whole = {k.removeprefix("model."): v for k, v in load_file(model_dir / "model.safetensors").items()}
    model = build_model(Case(str(model_dir), "auto", (), ()), TensorParallel(rank=2, world_size=4))
    attn, mlp, d = model.layers[1].self_attn, model.layers[1].mlp, model.cfg.head_dim
    assert (attn.num_heads, attn.num_kv_heads, model.num_kv_heads) == (1, 1, 1)
    q, k, v = attn.qkv_proj.weight.split([d, d, d])
    assert torch.equal(q, whole["layers.1.self_attn.q_proj.weight"][2 * d:3 * d])
    assert torch.equal(k, whole["layers.1.self_attn.k_proj.weight"][d:2 * d])
    assert torch.equal(v, whole["layers.1.self_attn.v_proj.weight"][d:2 * d])
    assert torch.equal(attn.o_proj.weight, whole["layers.1.self_attn.o_proj.weight"][:, 2 * d:3 * d])
    gate, up = mlp.gate_up_proj.weight.split([28, 28])
    assert torch.equal(gate, whole["layers.1.mlp.gate_proj.weight"][56:84])
    assert torch.equal(up, whole["layers.1.mlp.up_proj.weight"][56:84])
    assert torch.equal(mlp.down_proj.weight, whole["layers.1.mlp.down_proj.weight"][:, 56:84])
    assert torch.equal(model.embed_tokens.weight, whole["embed_tokens.weight"][160:240])
    assert torch.equal(model.lm_head.weight, whole["lm_head.weight"][160:240])


def test_vocab_not_divisible_by_the_ranks_is_padded_on_the_last_rank():
    from worker.layers.embedding import Embedding
    emb = Embedding(10, 4, torch.float32, TensorParallel(rank=3, world_size=4))
    whole = torch.arange(40, dtype=torch.float32).view(10, 4)
    emb.load_shard("weight", None, whole)
    assert emb.vocab_start == 9 and emb.weight.shape == (3, 4)
    assert torch.equal(emb.weight, torch.cat([whole[9:], torch.zeros(2, 4)]))


def test_heads_not_divisible_by_the_ranks_are_refused(hf_models):
    with pytest.raises(ValueError, match=r"Total number of attention heads \(4\) must be divisible by tensor "
                                         r"parallel size \(3\)"):
        build_model(Case(str(hf_models["llama"]), "auto", (), ()), TensorParallel(rank=0, world_size=3))


def test_tp2_row_parallel_biases_are_added_once(tmp_path):
    """Llama with attention and MLP biases (o_proj and down_proj biases added on rank 0 only), tied embeddings,
    8 heads over 2 KV heads."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.1, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "biased")
    (tmp_path / "ranks").mkdir()
    assert_matches_tp1(Case(str(tmp_path / "biased"), "auto", (), BASE_ROWS), 2, tmp_path / "ranks")
