"""FP8 weights: E4M3 matrices with float32 scales that multiply (W ~= fp8.float() * scale), one scale per tensor,
per output row or per (block_n x block_k) block, as compressed-tensors and block-wise FP8 checkpoints store them
(layers/weights/format.py reads which), or quantized here from a full-precision checkpoint (`--quantization fp8`:
per output row, amax / 448).

Loading. A checkpoint's FP8 tensor is copied as it is and its scale beside it; a full-precision tensor handed to
`weight` (online quantization, `--load-format dummy`) is quantized here at the scheme's granularity, slice by
slice, exactly as the published tools do (scale = amax / 448, clamped to +-448 before the cast: CUDA casts an
overflow to NaN where the CPU saturates). Per-tensor scales become per-row scales at load (each fused slice's
scalar repeated over its rows), so q|k|v and gate|up fused from separately scaled checkpoint tensors need no
requantization, and the kernels see two layouts only: per row, or block-wise.

After loading (`finish`), a device without FP8 kernels (the CPU: tests, CI, the demo) dequantizes to the compute
dtype and multiplies as an unquantized projection does, so a checkpoint's logits equal Hugging Face + PEFT on the
dequantized weights; a device with them (SM89+) keeps E4M3 and multiplies through ops.fp8_linear, where activations
are quantized (dynamically per token, or by the checkpoint's static per-tensor input scale: the max over a fused
projection's slices) and the LoRA shrink reads them before quantization (the backend hands it the same x).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.kernels import ops
from worker.layers.weights.scheme import ExpertMatrices, ExpertsScheme, LinearScheme

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                                   # torch.finfo(float8_e4m3fn).max
_MIN_SCALE = torch.finfo(torch.float32).tiny      # an all-zero row or block quantizes with this scale (to zeros)


@dataclass(frozen=True)
class Fp8Spec:
    """How a checkpoint holds a projection's FP8 weight (layers/weights/format.py reads it)."""
    weights: str                          # "tensor", "channel" (one scale per output row) or "block"
    block: tuple[int, int] | None = None  # (block_n, block_k) when weights == "block"
    static_activations: bool = False      # a per-tensor `input_scale` per projection (else dynamic)
    scale_name: str = "weight_scale"      # "weight_scale" (compressed-tensors) or "weight_scale_inv" (block FP8)
    serialized: bool = True               # the checkpoint holds E4M3 (False: quantized here at load)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        if not self.serialized:
            return ("weight",)
        return ("weight", self.scale_name) + (("input_scale",) if self.static_activations else ())


def quantize(w: torch.Tensor, weights: str, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision matrix w [rows, cols] -> (E4M3 [rows, cols], float32 scales): per tensor [1], per row
    [rows] or per block [ceil(rows / bn), ceil(cols / bk)] (a partial block's amax over its real elements),
    scale = amax / 448, q = cast(clamp(w / scale, +-448))."""
    w = w.float()
    if weights == "block":
        bn, bk = block
        rows, cols = w.shape
        nb, kb = -(-rows // bn), -(-cols // bk)
        padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
        padded[:rows, :cols] = w
        amax = padded.abs().view(nb, bn, kb, bk).amax(dim=(1, 3))                     # [nb, kb]
        scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    else:
        amax = w.abs().amax().reshape(1) if weights == "tensor" else w.abs().amax(dim=1)
        scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
        full = scale[:, None] if weights == "channel" else scale
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """E4M3 [..., rows, cols] with per-row scales [..., rows] (block None) or block scales [..., nb, kb] ->
    float32 [..., rows, cols]."""
    if block is None:
        return q.float() * scale.float()[..., None]
    rows, cols = q.shape[-2:]
    full = scale.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return q.float() * full[..., :rows, :cols]


def _blocks(start: int, length: int, size: int, what: str) -> tuple[int, int]:
    """The block rows (or columns) [first, first + count) that hold elements [start, start + length)."""
    if start % size:
        raise ValueError(f"block-wise FP8 needs each tensor-parallel share of {what} to start on a block of "
                         f"{size}; this rank's starts at {start}")
    return start // size, -(-length // size)


class Fp8Linear(LinearScheme):
    """`weight` E4M3 [out, in] and float32 `weight_scale`: [out] per row (tensor and channel checkpoints) or
    [block rows of every slice, ceil(in / block_k)] (block); static activations: `input_scale` [1]."""

    def __init__(self, spec: Fp8Spec, fp8_kernels: bool):
        self.spec = spec
        self.fp8_kernels = fp8_kernels
        self.dense = False           # dequantized to the compute dtype (finish, on a device without FP8 kernels)

    # geometry of this rank's share ---------------------------------------------------------------------------
    def _slice_shares(self, layer) -> list[tuple[int, int]]:
        """(start, length) in the checkpoint's rows of each fused slice that this rank holds."""
        if layer.output_shards is not None:
            return list(layer.output_shards)
        return [(0, size) for size in layer.full_output_sizes]

    def _block_layout(self, layer) -> tuple[list[int], tuple[int, int]]:
        """Offsets of each slice's block rows in weight_scale, and (first, count) of this rank's block columns."""
        bn, bk = self.spec.block
        offsets = [0]
        for s, (start, length) in enumerate(self._slice_shares(layer)):
            offsets.append(offsets[-1] + _blocks(start, length, bn, f"slice {s}'s output rows")[1])
        cols = (_blocks(*layer.input_shard, bk, "the input columns") if layer.input_shard is not None
                else (0, -(-layer.in_features // bk)))
        return offsets, cols

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        layer.compute_dtype = dtype
        rows, cols = layer.slice_offsets[-1], layer.in_features
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8), requires_grad=False)
        if self.spec.weights == "block":
            offsets, (_, kb) = self._block_layout(layer)
            layer.block_offsets = offsets
            scale = torch.ones(offsets[-1], kb, dtype=torch.float32)
        else:
            scale = torch.ones(rows, dtype=torch.float32)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        num_slices = len(layer.output_sizes)
        layer.input_scale = (nn.Parameter(torch.ones(num_slices, dtype=torch.float32), requires_grad=False)
                             if self.spec.static_activations else None)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return self.spec.checkpoint_tensors()

    def full_shape(self, layer, name: str) -> tuple[int, ...]:
        rows, cols = layer.full_rows(), layer.full_in_features()
        if name == "weight":
            return rows, cols
        if name == "input_scale" or self.spec.weights == "tensor":
            return (1,)
        if self.spec.weights == "channel":
            return rows, 1
        bn, bk = self.spec.block
        return -(-rows // bn), -(-cols // bk)

    # loading --------------------------------------------------------------------------------------------------
    def load(self, layer, name: str, shard: int | None, tensor: torch.Tensor) -> None:
        if shard is None and len(layer.full_output_sizes) > 1:     # a whole fused tensor: slice by slice
            if name != "weight":
                raise ValueError(f"a fused projection's {name} must come per checkpoint slice")
            for s, part in enumerate(tensor.split(layer.full_output_sizes)):
                self.load(layer, name, s, part)
            return
        s = 0 if shard is None else shard
        if name == "weight":
            if tensor.dtype != FP8:          # full precision: quantized here at the scheme's granularity
                if tuple(tensor.shape) != (layer.full_output_sizes[s], layer.full_in_features()):
                    raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model "
                                     f"{(layer.full_output_sizes[s], layer.full_in_features())}")
                tensor, scale = quantize(tensor, self.spec.weights, self.spec.block)
                self._load_scale(layer, s, scale)
            layer.copy_share(layer.weight, tensor, s if len(layer.full_output_sizes) > 1 else shard, columns=True)
        elif name == "input_scale":
            layer.input_scale[s] = tensor.float().reshape(-1).max()
        elif name == self.spec.scale_name:
            self._load_scale(layer, s, tensor.float())
        else:
            raise ValueError(f"an FP8 projection takes no checkpoint tensor {name!r}")

    def _load_scale(self, layer, s: int, scale: torch.Tensor) -> None:
        """Slice s's whole checkpoint scale: [1] or [] (tensor), [rows, 1] or [rows] (channel), or the block grid."""
        rows = layer.full_output_sizes[s]
        if self.spec.weights == "block":
            bn, bk = self.spec.block
            grid = (-(-rows // bn), -(-layer.full_in_features() // bk))
            if tuple(scale.shape) != grid:
                raise ValueError(f"block scale shape {tuple(scale.shape)} != {grid} for a [{rows}, "
                                 f"{layer.full_in_features()}] weight in {bn}x{bk} blocks")
            start, length = self._slice_shares(layer)[s]
            first, count = _blocks(start, length, bn, f"slice {s}'s output rows")
            scale = scale.narrow(0, first, count)
            if layer.input_shard is not None:
                scale = scale.narrow(1, *_blocks(*layer.input_shard, bk, "the input columns"))
            layer.weight_scale[layer.block_offsets[s]:layer.block_offsets[s + 1]] = scale
            return
        if self.spec.weights == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"a per-tensor weight scale has one element, got shape {tuple(scale.shape)}")
            scale = scale.reshape(1).expand(rows)
        elif scale.shape not in ((rows, 1), (rows,)):
            raise ValueError(f"per-channel weight scale shape {tuple(scale.shape)} != {(rows, 1)}")
        layer.copy_share(layer.weight_scale, scale.reshape(rows),
                         s if len(layer.full_output_sizes) > 1 else None, columns=False)

    def finish(self, layer) -> None:
        """After every tensor is loaded: dequantize (no FP8 kernels), or settle the FP8 kernels' layout."""
        if not self.fp8_kernels:
            w = dequantize(layer.weight, layer.weight_scale, None) if self.spec.weights != "block" else \
                self._dequantize_blocks(layer)
            layer.weight = nn.Parameter(w.to(layer.compute_dtype), requires_grad=False)
            layer.weight_scale = layer.input_scale = None
            self.dense = True
            return
        if self.spec.weights == "block":
            bn = self.spec.block[0]
            sizes = layer.output_sizes
            if any(size % bn for size in sizes[:-1]):
                raise ValueError(f"block-wise FP8 on the GPU needs every fused slice but the last to be a whole "
                                 f"number of {bn}-row blocks; slices {sizes}")
        if layer.input_scale is not None:
            layer.input_scale = nn.Parameter(layer.input_scale.max().reshape(1), requires_grad=False)

    def _dequantize_blocks(self, layer) -> torch.Tensor:
        parts = []
        for s in range(len(layer.output_sizes)):
            rows = slice(layer.slice_offsets[s], layer.slice_offsets[s + 1])
            grid = layer.weight_scale[layer.block_offsets[s]:layer.block_offsets[s + 1]]
            parts.append(dequantize(layer.weight[rows], grid, self.spec.block))
        return torch.cat(parts)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None, beside_lora: bool = False) -> torch.Tensor:
        if self.dense:
            return ops.linear(x, layer.weight, bias, layer.kernels, beside_lora)
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, self.spec.block, bias,
                              layer.kernels, beside_lora)


class Fp8Experts(ExpertsScheme):
    """`gate_up_proj` E4M3 [E, 2I, H] and `down_proj` [E, H, I] with float32 scales `gate_up_scale`, `down_scale`:
    per row ([E, 2I], [E, H]) or block-wise ([E, gate's block rows + up's, ceil(H / bk)], [E, ceil(H / bn),
    ceil(I / bk)]). Static input scales are read (the checkpoint carries them) but the expert kernels quantize
    activations per token, which is at least as accurate."""

    def __init__(self, spec: Fp8Spec, fp8_kernels: bool):
        self.spec = spec
        self.fp8_kernels = fp8_kernels
        self.dense = False

    def create_weights(self, experts, dtype: torch.dtype) -> None:
        experts.compute_dtype = dtype
        e, h, (i_start, i) = experts.num_experts, experts.hidden_size, experts.intermediate_shard
        experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8), requires_grad=False)
        experts.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=FP8), requires_grad=False)
        if self.spec.weights == "block":
            bn, bk = self.spec.block
            first, count = _blocks(i_start, i, bn, "the expert intermediate size")
            experts.gate_blocks = (first, count)
            gate_up = torch.ones(e, 2 * count, -(-h // bk))
            down = torch.ones(e, -(-h // bn), _blocks(i_start, i, bk, "the expert intermediate size")[1])
        else:
            gate_up, down = torch.ones(e, 2 * i), torch.ones(e, h)
        experts.gate_up_scale = nn.Parameter(gate_up, requires_grad=False)
        experts.down_scale = nn.Parameter(down, requires_grad=False)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        """The fused names (transformers 5's layout: `gate_up_proj`, `gate_up_proj_scale_inv`, ...); per-expert
        checkpoints' tensors load into these too (models/weight_loader.py)."""
        if not self.spec.serialized:
            return ("gate_up_proj", "down_proj")
        suffix = self.spec.scale_name.removeprefix("weight")
        return ("gate_up_proj", "down_proj", f"gate_up_proj{suffix}", f"down_proj{suffix}")

    def full_shape(self, experts, name: str) -> tuple[int, ...]:
        e, h, i = experts.num_experts, experts.hidden_size, experts.full_intermediate_size
        rows, cols = (2 * i, h) if name.startswith("gate_up_proj") else (h, i)
        if name in ("gate_up_proj", "down_proj"):
            return e, rows, cols
        if self.spec.weights == "tensor":
            return (e, 2) if name.startswith("gate_up_proj") else (e,)
        if self.spec.weights == "channel":
            return e, rows, 1
        bn, bk = self.spec.block
        return e, -(-rows // bn), -(-cols // bk)

    def load(self, experts, name: str, tensor: torch.Tensor) -> None:
        """A whole fused tensor ([E, 2I, H] gate rows first, [E, H, I]): expert by expert, part by part."""
        i = experts.full_intermediate_size
        base = "gate_up_proj" if name.startswith("gate_up_proj") else "down_proj"
        tensor_name = "weight" if name == base else self.spec.scale_name
        if tensor_name != "weight" and not (self.spec.weights == "block" or self.spec.weights == "channel"):
            raise ValueError(f"fused experts' {name} is only read block-wise or per channel")
        for e in range(experts.num_experts):
            if base == "down_proj":
                self.load_expert(experts, e, "down", tensor[e], tensor_name)
                continue
            if tensor_name == "weight" or self.spec.weights == "channel":
                gate, up = tensor[e].split(i)
            else:
                nb = -(-i // self.spec.block[0])
                gate, up = tensor[e][:nb], tensor[e][nb:]
            self.load_expert(experts, e, "gate", gate, tensor_name)
            self.load_expert(experts, e, "up", up, tensor_name)

    def load_expert(self, experts, expert: int, part: str, tensor: torch.Tensor, tensor_name: str = "weight") -> None:
        i_start, i = experts.intermediate_shard
        if tensor_name == "input_scale":
            return                              # read, not used: the kernels quantize activations per token
        if tensor_name == "weight" and tensor.dtype != FP8:
            tensor, scale = quantize(tensor, self.spec.weights, self.spec.block)
            self.load_expert(experts, expert, part, scale, self.spec.scale_name)
        if tensor_name == "weight":
            target = {"gate": experts.gate_up_proj[expert, :i], "up": experts.gate_up_proj[expert, i:],
                      "down": experts.down_proj[expert]}[part]
            target.copy_(tensor.narrow(1 if part == "down" else 0, i_start, i))
            return
        if tensor_name != self.spec.scale_name:
            raise ValueError(f"FP8 experts take no checkpoint tensor {tensor_name!r}")
        scale = tensor.float()
        if self.spec.weights == "block":
            bn, bk = self.spec.block
            if part == "down":
                experts.down_scale[expert] = scale.narrow(1, *_blocks(i_start, i, bk, "the expert intermediate "
                                                                                      "size"))
            else:
                first, count = experts.gate_blocks
                half = experts.gate_up_scale[expert, :count] if part == "gate" else experts.gate_up_scale[expert,
                                                                                                          count:]
                half.copy_(scale.narrow(0, first, count))
            return
        rows = experts.hidden_size if part == "down" else experts.full_intermediate_size
        scale = scale.reshape(1).expand(rows) if self.spec.weights == "tensor" else scale.reshape(rows)
        if part == "down":
            experts.down_scale[expert] = scale
        else:
            half = experts.gate_up_scale[expert, :i] if part == "gate" else experts.gate_up_scale[expert, i:]
            half.copy_(scale.narrow(0, i_start, i))

    def finish(self, experts) -> None:
        """After every tensor is loaded: dequantize (no FP8 kernels), or check the FP8 kernels' layout."""
        if self.fp8_kernels:
            i = experts.intermediate_shard[1]
            if self.spec.weights == "block" and i % self.spec.block[0]:
                raise ValueError(f"block-wise FP8 experts on the GPU need each rank's intermediate size ({i}) to be "
                                 f"a whole number of {self.spec.block[0]}-row blocks")
            return
        block = self.spec.block
        if block is None:
            gate_up = dequantize(experts.gate_up_proj, experts.gate_up_scale)
        else:
            count = experts.gate_blocks[1]
            i = experts.intermediate_shard[1]
            gate_up = torch.cat([dequantize(experts.gate_up_proj[:, :i], experts.gate_up_scale[:, :count], block),
                                 dequantize(experts.gate_up_proj[:, i:], experts.gate_up_scale[:, count:], block)],
                                dim=1)
        down = dequantize(experts.down_proj, experts.down_scale, block)
        experts.gate_up_proj = nn.Parameter(gate_up.to(experts.compute_dtype), requires_grad=False)
        experts.down_proj = nn.Parameter(down.to(experts.compute_dtype), requires_grad=False)
        experts.gate_up_scale = experts.down_scale = None
        self.dense = True

    def matrices(self, experts) -> ExpertMatrices:
        if self.dense:
            return ExpertMatrices(experts.gate_up_proj, experts.down_proj)
        return ExpertMatrices(experts.gate_up_proj, experts.down_proj, experts.gate_up_scale, experts.down_scale,
                              self.spec.block)
