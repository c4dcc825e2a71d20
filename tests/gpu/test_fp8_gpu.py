"""FP8 base models on the GPU (SM89+), adapters on top: the E4M3 path against HF + PEFT on the dequantized weights,
CUDA graphs against eager, and no host-device sync in a step.

The bound. The FP8 path computes with the checkpoint's own weights (dequantized exactly in the reference) but
quantizes activations to E4M3 (dynamically per token, or per 1x128 group with block weights; weight-only at 1-2
rows): E4M3 rounds within 2^-4 relative where bf16 rounds within 2^-8, so its rounding error is up to 16 x bf16's.
The tiny random models amplify rounding chaotically (tests/gpu/hf_compare.py), so, as there, our error is bounded
relative to HF's own bf16 error along the same tokens: our median error against HF in fp32 is at most FP8_FACTOR =
16 x BF16_ERROR_FACTOR times HF bf16's (+ 1e-2). Greedy tokens can then part from the bf16 reference's where a
step's top two logits lie within the two errors: the measured agreement rate is printed (pytest -s) beside it.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.fp8_fixtures import build_fp8_source, write_fp8_checkpoint
from tests.gpu.hf_compare import BF16_ERROR_FACTOR, hf_teacher_forced, rel_errors
from tests.hf_fixtures import ADAPTERS, MOE_ADAPTERS, adapter_dir
from worker.config import CacheConfig, KernelConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

pytestmark = pytest.mark.gpu
FP8_FACTOR = 16 * BF16_ERROR_FACTOR
NUM_STEPS = 16
# (prompt length, adapter index or None); 7 rows: graphs of 8, and the GEMV's 1-2 rows once rows finish
ROWS = [(7, None), (23, 0), (5, 1), (40, None), (11, 1), (17, 0), (9, None)]
FP8_CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(scope="module", params=[("llama", "ct-fp8-dynamic"), ("llama", "ct-fp8"), ("qwen3", "fp8-block"),
                                        ("qwen3_moe", "fp8-block"), ("mixtral", "ct-fp8-dynamic")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request, tmp_path_factory):
    if not FP8_CAPABLE:
        pytest.skip("FP8 kernels need compute capability 8.9+")
    arch, fmt = request.param
    root = tmp_path_factory.mktemp(f"fp8-{arch}-{fmt}")
    source = build_fp8_source(arch, root, whole_blocks=True)
    written = write_fp8_checkpoint(source, fmt, root / "fp8")
    specs = MOE_ADAPTERS if arch in ("qwen3_moe", "mixtral", "qwen2_moe") else ADAPTERS
    adapters = [adapter_dir(source, spec.name) for spec in specs[:2]]
    if fmt == "ct-fp8":
        calibrate_input_scales(written, adapters)
    return written, adapters


def calibrate_input_scales(written, adapters) -> None:
    """Static per-tensor input scales as a calibration over the served traffic leaves them (llm-compressor's
    static min-max observer: amax / 448 of each projection's input), here over the test's prompts with the base
    model and each adapter. A scale calibrated on the base alone clamps what an adapter pushes past it: the
    fixture's adapters (lora_B x 20) do, which is a property of static activation scales, not of the kernels."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    amax: dict[str, float] = defaultdict(float)
    for path in [None, *adapters]:
        model = AutoModelForCausalLM.from_pretrained(written.dequantized, dtype=torch.float32)
        if path is not None:
            model = PeftModel.from_pretrained(model, path)
        hooks = []
        for name, module in model.named_modules():
            leaf = name.split("base_model.model.")[-1].removesuffix(".base_layer")
            if isinstance(module, torch.nn.Linear) and "lora_" not in name:
                hooks.append(module.register_forward_hook(
                    lambda m, args, out, leaf=leaf: amax.__setitem__(leaf, max(amax[leaf], args[0].abs().max().item()))))
        with torch.no_grad():
            for prompt in prompts():
                model(torch.tensor([prompt]))
        for hook in hooks:
            hook.remove()
    file = written.path / "model.safetensors"
    tensors = load_file(str(file))
    for key in [k for k in tensors if k.endswith(".input_scale")]:
        # the prompts' own inputs, 2x for the decode steps that follow them (generated tokens are not known yet)
        tensors[key] = torch.tensor([2 * amax[key.removesuffix(".input_scale")] / 448.0], dtype=torch.bfloat16)
    save_file(tensors, str(file))


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(17)
    return [torch.randint(2, 300, (n,), generator=gen).tolist() for n, _ in ROWS]


def make_engine(model_dir, adapters, enforce_eager: bool, kernels: KernelConfig = KernelConfig()) -> Engine:
    engine = Engine(WorkerConfig(
        ModelConfig(str(model_dir), dtype="bfloat16"), cache=CacheConfig(num_gpu_blocks_override=512),
        lora=LoRAConfig(max_loras=2, max_lora_rank=16), scheduler=SchedulerConfig(max_num_seqs=16), kernels=kernels,
        device="cuda", enforce_eager=enforce_eager))
    for i, path in enumerate(adapters):
        engine.add_adapter(f"a{i}", str(path))
    return engine


def run(engine: Engine, capture_logits: bool = False):
    logits = defaultdict(list)
    if capture_logits:
        execute = engine.runner.execute

        def capture(batch, prev=None):
            out = execute(batch, prev)
            for seq, row in zip((s for s in batch.seqs if s.samples), out.logits):
                logits[seq.request.request_id].append(row.float().cpu())
            return out
        engine.runner.execute = capture
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True)
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(), ROWS)):
        engine.add_request(f"r{i}", prompt, params, None if adapter is None else f"a{adapter}")
    tokens = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens, logits


@pytest.fixture(scope="module")
def graphs_engine(checkpoint) -> Engine:
    written, adapters = checkpoint
    return make_engine(written.path, adapters, enforce_eager=False)


def test_fp8_tracks_hf_peft_on_the_dequantized_weights(checkpoint, graphs_engine):
    written, adapters = checkpoint
    qkv = graphs_engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
    tokens, logits = run(graphs_engine, capture_logits=True)
    del graphs_engine.runner.execute                  # the capturing wrapper run() installed on the instance
    reference, _ = run(make_engine(written.path, adapters, enforce_eager=False,
                                   kernels=KernelConfig(fp8_kernels=False)))
    agree = total = 0
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(), ROWS)):
        rid = f"r{i}"
        path = None if adapter is None else adapters[adapter]
        ref32, ref16 = (hf_teacher_forced(written.dequantized, path, prompt, tokens[rid], dtype)
                        for dtype in (torch.float32, torch.bfloat16))
        ours = rel_errors(torch.stack(logits[rid]), ref32).median().item()
        hf = rel_errors(ref16, ref32).median().item()
        assert ours <= FP8_FACTOR * hf + 1e-2, f"row {i} ({adapter}): FP8 median error {ours:.3e}, HF bf16 {hf:.3e}"
        same = next((j for j, (a, b) in enumerate(zip(tokens[rid], reference[rid])) if a != b), NUM_STEPS)
        agree, total = agree + same, total + NUM_STEPS
        print(f"{written.path.name} row {i}: FP8 error {ours:.2e} (HF bf16 {hf:.2e}), greedy tokens equal to the "
              f"dequantized bf16 engine's for {same}/{NUM_STEPS} steps")
    print(f"{written.path.name}: greedy agreement with the dequantized engine {agree}/{total}")


def test_fp8_graphs_and_eager_give_identical_tokens(checkpoint, graphs_engine):
    written, adapters = checkpoint
    graphs, _ = run(graphs_engine)
    eager, _ = run(make_engine(written.path, adapters, enforce_eager=True))
    assert graphs == eager


def test_fp8_steps_make_no_host_device_sync(graphs_engine):
    engine = graphs_engine                            # warmed up by the tests before: compiled and autotuned
    run(engine)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(), ROWS)):
        engine.add_request(f"s{i}", prompt, params, None if adapter is None else f"a{adapter}")
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps >= 8
