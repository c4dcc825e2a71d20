"""Random PEFT LoRA adapters for any model config, written straight to safetensors (no model build).

    python -m bench.make_adapters --config bench/configs/llama-3.1-8b --out /tmp/adapters --num 32 --rank 16
    python -m bench.make_adapters --config bench/configs/qwen3-30b-a3b --out /tmp/adapters --targets q_proj,k_proj,v_proj,o_proj,experts

On a mixture-of-experts model the MLP targets are the dense layers' and "experts" adapts every expert of the
sparse layers as PEFT's target_parameters does (mlp.experts.gate_up_proj and down_proj, one rank-r pair per
expert; the tensor layout is lora/formats/experts.py's format (a)). Shapes and module paths are the model's LoRA
targets (lora/targets.py); a layer that lacks a named module gets none of it.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.arch import ArchConfig
from worker.models.builder import lora_targets

logger = logging.getLogger(__name__)
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(path: Path, arch: ArchConfig, rank: int, targets=ALL_TARGETS, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Path:
    """One adapter with lora_A ~ N(0, 1/in) and lora_B ~ N(0, 1/rank), so its delta is O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    table = lora_targets(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        if "experts" in targets and arch.is_moe and arch.is_sparse_layer(layer):
            tensors.update(_expert_tensors(arch, layer, rank, gen, dtype, device))
        packed = {m: (t, s) for t in table.at(layer) for s, m in enumerate(t.modules)}   # module -> (target, slice)
        for module in targets:
            if module not in packed:
                continue
            target, s = packed[module]
            fan_in, fan_out = target.in_features, target.out_features[s]
            prefix = f"base_model.model.model.layers.{layer}.{target.path(module)}"
            a = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in ** 0.5
            b = torch.randn(fan_out, rank, generator=gen, device=device) / rank ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).cpu()
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
              "target_modules": [t for t in targets if t != "experts"], "bias": "none", "use_rslora": False,
              "use_dora": False, "task_type": "CAUSAL_LM"}
    if "experts" in targets:
        config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def _expert_tensors(arch: ArchConfig, layer: int, rank: int, gen: torch.Generator, dtype: torch.dtype,
                    device: str) -> dict[str, torch.Tensor]:
    """PEFT target_parameters tensors of one sparse layer: gate_up A [r*E, H], B [2I, r*E]; down A [r*E, I],
    B [H, r*E] (expert e: A rows e*r:(e+1)*r, B columns e::E)."""
    e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
    prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
    tensors = {}
    for name, fan_in, fan_out in ((f"{prefix}.base_layer", h, 2 * i), (prefix, i, h)):
        a = torch.randn(rank * e, fan_in, generator=gen, device=device) / fan_in ** 0.5
        b = torch.randn(fan_out, rank * e, generator=gen, device=device) / rank ** 0.5
        tensors[f"{name}.lora_A.weight"] = a.to(dtype).cpu()
        tensors[f"{name}.lora_B.weight"] = b.to(dtype).cpu()
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="model directory holding config.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(ALL_TARGETS))
    parser.add_argument("--prefix", default="lora")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    arch = ArchConfig.from_dir(args.config)
    for i in range(args.num):
        path = make_adapter(Path(args.out) / f"{args.prefix}-{i}", arch, args.rank,
                            tuple(args.targets.split(",")), seed=i, device=args.device)
        logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
