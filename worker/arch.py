"""The architecture facts we need, read from a Hugging Face config.json (transformers 4 and 5 spellings)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float": torch.float32, "half": torch.float16}


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None      # rope parameters beyond theta (llama3, linear), None for default
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype             # the checkpoint's dtype
    eos_token_ids: tuple[int, ...]
    # mixture of experts; the defaults mean a dense model
    num_experts: int = 0                   # routed experts per sparse layer (0: dense)
    num_experts_per_tok: int = 0           # top-k
    moe_intermediate_size: int = 0         # one expert's intermediate size
    norm_topk_prob: bool = False           # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE's shared expert (0: none), gated by a sigmoid
    decoder_sparse_step: int = 1           # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether `layer` has a sparse MoE block (else a dense MLP of intermediate_size), as HF decides it."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> "ArchConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, c: dict) -> "ArchConfig":
        arch = (c.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        theta, scaling = _rope(c)
        attention_bias = bool(c.get("attention_bias", False))
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=c["intermediate_size"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or bool(c.get("qkv_bias", arch in _QKV_BIAS)),
            o_bias=attention_bias and arch not in _QKV_BIAS,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            dtype=_DTYPES.get(str(c.get("dtype") or c.get("torch_dtype") or "float32"), torch.float32),
            eos_token_ids=eos_ids,
            **_moe(c),
        )


_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")    # q/k/v biases without attention_bias


def _moe(c: dict) -> dict:
    """The MoE fields of ArchConfig; {} for a dense model. Qwen names the expert count `num_experts`,
    Mixtral (and Qwen3-MoE saved by transformers 5) `num_local_experts`; Mixtral's experts are
    `intermediate_size` wide and its routing weights are always renormalised."""
    num_experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if not num_experts:
        return {}
    mixtral = (c.get("architectures") or [""])[0] == "MixtralForCausalLM"
    return dict(num_experts=num_experts, num_experts_per_tok=c["num_experts_per_tok"],
                moe_intermediate_size=c.get("moe_intermediate_size") or c["intermediate_size"],
                norm_topk_prob=mixtral or bool(c.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=c.get("shared_expert_intermediate_size") or 0,
                decoder_sparse_step=c.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(c.get("mlp_only_layers") or ()))


def _rope(c: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4)."""
    params = dict(c.get("rope_parameters") or {})
    legacy = dict(c.get("rope_scaling") or {})
    theta = params.pop("rope_theta", c.get("rope_theta", 10000.0))
    params.update({k: v for k, v in legacy.items() if k not in params})
    rope_type = params.get("rope_type", params.get("type", "default"))
    return float(theta), (None if rope_type == "default" else params)
