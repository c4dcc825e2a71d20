"""CUDAGraphRunner's host logic on the CPU: which graph a batch replays (shape_for, _lora_mode), what run() asks
the input builder to fill for it, and the batches that run eagerly. The graphs are stand-ins that count their
replays; the input builder records its calls."""
from __future__ import annotations

import pytest
import torch

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.ipc.messages import SamplingParams
from worker.model_runner.cuda_graph import CUDAGraphRunner
from worker.model_runner.input_builder import InputBuilder
from worker.request import Request

VOCAB = 5
BASE = -1


class StubGraph:
    def __init__(self):
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class RecordingInputs:
    """The input builder's side that run() uses: build (recorded) and grouped_segments (InputBuilder's own)."""
    grouped_segments = InputBuilder.grouped_segments

    def __init__(self, max_loras: int):
        self.lora_ranks_host = [0] * max_loras
        self.builds: list[dict] = []

    def build(self, batch, **kwargs):
        self.builds.append(kwargs)


def make_runner(max_num_seqs=8, max_mixed_tokens=128, grouped_min_rows=4, tile_map_max_tokens=32,
                max_loras=2) -> CUDAGraphRunner:
    """A runner with every graph capture() would make, as stand-ins writing into one shared logits buffer."""
    runner = CUDAGraphRunner(None, None, RecordingInputs(max_loras), max_num_seqs, max_mixed_tokens,
                             grouped_min_rows, tile_map_max_tokens)
    logits = torch.arange(max_num_seqs * VOCAB, dtype=torch.float32).view(max_num_seqs, VOCAB)
    keys = [("decode", b, lora) for b in runner.buckets for lora in (True, False)]
    keys += [("decode", b, "grouped") for b in runner.grouped_buckets]
    keys += [("mixed", t, lora) for t in runner.token_buckets for lora in (True, False)]
    runner.graphs = {key: (StubGraph(), logits) for key in keys}
    assert len(runner.graphs) == CUDAGraphRunner.num_graphs(max_num_seqs, max_mixed_tokens, grouped_min_rows)
    return runner


def seq(prompt: int, computed: int, new: int, slot: int = BASE, outputs: int = 0,
        prompt_logprobs: int | None = None) -> ScheduledSeq:
    """A sequence of a `prompt`-token request with `outputs` tokens generated, computing `new` tokens from
    position `computed`."""
    request = Request("r", list(range(prompt)), SamplingParams(prompt_logprobs=prompt_logprobs), 0)
    request.output_token_ids = [1] * outputs
    return ScheduledSeq(request, computed, new, slot)


def decode(slot: int = BASE, **kwargs) -> ScheduledSeq:
    return seq(4, 4, 1, slot, outputs=1, **kwargs)


def prefill(tokens: int, slot: int = BASE, **kwargs) -> ScheduledSeq:
    return seq(tokens, 0, tokens, slot, **kwargs)


@pytest.mark.parametrize("seqs, shape", [
    ([decode()], ("decode", 1)),
    ([decode()] * 3, ("decode", 4)),                                # the smallest bucket that fits
    ([decode()] * 8, ("decode", 8)),
    ([decode(prompt_logprobs=2)] * 2, ("decode", 2)),               # its prompt is scored already
    ([prefill(10), decode(), decode()], ("mixed", 16)),             # 12 tokens
    ([prefill(40)], ("mixed", 64)),                                 # buckets 16, 32, 64, 96, 128
    ([seq(20, 0, 1)], ("mixed", 16)),                               # one token of a prompt: nothing sampled
    ([prefill(100), prefill(28)], ("mixed", 128)),                  # the largest bucket, exactly
    ([prefill(100), prefill(29)], None),                            # past it: eager
    ([prefill(5, prompt_logprobs=1), decode()], None),              # prompt logprobs: eager
    ([seq(20, 8, 4, prompt_logprobs=0)], None),                     # a chunk of a scored prompt: eager
], ids=["decode-1", "decode-3-in-4", "decode-8", "scored-prompt-done", "mixed-12-in-16", "prefill-40-in-64",
        "prompt-chunk-token", "largest-bucket", "past-largest", "prompt-logprobs", "prompt-logprobs-chunk"])
def test_shape_for_picks_the_smallest_bucket_or_eager(seqs, shape):
    assert make_runner().shape_for(ScheduledBatch(seqs)) == shape


def test_mixed_graph_holds_at_most_max_num_seqs_sequences():
    """Five decodes on a 4-sequence engine fit the 16-token bucket but not its 4 sequences: eager."""
    runner = make_runner(max_num_seqs=4)
    assert runner.mixed_seqs(16) == 4 and runner.mixed_seqs(2) == 2
    assert runner.shape_for(ScheduledBatch([decode()] * 4)) == ("decode", 4)
    assert runner.shape_for(ScheduledBatch([decode()] * 5)) is None
    assert runner.shape_for(ScheduledBatch([prefill(11), decode(), decode(), decode()])) == ("mixed", 16)


@pytest.mark.parametrize("slots, shape, mode", [
    ([BASE, BASE, BASE, BASE], ("decode", 4), False),              # no adapter: the graph without LoRA
    ([0, 0, 1, 1], ("decode", 4), "grouped"),                      # two rows per run
    ([BASE, BASE, 0, 0], ("decode", 4), "grouped"),                # the base rows are a run too
    ([0, 1, 0, 1], ("decode", 4), True),                           # a run per row: per-row LoRA
    ([0, 0, 1], ("decode", 4), True),                              # 2 runs, 3 rows: fewer than two per run
    ([0, 0], ("decode", 2), True),                                 # bucket 2 has no grouped graph
    ([BASE, BASE, BASE, 0, 0, 0, BASE, BASE], ("decode", 8), True),   # 3 runs: as many as the graph's segments
    ([0, 0, 0, 0, 1, 1, 1, 1], ("decode", 8), "grouped"),
])
def test_lora_mode_is_grouped_when_rows_average_two_per_run(slots, shape, mode):
    runner = make_runner(grouped_min_rows=4, max_loras=1)          # grouped graphs at 4 and 8: 3 segments
    batch = ScheduledBatch([decode(slot) for slot in slots])
    assert runner.shape_for(batch) == shape
    assert runner._lora_mode(*shape, batch) == mode


def test_mixed_batches_with_an_adapter_use_the_lora_graph():
    runner = make_runner()
    batch = ScheduledBatch([prefill(10, slot=0), decode(0), decode(0), decode(0)])
    assert runner._lora_mode("mixed", 16, batch) is True
    assert runner._lora_mode("mixed", 16, ScheduledBatch([prefill(10)])) is False


def replayed(runner: CUDAGraphRunner) -> list[tuple]:
    return [key for key, (graph, _) in runner.graphs.items() if graph.replays]


@pytest.mark.parametrize("seqs, key, build", [
    ([decode(0), decode(0), decode(1)], ("decode", 4, True),
     dict(pad_to=4, lora=True, prev_tokens=None, grouped=False)),
    ([decode(0), decode(0), decode(1), decode(1)], ("decode", 4, "grouped"),
     dict(pad_to=4, lora=True, prev_tokens=None, grouped=True)),
    ([decode(), decode()], ("decode", 2, False), dict(pad_to=2, lora=False, prev_tokens=None, grouped=False)),
    ([prefill(20, slot=1), decode()], ("mixed", 32, True),         # within tile_map_max_tokens: tile maps
     dict(lora=True, prev_tokens=None, mixed_pad=(32, 8), grouped=True)),
    ([prefill(40), decode()], ("mixed", 64, False),                # past it: per-sequence LoRA segments
     dict(lora=False, prev_tokens=None, mixed_pad=(64, 8), grouped=False)),
], ids=["decode-per-row", "decode-grouped", "decode-base", "mixed-tile-map", "mixed-no-tile-map"])
def test_run_fills_the_inputs_for_its_graph_and_replays_it_once(seqs, key, build):
    runner = make_runner(tile_map_max_tokens=32)
    batch = ScheduledBatch(seqs)
    logits = runner.run(batch)
    assert replayed(runner) == [key] and runner.graphs[key][0].replays == 1
    assert runner.inputs.builds == [build]
    shared = runner.graphs[key][1]
    assert logits.shape == (len(seqs), VOCAB) and torch.equal(logits, shared[:len(seqs)])
    assert runner.last_replay == ("grouped" if key[2] == "grouped" else key[0])
    assert runner.replays == {"decode": key[0] == "decode", "mixed": key[0] == "mixed",
                              "grouped": key[2] == "grouped"}


def test_run_returns_the_logits_of_the_sampling_sequences_only():
    runner = make_runner()
    batch = ScheduledBatch([seq(40, 0, 8), decode(), decode()])    # a prompt chunk samples nothing
    logits = runner.run(batch)
    assert logits.shape == (2, VOCAB) and torch.equal(logits, runner.graphs[("mixed", 16, False)][1][:2])


def test_run_passes_the_previous_steps_tokens_to_the_build():
    runner = make_runner()
    prev = torch.tensor([3, 4])
    runner.run(ScheduledBatch([decode(), decode()]), prev)
    assert runner.inputs.builds[0]["prev_tokens"] is prev


@pytest.mark.parametrize("seqs", [[prefill(100), prefill(29)], [prefill(5, prompt_logprobs=1)]],
                         ids=["past-largest-bucket", "prompt-logprobs"])
def test_an_eager_batch_builds_nothing_and_replays_nothing(seqs):
    runner = make_runner()
    assert runner.run(ScheduledBatch(seqs)) is None
    assert runner.inputs.builds == [] and replayed(runner) == []
    assert runner.replays == {"decode": 0, "mixed": 0, "grouped": 0} and runner.last_replay == ""


def test_no_mixed_graphs_without_a_mixed_token_budget():
    runner = make_runner(max_mixed_tokens=0)
    assert runner.token_buckets == []
    assert runner.shape_for(ScheduledBatch([prefill(3)])) is None
    assert runner.shape_for(ScheduledBatch([decode()])) == ("decode", 1)
