"""bench.lora_loading's replay and summary on a tiny CPU engine: resident streams run through the
traffic and are left out of it, every request is timed, and the targets compare the two modes."""
from __future__ import annotations

import json

import pytest

from bench import lora_loading
from bench.make_adapters import make_adapter
from bench.workloads import Workload
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.arch import ArchConfig

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-loading")
    (root / "config.json").write_text(json.dumps(TINY))
    arch = ArchConfig.from_dir(str(root))
    files = [str(make_adapter(root / f"a{i}", arch, 8, seed=i, dtype=arch.dtype)) for i in range(2)]
    return root, files


def engine(root, overlap: bool) -> Engine:
    return Engine(WorkerConfig(ModelConfig(str(root), dtype="float32", load_format="dummy", max_model_len=256),
                               cache=CacheConfig(num_gpu_blocks_override=256),
                               lora=LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                                               enable_lora_overlap_loading=overlap),
                               scheduler=SchedulerConfig(max_num_seqs=8), device="cpu"))


@pytest.mark.parametrize("streams", [0, 2])
def test_replay_times_every_request_and_keeps_streams_apart(tiny, streams):
    root, files = tiny
    names = [f"a{i}" for i in range(5)]
    modes = {}
    for overlap in (True, False):
        e = engine(root, overlap)
        lora_loading.register(e, names, files)
        workload = Workload(num_prompts=12, input_len=(8, 8), output_len=(3, 3), vocab_size=300,
                            adapters=tuple(names), adapter_choice="uniform", request_rate=200.0)
        before = e.lora_stats()
        timeline = lora_loading.replay(e, workload, 0, streams)
        modes["overlap" if overlap else "blocking"] = result = lora_loading.summarize(timeline, before, e.lora_stats())
        assert set(timeline.arrival) == {f"r{i}" for i in range(12)}
        assert all(len(timeline.tokens[f"r{i}"]) == 3 for i in range(12))
        assert len(timeline.streams) == streams and not e.has_unfinished()
        assert (result["itl_p50_streams_ms"] is None) == (streams == 0)
        assert result["stream_itl_samples"] == sum(len(t) - 1 for t in timeline.streams.values())
        assert result["requests"] == 12 and result["tiers"]["gpu"]["loads"] >= 2
        ids = list(timeline.arrival)      # every request was scheduled after it arrived, before its first token
        assert all(timeline.arrival[i] <= timeline.scheduled[i] <= timeline.tokens[i][0] for i in ids)
        assert "schedule" not in vars(e.scheduler)          # the bench's timing hook is gone again
    # the floor run: the same arrivals and lengths, all on the preloaded hot adapter, load nothing
    no_loads = Workload(num_prompts=12, input_len=(8, 8), output_len=(3, 3), vocab_size=300,
                        adapters=(lora_loading.HOT,), adapter_choice="identical", request_rate=200.0)
    assert [r.prompt for r in no_loads.requests(0)] == [r.prompt for r in workload.requests(0)]
    lora_loading.register(e, names, files)
    lora_loading.preload(e, lora_loading.HOT, 300)
    before = e.lora_stats()
    floor = lora_loading.summarize(lora_loading.replay(e, no_loads, 0, streams), before, e.lora_stats())
    assert floor["resident_at_arrival"] == 12 and floor["tiers"]["gpu"]["loads"] == 0
    assert floor["tiers"]["host"]["loads"] == 0
    targets = lora_loading.targets(modes, floor)
    assert targets["ttft_p50_reduction"] == pytest.approx(1 - modes["overlap"]["ttft_p50_ms"]
                                                          / modes["blocking"]["ttft_p50_ms"])
    bound = 1 - floor["ttft_p50_ms"] / modes["blocking"]["ttft_p50_ms"]
    assert targets["ttft_p50_reduction_bound"] == pytest.approx(bound)
    assert targets["ttft_bar_reachable"] == (bound >= 0.35)
    assert (targets["itl_ok"] is None) == (streams == 0)
    assert lora_loading.targets(modes)["ttft_p50_reduction_bound"] is None
