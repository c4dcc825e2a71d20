"""The LoRA backend seam: chosen once by name for the device, refused by name where it cannot run; a projection's
output whose delta is deferred reads as the in-line result once resolved; the consumers take either."""
from __future__ import annotations

import pytest
import torch

from worker.config import KernelConfig
from worker.kernels.choices import KernelChoices
from worker.layers.activation import SiluAndMul
from worker.layers.lora.backend import BACKENDS, choose_backend
from worker.layers.lora.deferred import Deferred, resolved, split
from worker.layers.norm import RMSNorm


def test_auto_picks_the_devices_backend_and_names_are_checked():
    assert choose_backend("auto", torch.device("cpu")).name == "reference"
    assert choose_backend("reference", torch.device("cpu")).name == "reference"
    assert {"reference", "triton"} <= set(BACKENDS)
    with pytest.raises(ValueError, match="'fused' is not a LoRA backend; choose one of"):
        choose_backend("fused", torch.device("cpu"))
    with pytest.raises(ValueError, match="the 'triton' LoRA backend runs on cuda, not on cpu"):
        choose_backend("triton", torch.device("cpu"))


def test_kernel_config_names_the_backend_and_defaults_to_auto():
    assert KernelConfig().lora_backend == "auto"


def test_a_deferred_output_resolves_as_the_expand_would_have_written_it():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
    delta = torch.randn(5, 8, generator=gen)
    out = Deferred(y, delta)
    # the in-line expand adds in float32 and rounds once to y's dtype
    assert torch.equal(out.resolve(), (y.float() + delta).to(torch.bfloat16))
    assert torch.equal(resolved(out), out.resolve()) and resolved(y) is y
    rows = torch.tensor([4, 1])
    assert torch.equal(out[rows].y, y[rows]) and torch.equal(out[rows].delta, delta[rows])
    assert split(y) == (y, None) and split(out) == (y, delta)


def test_cpu_consumers_take_plain_outputs_through_the_references():
    norm, act = RMSNorm(8, 1e-6, torch.float32, KernelChoices()), SiluAndMul(KernelChoices())
    x = torch.randn(3, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected, rtol=0, atol=1e-6)
    gate, up = x[:, :4], x[:, 4:]
    torch.testing.assert_close(act(x), torch.nn.functional.silu(gate) * up, rtol=0, atol=1e-6)


def test_a_registered_backend_is_chosen_by_name_and_asked_for_every_adapted_projection(hf_models):
    """The seam a new backend plugs into: one registered class, named in KernelConfig.lora_backend, is what every
    layer of the built model holds, and what every LoRA'd projection asks for its LoRA part in a step with an
    adapter (here the reference's, counted): the same tokens as the default backend."""
    from tests.hf_fixtures import ADAPTERS, adapter_dir
    from worker.config import CacheConfig, LoRAConfig, ModelConfig, WorkerConfig
    from worker.engine import Engine
    from worker.ipc.messages import SamplingParams
    from worker.layers.lora.backend import register
    from worker.layers.lora.reference_backend import ReferenceLoRA

    @register
    class CountingLoRA(ReferenceLoRA):
        name = "test-counting"
        calls: list = []                  # the output sizes of each projection that asked

        def linear(self, layer, x, info, bias):
            CountingLoRA.calls.append(layer.output_sizes)
            return super().linear(layer, x, info, bias)

    def generate(backend: str) -> list[int]:
        engine = Engine(WorkerConfig(ModelConfig(hf_models["llama"]), cache=CacheConfig(num_gpu_blocks_override=64),
                                     lora=LoRAConfig(max_loras=2), kernels=KernelConfig(lora_backend=backend),
                                     device="cpu"))
        spec = ADAPTERS[-1]
        engine.add_adapter(spec.name, str(adapter_dir(hf_models["llama"], spec.name)))
        engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True), spec.name)
        tokens = []
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        holders = [m for m in engine.runner.model.modules() if hasattr(m, "kernels")]
        assert {type(m.kernels.lora).__name__ for m in holders} == {
            "CountingLoRA" if backend == "test-counting" else "ReferenceLoRA"}
        return tokens

    try:
        counted = generate("test-counting")
        num_layers = len(CountingLoRA.calls) // 3 // 4        # 3 steps, 4 LoRA'd projections a layer
        assert num_layers >= 1 and len(CountingLoRA.calls) == 3 * 4 * num_layers
        assert counted == generate("auto")
    finally:
        BACKENDS.pop("test-counting")
