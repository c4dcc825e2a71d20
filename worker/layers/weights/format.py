"""A model's weight format: which weight scheme (layers/weights/) each projection holds, read from config.json's
`quantization_config` or asked for with `--quantization fp8`. Read once when the model is built; the models ask it
for each projection by the checkpoint names fused into it.

Supported (anything else stops the build, naming the method):
- compressed-tensors, format `float-quantized`: E4M3 weights with a per-tensor, per-channel or 128x128 block
  `weight_scale`; activations dynamic (per token, or per 1x128 group with block weights) or static per tensor
  (`input_scale`); `targets` and `ignore` as compressed-tensors matches them (exact names, `re:` regexes anchored
  at the start, the class name "Linear").
- `quant_method: fp8`: block-wise (`weight_block_size: [128, 128]`, `weight_scale_inv`, dynamic activations), or
  per tensor without a block size (`weight_scale`, `input_scale` when `activation_scheme` is static);
  `modules_to_not_convert` / `ignored_layers` as transformers matches them (a name up to a module boundary, a
  regex, or a suffix).
- `--quantization fp8` on a full-precision checkpoint: per-output-channel scales computed at load, dynamic
  per-token activations; the MoE routers and the shared expert's gate stay in full precision, as in vLLM.
The LM head and the embeddings stay in the compute dtype in every format.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from worker.layers.weights.fp8 import Fp8Experts, Fp8Linear, Fp8Spec
from worker.layers.weights.scheme import ExpertsScheme, LinearScheme
from worker.layers.weights.unquantized import UnquantizedExperts, UnquantizedLinear

SUPPORTED = ("compressed-tensors FP8 (format float-quantized: per-tensor, per-channel or 128x128 block weights), "
             "fp8 (block-wise with weight_block_size [128, 128], or per-tensor), and --quantization fp8 (online, "
             "from a bfloat16/float16/float32 checkpoint)")
QUANTIZATION_CHOICES = ("fp8", "compressed-tensors")      # --quantization values (vLLM's names)
BLOCK = (128, 128)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"{what} is not supported; supported weight formats: {SUPPORTED}")


@dataclass(frozen=True)
class _Group:
    """One set of projections sharing an FP8 spec (a compressed-tensors config group, or the whole model)."""
    spec: Fp8Spec
    targets: Callable[[str], bool]


@dataclass(frozen=True)
class WeightFormat:
    """What each projection holds. `fp8_kernels`: the device multiplies E4M3 (else FP8 weights are dequantized to
    the compute dtype after loading: layers/weights/fp8.py)."""
    method: str = "unquantized"
    groups: tuple[_Group, ...] = ()
    ignored: Callable[[str], bool] = lambda name: False
    online: bool = False
    fp8_kernels: bool = False

    def for_device(self, fp8_kernels: bool) -> WeightFormat:
        return replace(self, fp8_kernels=fp8_kernels)

    def _spec(self, names: Sequence[str]) -> Fp8Spec | None:
        """The spec of a projection packing the checkpoint modules `names`; they must agree."""
        specs = {self._spec_of(name) for name in names}
        if len(specs) > 1:
            raise ValueError(f"{', '.join(names)} are fused into one projection but the {self.method} "
                             f"quantization_config gives them different formats")
        return specs.pop()

    def _spec_of(self, name: str) -> Fp8Spec | None:
        if self.ignored(name):
            return None
        for group in self.groups:
            if group.targets(name):
                return group.spec
        return None

    def linear(self, names: Sequence[str], router: bool = False) -> LinearScheme:
        """The scheme of a projection packing the checkpoint modules `names` ("model.layers.0.self_attn.q_proj",
        ...). router: a MoE router or gate, which online quantization leaves in full precision."""
        spec = None if (router and self.online) else self._spec(names)
        return UnquantizedLinear() if spec is None else Fp8Linear(spec, self.fp8_kernels)

    def experts(self, name: str, modules: Sequence[str]) -> ExpertsScheme:
        """The scheme of a sparse block's experts ("model.layers.3.mlp.experts"), each expert's checkpoint modules
        named `modules` (expert 0's stand for all: the formats give every expert of a block one spec)."""
        spec = self._spec([f"{name}.0.{module}" for module in modules])
        return UnquantizedExperts() if spec is None else Fp8Experts(spec, self.fp8_kernels)

    def describe(self) -> str:
        if not self.groups:
            return self.method
        specs = sorted({f"{g.spec.weights}{'' if g.spec.block is None else g.spec.block} weights, "
                        f"{'static' if g.spec.static_activations else 'dynamic'} activations" for g in self.groups})
        return f"{self.method} ({'; '.join(specs)})"


UNQUANTIZED = WeightFormat()


def read_weight_format(config: dict, quantization: str | None = None) -> WeightFormat:
    """The weight format of a model from its config.json (`config`) and `--quantization` (None: the
    checkpoint's own)."""
    qc = config.get("quantization_config")
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise _unsupported(f"--quantization {quantization!r}")
    if qc is None:
        if quantization == "fp8":
            return WeightFormat("fp8 (online)", (_Group(Fp8Spec("channel", serialized=False), lambda _: True),),
                                online=True)
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} needs a checkpoint with a quantization_config; this "
                             f"one has none")
        return UNQUANTIZED
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if quantization is not None and quantization != method:
        raise ValueError(f"Quantization method specified in the model config ({method}) does not match the "
                         f"quantization method specified in the `quantization` argument ({quantization})")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _block_fp8(qc)
    raise _unsupported(f"quantization method {method or qc!r}")


# compressed-tensors ------------------------------------------------------------------------------------------------

def _ct_matcher(entries: Sequence[str], classes: bool) -> Callable[[str], bool]:
    """compressed-tensors' matching: an exact module name, or `re:` + a regex applied with re.match; with
    `classes`, the class name "Linear" matches every projection. Names are tried with and without "model."."""
    exact, patterns, every = set(), [], False
    for entry in entries:
        if entry.startswith("re:"):
            patterns.append(re.compile(entry[3:]))
        elif classes and entry == "Linear":
            every = True
        else:
            exact.add(entry)

    def matches(name: str) -> bool:
        names = (name, name.removeprefix("model."))
        return every or any(n in exact or any(p.match(n) for p in patterns) for n in names)
    return matches


def _float8(args: dict | None, what: str) -> dict | None:
    if args is None:
        return None
    if not isinstance(args, dict):
        raise ValueError(f"compressed-tensors {what} must be an object, got {args!r}")
    if args.get("type", "int") != "float" or args.get("num_bits") != 8 or not args.get("symmetric", True):
        raise _unsupported(f"compressed-tensors {what} {{type {args.get('type', 'int')!r}, num_bits "
                           f"{args.get('num_bits')}, symmetric {args.get('symmetric', True)}}}")
    return args


def _compressed_tensors(qc: dict) -> WeightFormat:
    fmt = qc.get("format")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _unsupported(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    if qc.get("transform_config"):
        raise _unsupported("a compressed-tensors transform_config")
    groups = []
    for key, group in (qc.get("config_groups") or {}).items():
        group_format = group.get("format") or fmt
        if group_format != "float-quantized":
            raise _unsupported(f"compressed-tensors format {group_format!r} (config group {key})")
        weights = _float8(group.get("weights"), f"weights of config group {key}")
        if weights is None or weights.get("dynamic", False):
            raise _unsupported(f"compressed-tensors config group {key} without static FP8 weights")
        if group.get("output_activations") is not None:
            raise _unsupported(f"compressed-tensors output_activations (config group {key})")
        strategy = weights.get("strategy") or ("tensor" if weights.get("group_size") is None else "group")
        block = None
        if strategy == "block":
            block = tuple(weights.get("block_structure") or ())
            if block != BLOCK:
                raise _unsupported(f"compressed-tensors FP8 block_structure {list(block)}")
        elif strategy not in ("tensor", "channel"):
            raise _unsupported(f"compressed-tensors FP8 weight strategy {strategy!r}")
        acts = _float8(group.get("input_activations"), f"input_activations of config group {key}")
        static = acts is not None and not acts.get("dynamic", False)
        if static and acts.get("strategy", "tensor") != "tensor":
            raise _unsupported(f"static compressed-tensors activations with strategy {acts.get('strategy')!r}")
        if static and strategy == "block":
            raise _unsupported("static activations with block-wise FP8 weights")
        targets = group.get("targets") or []
        groups.append(_Group(Fp8Spec(strategy, block, static, "weight_scale"), _ct_matcher(targets, classes=True)))
    if not groups:
        raise ValueError("a compressed-tensors quantization_config with no config_groups")
    return WeightFormat("compressed-tensors", tuple(groups), _ct_matcher(qc.get("ignore") or [], classes=False))


# block-wise (and per-tensor) fp8 ----------------------------------------------------------------------------------

def _hf_matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """transformers' `modules_to_not_convert` matching: a pattern matches a module name from its start up to a
    module boundary (as a regex: "layers.1" matches "layers.1.attn", not "layers.11.attn"; "mlp.gate" not
    "mlp.gate_proj"), or as a suffix. Names are tried with and without "model."."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    compiled = [(p, re.compile(rf"(?:{p}){boundary}")) for p in patterns]

    def matches(name: str) -> bool:
        return any(c.match(n) or n.endswith(p) for n in (name, name.removeprefix("model.")) for p, c in compiled)
    return matches


def _block_fp8(qc: dict) -> WeightFormat:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _unsupported(f"fp8 activation_scheme {scheme!r}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"fp8 fmt {fmt!r}")
    block = qc.get("weight_block_size")
    if block is None:
        spec = Fp8Spec("tensor", None, scheme == "static", "weight_scale")
    else:
        if tuple(block) != BLOCK:
            raise _unsupported(f"fp8 with weight_block_size {list(block)}")
        if scheme != "dynamic":
            raise _unsupported("block-wise fp8 with static activations")
        spec = Fp8Spec("block", BLOCK, False, "weight_scale_inv")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    return WeightFormat("fp8", (_Group(spec, lambda _: True),), _hf_matcher(ignore))
