"""InputBuilder: persistent buffers, one copy per step, pending tokens gathered from the previous step."""
from __future__ import annotations

import torch

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.ipc.messages import SamplingParams
from worker.model_runner.input_builder import InputBuilder
from worker.request import Request


def make_builder() -> InputBuilder:
    return InputBuilder(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=6, block_size=4,
                        device=torch.device("cpu"), lora_ranks_host=[8, 0], lora_ranks=torch.tensor([8, 0]))


def seq(request_id: str, prompt: list[int], outputs: list[int], start: int, num_new: int, slot: int = -1,
        pending_row: int | None = None) -> ScheduledSeq:
    request = Request(request_id, prompt, SamplingParams(max_tokens=8), 0, output_token_ids=list(outputs))
    request.block_ids = [3, 1, 4, 5]
    if pending_row is not None:
        request.num_pending, request.pending_row = 1, pending_row
    return ScheduledSeq(request, start, num_new, slot)


def test_fields_are_disjoint_aligned_views_of_one_buffer_per_side():
    builder = make_builder()
    for views, buf in [(builder.dev, builder._dev_buf), *zip(builder._host_sets, builder._host_bufs)]:
        spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views.values())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "fields overlap"
        assert all(start % 16 == 0 for start, _ in spans)
        assert spans[0][0] >= buf.data_ptr() and spans[-1][1] <= buf.data_ptr() + buf.numel()
    assert builder._host_bufs[0].data_ptr() != builder._host_bufs[1].data_ptr()


def test_a_pending_token_is_taken_from_the_previous_sampler_output():
    builder = make_builder()
    batch = ScheduledBatch([
        seq("prefill", [11, 12, 13], [], 0, 3, slot=0),
        seq("decode", [21, 22], [23], 3, 1, pending_row=2),       # its 4th token (position 3) is pending
        seq("known", [31], [32], 1, 1),
    ])
    prev_tokens = torch.tensor([90, 91, 92, 93])
    fb = builder.build(batch, prev_tokens=prev_tokens)
    assert fb.input_ids.tolist() == [11, 12, 13, 92, 32]
    assert fb.positions.tolist() == [0, 1, 2, 3, 1]
    assert fb.kv_slot_mapping.tolist() == [12, 13, 14, 15, 13]    # block 3 holds positions 0-3
    assert fb.seq_lens.tolist() == [3, 4, 2]
    assert fb.lora.seg_lora_slots_host == [0, -1] and fb.lora.seg_indptr_host == [0, 3, 5]


def test_consecutive_builds_alternate_host_sets_and_keep_device_views():
    builder = make_builder()
    batch = ScheduledBatch([seq("a", [5, 6], [], 0, 2)])
    first = builder.build(batch)
    host_first = builder.host
    second = builder.build(batch)
    assert builder.host is not host_first
    assert first.input_ids.data_ptr() == second.input_ids.data_ptr()      # graph inputs never move
    assert second.input_ids.tolist() == [5, 6]


def test_only_graph_shaped_batches_let_lora_overlap_the_base_gemms():
    """CUDA-graph batches (padded to a bucket) may run LoRA on the side stream; eager steps, bound by host
    launches, run it in line (LoRABatchInfo.overlap)."""
    builder = make_builder()
    decode = ScheduledBatch([seq("a", [5, 6], [7], 2, 1, slot=0), seq("b", [8], [9], 1, 1)])
    assert builder.build(decode).lora.overlap is False
    padded = builder.build(decode, pad_to=4)
    assert padded.lora.overlap is True and padded.lora.seg_lora_slots_host == [0, -1, -1, -1]


def test_mixed_graph_padding_fills_fixed_shapes():
    """A mixed-batch graph's inputs: real rows first, then padding rows in no sequence or segment that write
    no K/V, empty sequences and segments up to the graph's counts, one sampled row per sequence."""
    builder = make_builder()
    batch = ScheduledBatch([
        seq("prefill", [11, 12, 13], [], 0, 3, slot=0),
        seq("decode", [21, 22], [23], 2, 1),
        seq("decode-lora", [31], [32], 1, 1, slot=0),
    ])
    fb = builder.build(batch, mixed_pad=(8, 5))
    assert (fb.num_tokens, fb.num_seqs, fb.max_query_len) == (8, 5, 8)
    assert fb.input_ids.tolist() == [11, 12, 13, 23, 32, 0, 0, 0]
    assert fb.kv_slot_mapping.tolist()[5:] == [-1, -1, -1]
    assert fb.query_start_loc.tolist() == [0, 3, 4, 5, 5, 5]
    assert fb.seq_lens.tolist() == [3, 3, 2, 0, 0]
    assert fb.logits_indices.tolist() == [2, 3, 4, 0, 0]
    assert fb.lora.seg_indptr_host == [0, 3, 4, 5, 5, 5] and fb.lora.seg_lora_slots_host == [0, -1, 0, -1, -1]
    assert (fb.lora.num_segments, fb.lora.max_seg_len, fb.lora.overlap) == (5, 8, False)
    assert fb.lora.seg_indptr.tolist() == [0, 3, 4, 5, 5, 5]


def test_mixed_graph_padding_gives_the_unpadded_logits(hf_models):
    """The model on a padded mixed batch (CPU reference path) computes the same sampled logits as on the
    batch itself: padding rows, sequences and segments touch nothing real. The padded GEMMs have other shapes, so
    the sums may run in another order: the same within the fp32 summation-order bound (tests/fp32_bounds.py);
    a padding row leaking into a real one moves its logits by far more."""
    from tests.fp32_bounds import assert_logits_close, forward_rtol
    from tests.hf_fixtures import ADAPTERS, adapter_dir
    from worker.config import CacheConfig, LoRAConfig, ModelConfig, WorkerConfig
    from worker.engine import Engine
    engine = Engine(WorkerConfig(ModelConfig(str(hf_models["llama"])), cache=CacheConfig(block_size=4),
                                 lora=LoRAConfig(max_loras=2, max_lora_rank=16), device="cpu",
                                 async_scheduling=False))
    for spec in ADAPTERS[:2]:
        engine.add_adapter(spec.name, str(adapter_dir(hf_models["llama"], spec.name)), warm=True)
    while engine.has_background_work():      # both read before the requests come: they start together, whatever
        engine.idle_poll()                   # the reads' threads take on a busy machine
    engine.add_request("a", list(range(5, 14)), SamplingParams(max_tokens=8), ADAPTERS[0].name)
    engine.add_request("b", list(range(40, 46)), SamplingParams(max_tokens=8), None)
    engine.add_request("c", list(range(20, 27)), SamplingParams(max_tokens=8), ADAPTERS[1].name)
    started = set()
    while len(started) < 3:                                # every prompt in: the next steps decode them
        started |= {out.request_id for out in engine.step()}
    engine.add_request("d", list(range(60, 71)), SamplingParams(max_tokens=4), ADAPTERS[1].name)  # resident
    runner, batch = engine.runner, engine.scheduler.schedule()
    assert sorted(s.num_new_tokens for s in batch.seqs) == [1, 1, 1, 11]
    n_sample = sum(s.samples for s in batch.seqs)
    with torch.inference_mode():
        prev = torch.zeros(8, dtype=torch.int64)
        plain = runner.model(runner.input_builder.build(batch, prev_tokens=prev), runner.kv_pool.caches)
        padded = runner.model(runner.input_builder.build(batch, prev_tokens=prev, mixed_pad=(32, 6)),
                              runner.kv_pool.caches)
    assert padded.shape[0] == 6
    rtol = forward_rtol(runner.model.cfg, 11 + 8)          # the longest prompt and its 8 tokens
    assert_logits_close(padded[:n_sample], plain[-n_sample:], rtol, "padded-batch logits")


def test_token_slots_give_each_token_row_its_segments_slot():
    """Slots [a, a, -1, b] with new-token counts [3, 1, 2, 2]: token_lora_slots [a, a, a, a, -1, -1, b, b], on the
    host and on the device (a field of the one input buffer)."""
    builder = make_builder()
    batch = ScheduledBatch([seq("p", [1, 2, 3], [], 0, 3, slot=0), seq("d", [4, 5], [6], 2, 1, slot=0),
                            seq("base", [7, 8], [], 0, 2), seq("b", [9, 10], [], 0, 2, slot=1)])
    info = builder.build(batch).lora
    assert info.token_lora_slots_host == [0, 0, 0, 0, -1, -1, 1, 1]
    assert info.token_lora_slots.dtype == torch.int32 and info.token_lora_slots.tolist() == info.token_lora_slots_host
    dev = builder._dev_buf
    assert dev.data_ptr() <= info.token_lora_slots.data_ptr() < dev.data_ptr() + dev.numel()


def test_decode_padding_rows_have_no_slot():
    builder = make_builder()
    decode = ScheduledBatch([seq("a", [5, 6], [7], 2, 1, slot=0), seq("b", [8], [9], 1, 1),
                             seq("c", [3], [4], 1, 1, slot=0)])
    info = builder.build(decode, pad_to=6).lora
    assert info.token_lora_slots_host == [0, -1, 0, -1, -1, -1] and info.token_lora_slots.tolist() == info.token_lora_slots_host


def test_mixed_graph_padding_rows_have_no_slot():
    builder = make_builder()
    batch = ScheduledBatch([seq("prefill", [11, 12, 13], [], 0, 3, slot=0), seq("decode", [21, 22], [23], 2, 1)])
    info = builder.build(batch, mixed_pad=(8, 4)).lora
    assert info.token_lora_slots_host == [0, 0, 0, -1, -1, -1, -1, -1]
    assert info.token_lora_slots.tolist() == info.token_lora_slots_host


def test_a_batch_forced_onto_the_lora_path_has_every_row_base_only():
    builder = make_builder()
    batch = ScheduledBatch([seq("a", [5, 6], [], 0, 2), seq("b", [8], [9], 1, 1)])
    assert builder.build(batch).lora is None
    info = builder.build(batch, lora=True).lora
    assert info.token_lora_slots_host == [-1, -1, -1] and info.token_lora_slots.tolist() == [-1, -1, -1]


def test_grouped_decode_has_one_segment_per_slot_run_and_a_tile_map_of_fixed_size():
    """Rows ordered by slot [-1, 0, 0, 1] padded to 6 sequences: segments [-1], [0, 0], [1], the padding rows
    one base segment, then empty ones up to grouped_segments(6) = min(6, 2 slots + 2) = 4; max_seg_len 6; the
    tile map (16-row tiles, max_tiles(6, 4, 16) = 5 of them) names each real tile's segment and first row."""
    from worker.kernels.row_tiles_host import max_tiles
    builder = make_builder()
    batch = ScheduledBatch([seq("base", [1], [2], 1, 1), seq("a", [5, 6], [7], 2, 1, slot=0),
                            seq("b", [3], [4], 1, 1, slot=0), seq("c", [8], [9], 1, 1, slot=1)])
    info = builder.build(batch, pad_to=6, grouped=True).lora
    assert info.seg_indptr_host == [0, 1, 3, 4, 6] and info.seg_lora_slots_host == [-1, 0, 1, -1]
    assert info.num_segments == builder.grouped_segments(6) == 4 and info.max_seg_len == 6
    assert info.token_lora_slots_host == [-1, 0, 0, 1, -1, -1]
    assert info.tile_map.tolist() == [0, 0, 1, 1, 2, 3, 3, 4] + [-1, 0] * (max_tiles(6, 4, 16) - 4)
    assert info.seg_indptr.tolist() == info.seg_indptr_host and info.seg_lora_slots.tolist() == [-1, 0, 1, -1]
    full = ScheduledBatch([seq(f"r{i}", [1], [2], 1, 1, slot=i % 2) for i in range(6)])
    full.seqs.sort(key=lambda s: s.lora_slot)
    info = builder.build(full, pad_to=6, grouped=True).lora
    assert info.seg_indptr_host == [0, 3, 6, 6, 6] and info.seg_lora_slots_host == [0, 1, -1, -1]
    assert builder.build(batch, pad_to=6).lora.tile_map is None      # the per-row graphs take no map


def test_a_mixed_graph_with_a_tile_map_keeps_its_segments_and_maps_their_tiles():
    """A mixed-batch graph of 32 tokens and 6 sequences: segments merged by slot and padded as without the map;
    the map (max_tiles(32, 6, 16) = 8 tiles) holds the real segments' 16-row tiles: the 14-token prefill and
    three decode rows on slot 0 (17 rows) take two."""
    from worker.kernels.row_tiles_host import max_tiles
    builder = make_builder()
    batch = ScheduledBatch([seq("base", [1], [2], 1, 1), seq("p", list(range(14)), [], 0, 14, slot=0)]
                           + [seq(f"d{i}", [3], [4], 1, 1, slot=0) for i in range(3)])
    plain = builder.build(batch, mixed_pad=(32, 6)).lora
    info = builder.build(batch, mixed_pad=(32, 6), grouped=True).lora
    assert plain.tile_map is None
    assert info.seg_indptr_host == plain.seg_indptr_host == [0, 1, 18, 18, 18, 18, 18]
    assert info.seg_lora_slots_host == plain.seg_lora_slots_host == [-1, 0, -1, -1, -1, -1]
    assert info.max_seg_len == 32
    assert info.tile_map.tolist() == [0, 0, 1, 1, 1, 17] + [-1, 0] * (max_tiles(32, 6, 16) - 3)
