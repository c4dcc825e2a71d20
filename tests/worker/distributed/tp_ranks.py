"""What each rank of a tensor-parallel test runs: the tiny model (dense or MoE, the class of its config's
architecture) built as `tp` shards it, its adapters (expert LoRA included) packed into this rank's slots, and prefill
then decode steps through the model's forward, on the CPU.

`run_rank` is spawned once per rank (torch.multiprocessing, gloo over 127.0.0.1); `model_logits` is the same
computation at any world size, so the TP=1 reference is one call in the test process, under `one_thread()` as each
rank runs (another thread count is another summation order).
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from worker.batch import ForwardBatch, LoRABatchInfo
from worker.config import KernelConfig
from worker.lora.shards import shard_adapter, shard_loras_fully
from worker.distributed.tensor_parallel import SINGLE, TensorParallel, init_tensor_parallel
from worker.lora.adapter import read_adapter
from worker.lora.gpu_pool import GPULoRAPool
from worker.models.dummy import init_dummy_weights
from worker.arch import ArchConfig
from worker.models.builder import MODEL_CLASSES, lora_targets, resolve_kernels
from worker.models.weight_loader import load_weights

BLOCK_SIZE = 16
MAX_RANK = 16
NUM_DECODE = 3


@dataclass(frozen=True)
class Case:
    """One model and the rows of its batch: (prompt length, adapter index into `adapters` or None) per row."""
    model_dir: str
    load_format: str                   # "auto" or "dummy"
    adapters: tuple[tuple[str, str], ...]   # (name, directory), loaded into slots 0, 1, ...
    rows: tuple[tuple[int, int | None], ...]
    device: str = "cpu"                # "cuda": rank r on cuda:r over NCCL, the Triton kernels (not run yet)
    fully_sharded: bool = False        # LoRA fully sharded (lora/shards.shard_loras_fully)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_thread():
    """torch at one intra-op thread inside the block, as in every rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_rank(rank: int, world_size: int, port: int, case: Case, out_dir: str) -> None:
    """Entry point of a spawned rank: saves its logits (every rank holds the gathered whole) to out_dir."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if case.device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if case.device == "cuda" else "gloo"
    tp = init_tensor_parallel(rank, world_size, backend, f"tcp://127.0.0.1:{port}")
    try:
        torch.save(model_logits(case, tp).cpu(), Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def build_model(case: Case, tp: TensorParallel) -> nn.Module:
    """The model class of the checkpoint's architecture (dense or MoE), this rank's shard of it."""
    cfg = ArchConfig.from_dir(case.model_dir)
    device = _device(case)
    kernels = resolve_kernels(KernelConfig(), device)
    with device:
        model = MODEL_CLASSES[cfg.architecture](cfg, torch.float32, 128, kernels, tp)
    with torch.no_grad():
        if case.load_format == "dummy":
            init_dummy_weights(model, seed=3, std=0.1)
        else:
            load_weights(model, Path(case.model_dir))
    if case.fully_sharded and tp.world_size > 1:
        shard_loras_fully(model, MAX_RANK)
    return model.eval()


@torch.inference_mode()
def model_logits(case: Case, tp: TensorParallel = SINGLE) -> torch.Tensor:
    """Logits [(1 + NUM_DECODE) * rows, vocab]: each row's prefill logits, then one decode step at a time over
    every row, each step feeding fixed token ids."""
    model, device = build_model(case, tp), _device(case)
    cfg = model.cfg
    ranks = [0] * max(1, len(case.adapters))
    if case.adapters:
        pool = GPULoRAPool(model, len(case.adapters), MAX_RANK, torch.float32, device)
        for slot, (name, path) in enumerate(case.adapters):
            adapter = read_adapter(name, path, lora_targets(cfg), MAX_RANK, torch.float32)
            pool.start_load(slot, pool.layout.pack(shard_adapter(model, adapter)), adapter.spec.rank, name)
        if device.type == "cuda":
            pool.wait_for(range(len(case.adapters)))
        ranks = pool.ranks_host
    shape = (len(case.rows) * 2, BLOCK_SIZE, model.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device)) for _ in range(cfg.num_layers)]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n, _ in case.rows]
    slots = [-1 if a is None else a for _, a in case.rows]
    out = [model(forward_batch([(p, 0) for p in prompts], slots, ranks, device), kv)]
    lengths = [len(p) for p in prompts]
    for _ in range(NUM_DECODE):
        tokens = torch.randint(2, cfg.vocab_size, (len(prompts),), generator=gen).tolist()
        out.append(model(forward_batch([([t], n) for t, n in zip(tokens, lengths)], slots, ranks, device), kv))
        lengths = [n + 1 for n in lengths]
    return torch.cat(out)


def _device(case: Case) -> torch.device:
    return torch.device(case.device, torch.cuda.current_device()) if case.device == "cuda" else torch.device("cpu")


def forward_batch(seqs: list[tuple[list[int], int]], slots: list[int], ranks: list[int],
                  device: torch.device = torch.device("cpu")) -> ForwardBatch:
    """seqs: (new tokens, first position) per sequence, sequence i in KV blocks [2i, 2i + 1]; slots: the LoRA slot of
    each (-1: base); logits of each sequence's last token. Segments: one per run of equal slots; token_lora_slots (the
    MoE layers' expert LoRA): each token's sequence's slot."""
    ids, pos, kv_slots, qsl, lens = [], [], [], [0], []
    for i, (tokens, start) in enumerate(seqs):
        for j, token in enumerate(tokens):
            p = start + j
            ids.append(token)
            pos.append(p)
            kv_slots.append((2 * i + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE)
        qsl.append(qsl[-1] + len(tokens))
        lens.append(start + len(tokens))
    seg_indptr, weights = [0], []
    for i, slot in enumerate(slots):
        if weights and weights[-1] == slot:
            seg_indptr[-1] = qsl[i + 1]
        else:
            weights.append(slot)
            seg_indptr.append(qsl[i + 1])
    max_rank = max((ranks[w] for w in weights if w >= 0), default=0)
    token_lora_slots = [slot for (tokens, _), slot in zip(seqs, slots) for _ in tokens]

    def t(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    i32 = torch.int32
    lora = LoRABatchInfo(len(weights), t(seg_indptr, i32), t(weights, i32), t(ranks, i32), max_rank,
                         max_seg_len=max(b - a for a, b in zip(seg_indptr, seg_indptr[1:])),
                         token_lora_slots=t(token_lora_slots, i32), seg_indptr_host=seg_indptr, seg_lora_slots_host=weights,
                         ranks_host=list(ranks), token_lora_slots_host=token_lora_slots)
    return ForwardBatch(num_tokens=len(ids), num_seqs=len(seqs), max_query_len=max(len(tokens) for tokens, _ in seqs),
                        input_ids=t(ids), positions=t(pos), kv_slot_mapping=t(kv_slots), query_start_loc=t(qsl, i32),
                        seq_lens=t(lens, i32), block_tables=t([[2 * i, 2 * i + 1] for i in range(len(seqs))], i32),
                        logits_indices=t(qsl[1:]) - 1, lora=lora if max_rank else None,
                        query_start_loc_host=qsl, seq_lens_host=lens)
