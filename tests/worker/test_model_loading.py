"""Model loading: sharded checkpoints, config spellings of transformers 4 and 5, Mistral, dummy weights."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from worker.config import CacheConfig, KernelConfig, ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig

PROMPT = [5, 17, 99, 3, 250, 41, 8]


def greedy_logits(model_dir, load_format="auto", steps=4) -> torch.Tensor:
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir), load_format=load_format),
                                 cache=CacheConfig(num_gpu_blocks_override=32), device="cpu"))
    captured = []
    execute = engine.runner.execute

    def capture(batch, prev=None):
        out = execute(batch, prev)
        captured.append(out.logits[0].clone())
        return out

    engine.runner.execute = capture
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return torch.stack(captured)


def hf_logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]


def test_sharded_checkpoint_loads_like_the_single_file(hf_models, tmp_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    torch.testing.assert_close(greedy_logits(tmp_path / "sharded"), greedy_logits(hf_models["llama"]),
                               rtol=0, atol=0)


def test_transformers4_config_spelling_parses_like_transformers5(hf_models, tmp_path):
    v5 = json.loads((hf_models["llama"] / "config.json").read_text())
    rope = dict(v5["rope_parameters"])
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    v4["rope_theta"] = rope.pop("rope_theta")
    v4["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}
    v4["torch_dtype"] = "bfloat16"
    parsed4, parsed5 = ArchConfig.from_dict(v4), ArchConfig.from_dict(v5)
    assert parsed4.rope_theta == parsed5.rope_theta == 50000.0
    assert parsed4.rope_scaling["factor"] == parsed5.rope_scaling["factor"] == 8.0
    assert parsed4.dtype == torch.bfloat16 and parsed5.dtype == torch.float32
    model = tmp_path / "v4"
    shutil.copytree(hf_models["llama"], model)
    (model / "config.json").write_text(json.dumps(v4))
    torch.testing.assert_close(greedy_logits(model), greedy_logits(hf_models["llama"]), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["mistral", "llama-tied-bias"])
def test_other_llama_family_configs_match_hf(tmp_path, arch):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.1)
    if arch == "mistral":
        config = MistralConfig(**common, sliding_window=None)
    else:
        config = LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / arch)
    ours = greedy_logits(tmp_path / arch, steps=1)[0]
    ref = hf_logits(tmp_path / arch)
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4


def test_dummy_weights_need_only_config_json(hf_models, tmp_path):
    model = tmp_path / "dummy"
    model.mkdir()
    shutil.copy(hf_models["qwen3"] / "config.json", model / "config.json")
    first = greedy_logits(model, load_format="dummy")
    assert first.isfinite().all() and first.std() > 0
    torch.testing.assert_close(first, greedy_logits(model, load_format="dummy"), rtol=0, atol=0)


def test_cpu_layers_hold_the_torch_reference_choices(hf_models):
    """On the CPU build_model resolves any KernelConfig to every kernel off (the torch references, no Triton) and
    the reference LoRA backend: one KernelChoices, held by every layer that launches a kernel on a GPU."""
    from worker.models.builder import build_model
    model = build_model(hf_models["llama"], torch.float32, torch.device("cpu"), "auto", 64,
                        KernelConfig(gemv_row_limit=4, skinny_row_limit=64))
    holders = [m for m in model.modules() if hasattr(m, "kernels")]
    assert {type(m).__name__ for m in holders} == {"Linear", "LMHead", "RMSNorm", "Attention", "SiluAndMul"}
    choices = holders[0].kernels
    assert all(m.kernels is choices for m in holders)
    assert (choices.gemv_row_limit, choices.skinny_row_limit, choices.programmatic_launch,
            choices.skinny_counters, choices.lora.name) == (0, 0, False, None, "reference")


def test_kernel_config_refuses_negative_row_limits():
    with pytest.raises(ValueError, match="must be >= 0"):
        KernelConfig(gemv_row_limit=-1)


def test_unsupported_architecture_is_refused(hf_models, tmp_path):
    model = tmp_path / "gpt2"
    shutil.copytree(hf_models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
        greedy_logits(model)
