"""bench.hf_baseline on the tiny demo, CPU: serve's summary fields, step-timed records, mixed-adapter
batches that answer as each request alone would, and the dummy (random, meta-built) load format."""
from __future__ import annotations

import pytest
import torch

from bench import hf_baseline
from bench.workloads import Workload

ADAPTERS = ("doctests", "chat", "asyncio")


def test_baseline_reports_serve_fields_per_batch(demo, tmp_path):
    flags = ["--num-prompts", "5", "--input-len-range", "3", "8", "--output-len-range", "2", "5",
             "--lora-names", *ADAPTERS, "--lora-choice", "uniform", "--seed", "1"]
    result = hf_baseline.main(["--model", str(demo.model_dir), "--lora-dir", str(demo.model_dir.parent / "adapters"),
                               "--batch-size", "2", "--device", "cpu", "--no-plots",
                               "--out", str(tmp_path / "hf.json"), *flags])
    summary, records = result["summary"], result["records"]
    specs = Workload(num_prompts=5, input_len=(3, 8), output_len=(2, 5), adapters=ADAPTERS).requests(seed=1)
    assert (summary["num_requests"], summary["completed"], summary["errors"]) == (5, 5, 0)
    assert (summary["batch_size"], summary["num_batches"]) == (2, 3)
    batches = [specs[i:i + 2] for i in range(0, 5, 2)]
    assert summary["total_generated_tokens"] == sum(len(b) * max(s.output_len for s in b) for b in batches)
    assert summary["total_output_tokens"] == sum(s.output_len for s in specs)
    for r, spec in zip(records, specs):
        assert (r["adapter"], r["prompt_tokens"], r["output_tokens"]) == (spec.adapter, spec.prompt_len,
                                                                         spec.output_len)
        assert len(r["itls"]) == spec.output_len - 1
        assert r["e2el"] == pytest.approx(r["ttft"] + sum(r["itls"]))    # ends at its own last token
    batch_latencies = []
    for batch in [records[0:2], records[2:4], records[4:]]:             # a batch starts all its requests at once
        assert len({r["send_time"] for r in batch}) == 1
        batch_latencies.append(max(r["e2el"] for r in batch))
    assert summary["mean_batch_latency_ms"] >= 1000 * sum(batch_latencies) / 3
    assert summary["median_batch_latency_ms"] >= 1000 * sorted(batch_latencies)[1]
    e2el_ms = sorted(r["e2el"] * 1000 for r in records)
    assert summary["median_e2el_ms"] == pytest.approx(e2el_ms[2])
    assert summary["mean_e2el_ms"] == pytest.approx(sum(e2el_ms) / 5)


def test_mixed_adapter_batch_matches_each_request_alone(demo):
    model = hf_baseline.load_model(str(demo.model_dir), "auto", torch.float32, torch.device("cpu"))
    model = hf_baseline.attach_adapters(model, {name: str(demo.adapters[name]) for name in ADAPTERS[:2]})
    prompts = [[40, 41, 42, 43, 44, 45], [50, 51], [60, 61, 62, 63]]
    adapters = ["doctests", None, "chat"]
    mixed, *_ = hf_baseline.generate_batch(model, prompts, adapters, 4, pad_id=0)
    for row, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        alone, *_ = hf_baseline.generate_batch(model, [prompt], [adapter], 4, pad_id=0)
        assert mixed[row].tolist() == alone[0].tolist(), (row, adapter)
    with model.disable_adapter():
        base, *_ = hf_baseline.generate_batch(model, prompts[:1], [None], 4, pad_id=0)
    assert mixed[0].tolist() != base[0].tolist()            # the adapter changes the answer


def test_dummy_load_format_builds_random_weights_and_rotary_buffers(demo):
    model = hf_baseline.load_model(str(demo.model_dir), "dummy", torch.bfloat16, torch.device("cpu"))
    loaded = hf_baseline.load_model(str(demo.model_dir), "auto", torch.float32, torch.device("cpu"))
    assert model.dtype == torch.bfloat16
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)
    q = model.model.layers[0].self_attn.q_proj.weight.float()
    assert torch.isfinite(q).all() and q.std().item() == pytest.approx(model.config.initializer_range, rel=0.1)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    tokens, start, steps, end = hf_baseline.generate_batch(model, [[1, 2, 3]], [None], 3, pad_id=0)
    assert tokens.shape == (1, 3) and len(steps) == 3 and start < steps[0] <= steps[-1] <= end
