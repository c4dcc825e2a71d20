"""Random PEFT LoRA adapters for any model config, written straight to safetensors (no model build).

    python -m bench.make_adapters --config bench/configs/llama-3.1-8b --out /tmp/adapters --num 32 --rank 16
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.lora.adapter import SUPPORTED_TARGETS as ALL_TARGETS
from worker.lora.adapter import module_shapes
from worker.models.hf_config import ArchConfig

logger = logging.getLogger(__name__)


def make_adapter(path: Path, arch: ArchConfig, rank: int, targets=ALL_TARGETS, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Path:
    """One adapter with lora_A ~ N(0, 1/in) and lora_B ~ N(0, 1/rank), so its delta is O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = module_shapes(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for target in targets:
            fan_in, fan_out = shapes[target]
            block = "self_attn" if target in ALL_TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            a = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in ** 0.5
            b = torch.randn(fan_out, rank, generator=gen, device=device) / rank ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).cpu()
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets),
              "bias": "none", "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


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
