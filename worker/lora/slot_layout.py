"""The byte layout of one adapter slot, and an adapter written in it (from its tensors, or from its file).

A slot's bytes hold, for every layer and fused projection in turn, the A matrices, the B matrices and
the per-slice scalings; each projection's LoRAWeights are strided views across all slots:

    slot s: [ L0.qkv: A | B | scalings ][ L0.o_proj: A | B | scalings ] ... [ Ln.down_proj: ... ]
    LoRAWeights.a of L0.qkv = slots[:, a_offset : a_offset + a_bytes] viewed as [num_slots, 3 * R, hidden]

On a mixture-of-experts model the dense regions (attention, dense layers' MLPs, shared experts) are followed
by one expert region per sparse layer, read as MoELoRAWeights (lora/expert_layout.py).

The host cache keeps each adapter in this layout cut to its own size (`SlotLayout.entry_layout`: its rank, the
projections it adapts); lora/expansion.py writes such an entry into a slot.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import math
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker.lora.weights import LoRAWeights, MoELoRAWeights
from worker.lora.adapter import (AdapterBytes, AdapterError, AdapterSource, AdapterSpec, ModuleBytes, ModuleSource,
                                 locate_adapter, read_adapter, read_contents)
from worker.lora.safetensors_file import tensor_file
from worker.lora.expert_layout import expert_layer_reads, expert_regions, expert_views, pack_expert_layer
from worker.lora.file_reads import read_in_parts
from worker.lora.host_buffers import HostBuffers
from worker.lora.host_cache import HostAdapter
from worker.lora.targets import EXPERT_MODULES

_ALIGN = 256        # bytes; every region starts aligned (kernels specialise on 16-byte alignment)
MAX_PLANS = 64      # PackedReader keeps this many plans (distinct adapter configs and headers), the latest used


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Region:
    """Where one fused projection's LoRA weights sit in a slot, in bytes."""
    a_offset: int
    b_offset: int
    scalings_offset: int
    a_shape: tuple[int, int]          # [num_slices * R, in_features]
    b_shape: tuple[int, int]          # [out_features, R]
    slice_offsets: tuple[int, ...]    # [num_slices + 1]


class SlotLayout:
    """The byte layout of one adapter slot; `pack` writes an adapter in it, `views` reads it back.

    The model's LoRA targets (lora/targets.py) say which projections of which layer have a region, in what order,
    and which slice of it each module fills; the built model's projections give their (this rank's) shapes."""

    def __init__(self, model: nn.Module, max_rank: int, dtype: torch.dtype, modules: Collection[str] | None = None):
        self.max_rank, self.dtype = max_rank, dtype
        self.model = model
        self.targets = model.lora_targets(model.cfg)       # LoRATargets, computed from the architecture
        item = dtype.itemsize
        self.regions: dict[tuple[int, str], _Region] = {}
        self._entry_layouts: dict[tuple[int, frozenset[str]], SlotLayout] = {}
        offset = 0
        for layer, name in self.targets.layer_projections():
            if modules is not None and not set(self.targets.target(name).modules) & set(modules):
                continue
            proj = model.projection(layer, name)
            n = len(proj.output_sizes)
            a_rank, b_offsets = proj.lora_slot_shape(max_rank)     # fully sharded LoRA holds less of A or B
            a_shape, b_shape = (n * a_rank, proj.in_features), (b_offsets[-1], max_rank)
            b_offset = offset + _aligned(a_shape[0] * a_shape[1] * item)
            s_offset = b_offset + _aligned(b_shape[0] * b_shape[1] * item)
            self.regions[(layer, name)] = _Region(offset, b_offset, s_offset, a_shape, b_shape, b_offsets)
            offset = s_offset + _aligned(4 * n)
        if modules is None or set(EXPERT_MODULES) & set(modules):
            self.expert_regions, self.num_bytes = expert_regions(model, self.targets, max_rank, dtype, offset)
        else:
            self.expert_regions, self.num_bytes = {}, offset

    def entry_layout(self, spec: AdapterSpec) -> SlotLayout:
        """The layout of `spec`'s host-cache entry: this layout cut to the adapter's own size, its rank (the largest
        of its modules') and the projections it adapts (a fused projection whole, if it adapts one of its modules;
        the expert regions if it adapts experts). lora/expansion.py writes an entry into a slot of this layout."""
        key = (spec.rank, frozenset(spec.target_modules))
        layout = self._entry_layouts.get(key)
        if layout is None:
            layout = self._entry_layouts[key] = SlotLayout(self.model, spec.rank, self.dtype, spec.target_modules)
        return layout

    def views(self, slots: torch.Tensor) -> dict[tuple[int, str], LoRAWeights]:
        """Per-projection weights over `slots` ([num_slots, num_bytes] uint8), sharing its storage."""
        def view(offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            size = math.prod(shape) * dtype.itemsize
            return slots[:, offset:offset + size].view(dtype).unflatten(1, shape)

        return {key: LoRAWeights(a=view(r.a_offset, r.a_shape, self.dtype),
                                 b=view(r.b_offset, r.b_shape, self.dtype),
                                 scalings=view(r.scalings_offset, (len(r.slice_offsets) - 1,), torch.float32),
                                 slice_offsets=r.slice_offsets)
                for key, r in self.regions.items()}

    def expert_views(self, slots: torch.Tensor) -> dict[int, MoELoRAWeights]:
        """Per sparse MoE layer, its expert LoRA over `slots` ([num_slots, num_bytes] uint8), sharing its storage."""
        return expert_views(slots, self.expert_regions)

    @torch.no_grad()
    def pack(self, adapter: AdapterBytes, out: torch.Tensor | None = None) -> torch.Tensor:
        """`adapter` as one slot's bytes ([num_bytes] uint8), built by a single concatenation of its
        tensors' bytes, its scalings and zero fill (a few tensor operations in all, whatever the number
        of modules); modules it does not target stay zero.

        A slice of rank r < R is followed by R - r zero rows of lora_A, and its lora_B rows are padded to R
        (fully sharded LoRA: lora_A holds this rank's share of R's rows, already padded by adapter_shards).
        `out`: a [num_bytes] uint8 buffer to write (every byte is written).
        """
        assert adapter.dtype == self.dtype, f"adapter read as {adapter.dtype}, slots hold {self.dtype}"
        parts = [("bytes", m.a) if kind == "a" else ("bytes", self._b_rows(m)) if kind == "b" else
                 ("bytes", pack_expert_layer(m[1], adapter.experts.get(m[0]), adapter.file)) if kind == "experts"
                 else (kind, m) for kind, m in self._parts(adapter.modules)]
        return self._concatenate(parts, out)

    @torch.no_grad()
    def read_packed(self, source: AdapterSource, out: torch.Tensor | None = None,
                    pool: concurrent.futures.Executor | None = None, parts: int = 1) -> torch.Tensor | None:
        """The slot bytes of `source` (adapter.locate_adapter) as `pack` builds them, with the weights read
        from the file straight into place (`packed_plan`, then its `fill`). None when the file stores another dtype
        than the slots' (read_adapter converts it, then pack). `out`: a [num_bytes] uint8 buffer to fill (every byte
        is written). `pool`, `parts`: split the file reads into up to `parts` pieces read side by side on `pool`."""
        plan = self.packed_plan(source)
        return None if plan is None else plan.fill(source.file, out, pool, parts)

    def packed_plan(self, source: AdapterSource) -> PackedPlan | None:
        """Where each byte of `source`'s slot bytes comes from (PackedPlan); None when the file stores another
        dtype than the slots'."""
        if source.dtypes != {self.dtype}:
            return None
        item, R = self.dtype.itemsize, self.max_rank
        reads, padded, zeros, scalings, experts = [], [], [], [], []
        offset = 0
        for kind, value in self._parts(source.modules):
            if kind == "a":
                size = value.rank * value.in_features * item
                reads.append((value.a[0], offset, size))
            elif kind == "b":
                size = value.out_features * R * item
                if value.rank == R:
                    reads.append((value.b[0], offset, size))
                else:
                    padded.append((offset, value.b[0], value.b[1] - value.b[0], value.out_features, value.rank))
            elif kind == "experts":
                layer, region = value
                size = region.num_bytes
                experts.append((region, source.experts.get(layer)))
            elif kind == "scalings":
                size = 4 * len(value)
                scalings.append((offset, np.array(value, dtype=np.float32).view(np.uint8)))
            else:
                size = value
                if size and zeros and zeros[-1][0] + zeros[-1][1] == offset:
                    zeros[-1] = (zeros[-1][0], zeros[-1][1] + size)
                elif size:
                    zeros.append((offset, size))
            offset += size
        return PackedPlan(self, source.spec.rank, tuple(sorted(reads)), tuple(padded), tuple(zeros),
                          tuple(scalings), tuple(experts))

    def _parts(self, modules: dict) -> list[tuple[str, object]]:
        """The slot's bytes in order: ("a", module) its lora_A rows, ("b", module) its lora_B rows padded to R
        columns, ("zeros", count), ("scalings", floats), then ("experts", (layer, ExpertRegion)) per sparse MoE
        layer; modules: (layer, module) -> ModuleBytes or ModuleSource."""
        item, R = self.dtype.itemsize, self.max_rank
        by_slice = {}                       # (layer, projection, slice) -> the module's weights
        for (layer, module), m in modules.items():
            target, s = self.targets.packing(layer, module)
            by_slice[(layer, target.projection, s)] = m
        parts: list[tuple[str, object]] = []
        for (layer, name), region in self.regions.items():
            slices = [by_slice.get((layer, name, s)) for s in range(len(region.slice_offsets) - 1)]
            in_features, out_features = region.a_shape[1], region.b_shape[0]
            a_bytes = region.a_shape[0] // len(slices) * in_features * item    # one slice's lora_A rows
            for m in slices:
                parts += [("zeros", a_bytes)] if m is None else [("a", m), ("zeros", a_bytes - _a_bytes(m))]
            parts.append(("zeros", region.b_offset - region.a_offset - region.a_shape[0] * in_features * item))
            for m, lo, hi in zip(slices, region.slice_offsets, region.slice_offsets[1:]):
                parts.append(("zeros", (hi - lo) * R * item) if m is None else ("b", m))
            parts.append(("zeros", region.scalings_offset - region.b_offset - out_features * R * item))
            parts.append(("scalings", [0.0 if m is None else m.scaling for m in slices]))
            parts.append(("zeros", _aligned(4 * len(slices)) - 4 * len(slices)))
        return parts + [("experts", entry) for entry in self.expert_regions.items()]

    def _b_rows(self, m: ModuleBytes) -> torch.Tensor:
        """lora_B bytes with each row padded to R columns."""
        if m.rank == self.max_rank:
            return m.b
        rows = m.b.view(self.dtype).view(m.out_features, m.rank)
        return F.pad(rows, (0, self.max_rank - m.rank)).view(-1).view(torch.uint8)

    def _concatenate(self, parts: list[tuple[str, object]], out: torch.Tensor | None) -> torch.Tensor:
        zero_counts = [n for kind, n in parts if kind == "zeros"]
        zeros = iter(torch.zeros(sum(zero_counts), dtype=torch.uint8).split(zero_counts))
        values = [v for kind, floats in parts if kind == "scalings" for v in floats]
        scalings = iter(torch.tensor(values, dtype=torch.float32).view(torch.uint8).split(
            [4 * len(floats) for kind, floats in parts if kind == "scalings"]))
        tensors = [part if kind == "bytes" else next(zeros) if kind == "zeros" else next(scalings)
                   for kind, part in parts]
        packed = torch.empty(self.num_bytes, dtype=torch.uint8) if out is None else out
        assert packed.shape == (self.num_bytes,) and packed.dtype == torch.uint8 and packed.is_contiguous()
        return torch.cat(tensors, out=packed)


@dataclass(frozen=True)
class PackedPlan:
    """How an adapter's slot bytes are written from its file (SlotLayout.packed_plan): the file ranges that land in
    place, lora_B of a rank below the layout's read aside and padded, the zeros and the scalings. It depends on the
    adapter's config and safetensors header alone, so one plan serves every adapter whose are the same bytes
    (PackedReader keeps them by those bytes)."""
    layout: SlotLayout                                  # the layout it fills (an entry layout)
    rank: int                                           # the adapter's
    reads: tuple[tuple[int, int, int], ...]             # (file offset, slot offset, bytes), in file order
    padded: tuple[tuple[int, int, int, int, int], ...]  # (slot offset, file offset, bytes, out_features, rank)
    zeros: tuple[tuple[int, int], ...]                  # (slot offset, bytes), runs merged
    scalings: tuple[tuple[int, np.ndarray], ...]        # (slot offset, float32 values as bytes)
    experts: tuple[tuple[object, object], ...]          # (ExpertRegion, ExpertLayerLoRA | None) per sparse layer

    def fill(self, file: Path, out: torch.Tensor | None = None, pool: concurrent.futures.Executor | None = None,
             parts: int = 1) -> torch.Tensor:
        """The slot bytes, read from `file`: one scattered read (os.preadv) per file-contiguous run of tensors that
        land in place, no staging copy (lora_B of rank < R, and expert LoRA's, as expert_layout.expert_layer_reads
        says, are read aside and copied into place). The reads release the GIL for their whole length, and the
        Python around them is a few lines per run, so a reader thread barely holds up the step loop."""
        item, R = self.layout.dtype.itemsize, self.layout.max_rank
        packed = torch.empty(self.layout.num_bytes, dtype=torch.uint8) if out is None else out
        assert packed.shape == (self.layout.num_bytes,) and packed.dtype == torch.uint8 and packed.is_contiguous()
        # numpy for the small writes: no GIL hand-offs to the step loop between them (torch ops release
        # the GIL and wait up to a switch interval to get it back); the reads release it for their length
        buf = packed.numpy()
        view = memoryview(buf)
        for offset, size in self.zeros:
            buf[offset:offset + size] = 0
        for offset, values in self.scalings:
            buf[offset:offset + len(values)] = values
        reads = [(at, view[offset:offset + size]) for at, offset, size in self.reads]
        rows = [np.empty(size, dtype=np.uint8) for _, _, size, _, _ in self.padded]
        reads += [(at, memoryview(r)) for (_, at, _, _, _), r in zip(self.padded, rows)]
        copies: list[Callable[[], None]] = []
        for region, found in self.experts:
            copies += expert_layer_reads(buf, region, found, reads)
        with open(file, "rb") as f:
            read_in_parts(f.fileno(), reads, pool, parts)
        for (offset, _, _, out_features, rank), r in zip(self.padded, rows):   # [out, R]: rank columns read
            b = buf[offset:offset + out_features * R * item].reshape(out_features, R * item)
            b[:, :rank * item] = r.reshape(out_features, rank * item)
            b[:, rank * item:] = 0
        _run_all(copies, pool if parts > 1 else None)
        return packed


def _a_bytes(m: ModuleBytes | ModuleSource) -> int:
    """lora_A's bytes: the tensor's (its rank's rows, or a fully sharded rank's share of the slot's rows,
    lora/shards.py), or the file range's (read in the slots' dtype only)."""
    return m.a.numel() if isinstance(m.a, torch.Tensor) else m.a[1] - m.a[0]


def _run_all(calls: list[Callable[[], None]], pool: concurrent.futures.Executor | None) -> None:
    """Run each call, side by side on `pool` when there is one (numpy's large copies release the GIL);
    returns once all have ended, raising the first failure then."""
    if pool is None or len(calls) < 2:
        for call in calls:
            call()
        return
    futures = [pool.submit(call) for call in calls]
    concurrent.futures.wait(futures)        # none may still write into the buffer after this
    for future in futures:
        future.result()


class PackedReader:
    """spec -> HostAdapter: read the directory's config and header again (it may have changed since it was
    registered; checked again unless bytes equal to them were checked before: the plans kept, `_packed_plan`) and
    read it into its entry layout (SlotLayout.entry_layout: its own rank and projections), in a buffer of
    `buffers` (page-locked on CUDA, given back when the entry is gone): straight from the file into place when
    it stores the slots' dtype (PackedPlan.fill), else read, converted and packed. With `read_threads` > 1
    the file reads of one adapter are split across that many threads of the reader's own pool.
    `shard`: a model sharded over tensor-parallel ranks; each adapter is then read whole and cut to this rank's
    share (lora/shards.py) before it is packed."""

    def __init__(self, layout: SlotLayout, buffers: HostBuffers, read_threads: int = 1,
                 shard: nn.Module | None = None):
        self.layout, self.targets, self.buffers = layout, layout.targets, buffers
        self.shard = shard if shard is not None and shard.tp.world_size > 1 else None
        self.read_threads = read_threads
        self.pool = (concurrent.futures.ThreadPoolExecutor(read_threads, thread_name_prefix="lora-io")
                     if read_threads > 1 else None)
        self._plans: collections.OrderedDict[bytes, PackedPlan] = collections.OrderedDict()   # by contents' digest
        self._plans_lock = threading.Lock()

    def entry_bytes(self, spec: AdapterSpec) -> int:
        """The size of `spec`'s host-cache entry."""
        return self.layout.entry_layout(spec).num_bytes

    def prepare(self, spec: AdapterSpec) -> concurrent.futures.Future[torch.Tensor]:
        """A buffer for `spec`'s entry, made now on the buffers' own threads (HostBuffers.prepare)."""
        return self.buffers.prepare(self.entry_bytes(spec))

    def __call__(self, spec: AdapterSpec, out: torch.Tensor | None = None) -> HostAdapter:
        """Read `spec` into `out` (from `prepare`; exchanged if the directory now needs another size) or a buffer
        taken now."""
        try:
            layout, rank, fill = self._plan(spec)
        except BaseException:
            if out is not None:
                self.buffers.give_back(out)
            raise
        return self._entry(layout, rank, out, fill)

    def _plan(self, spec: AdapterSpec) -> tuple[SlotLayout, int, Callable[[torch.Tensor], object]]:
        """(the entry's layout, its rank, what writes it into a buffer), from the directory as it is now."""
        if self.shard is not None:
            from worker.lora.shards import shard_adapter
            adapter = read_adapter(spec.name, spec.path, self.targets, self.layout.max_rank, self.layout.dtype)
            layout = self.layout.entry_layout(adapter.spec)
            return layout, adapter.spec.rank, lambda buffer: layout.pack(shard_adapter(self.shard, adapter), buffer)
        plan = self._packed_plan(spec)
        if plan is None:           # stored in another dtype than the slots': read, converted, packed
            adapter = read_adapter(spec.name, spec.path, self.targets, self.layout.max_rank, self.layout.dtype)
            layout = self.layout.entry_layout(adapter.spec)
            return layout, adapter.spec.rank, lambda buffer: layout.pack(adapter, buffer)
        file = tensor_file(spec.path)

        def fill(buffer: torch.Tensor) -> None:
            try:
                plan.fill(file, buffer, pool=self.pool, parts=self.read_threads)
            except OSError as e:
                raise AdapterError(f"adapter_model.safetensors in {spec.path} is unreadable: {e!r}") from e
        return plan.layout, plan.rank, fill

    def _packed_plan(self, spec: AdapterSpec) -> PackedPlan | None:
        """The plan of `spec`'s directory as it is now: its config and header are read again, and checked again
        unless a directory with the same bytes there was checked and planned before (a thousand adapters trained
        alike share one plan; its checks and planning took ~2 ms of the GIL each, beside the step loop)."""
        contents = read_contents(spec.path)
        digest = hashlib.blake2b(contents.config, digest_size=32)
        digest.update(contents.header)                  # hashlib lets go of the GIL over large inputs
        digest.update(contents.data_size.to_bytes(8, "little"))
        key = digest.digest()
        with self._plans_lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        source = locate_adapter(spec.name, spec.path, self.targets, self.layout.max_rank, contents)
        plan = self.layout.entry_layout(source.spec).packed_plan(source)
        if plan is not None:
            with self._plans_lock:
                self._plans[key] = plan
                while len(self._plans) > MAX_PLANS:
                    self._plans.popitem(last=False)
        return plan

    def _entry(self, layout: SlotLayout, rank: int, out: torch.Tensor | None,
               fill: Callable[[torch.Tensor], object]) -> HostAdapter:
        """The entry `fill` writes in `out`, or in a buffer of the layout's size when `out` is not one (`out` then
        given back; so is the buffer when `fill` fails)."""
        buffer = out
        if buffer is None or buffer.numel() != layout.num_bytes:
            buffer = self.buffers.get(layout.num_bytes)
            if out is not None:
                self.buffers.give_back(out)
        try:
            fill(buffer)
        except BaseException:
            self.buffers.give_back(buffer)
            raise
        packed = buffer[:]           # the entry's own tensor: the buffer goes back once no tier nor copy holds it
        weakref.finalize(packed, self.buffers.give_back, buffer)
        return HostAdapter(packed, rank, layout)
