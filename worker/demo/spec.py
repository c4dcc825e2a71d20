"""What the demo is: its sizes (the full one `loraplex demo` serves, the fast one the tests build) and adapters."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

SERVED_MODEL_NAME = "loraplex-demo"
BUILD_VERSION = 2       # raise it when a build's contents change in a way the key below does not see
BASE_SEED = 0


@dataclass(frozen=True)
class DemoSize:
    """A Llama's shape and how long it and its adapters train."""
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    base_bytes: int         # of standard-library source the tokenizer and the base model train on
    slice_bytes: int        # of each adapter's slice
    seq_len: int            # tokens in one training window
    batch_size: int         # windows in one step
    base_steps: int
    base_lr: float
    adapter_steps: int
    adapter_lr: float


FULL = DemoSize("full", vocab_size=2048, hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4,
                num_kv_heads=2, base_bytes=300_000, slice_bytes=60_000, seq_len=128, batch_size=16,
                base_steps=800, base_lr=6e-3, adapter_steps=60, adapter_lr=5e-3)
FAST = DemoSize("fast", vocab_size=1536, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                num_kv_heads=2, base_bytes=200_000, slice_bytes=20_000, seq_len=64, batch_size=8,
                base_steps=150, base_lr=5e-3, adapter_steps=30, adapter_lr=1e-2)
SIZES = {size.name: size for size in (FULL, FAST)}


@dataclass(frozen=True)
class DemoAdapter:
    """One of the demo's PEFT adapters: its LoRA format and the corpus slice (corpus.SLICES) it is trained on."""
    name: str
    rank: int
    targets: tuple[str, ...]
    use_rslora: bool
    slice: str
    seed: int
    alpha: int = 16


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ADAPTERS = (
    DemoAdapter("doctests", 4, ("q_proj", "v_proj"), False, "doctests", 1),
    DemoAdapter("chat", 8, ATTENTION + MLP, False, "chat", 2),
    DemoAdapter("asyncio", 16, MLP, False, "asyncio", 3),
    DemoAdapter("docstrings", 8, ATTENTION, True, "docstrings", 4),
)


def build_key(size: DemoSize) -> str:
    """What a build of `size` is made from: a cached build with another key is stale."""
    spec = {"version": BUILD_VERSION, "size": asdict(size), "adapters": [asdict(a) for a in ADAPTERS]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
