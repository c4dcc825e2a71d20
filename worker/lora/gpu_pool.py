"""Device memory for adapters: `max_loras` slots, each one contiguous buffer sized to `max_lora_rank`.

Owned by the model runner. Slot assignment is decided elsewhere (the scheduler's slot table); this
pool copies a packed adapter (host_cache.HostAdapter, already in the slot's byte layout) into a slot
with one copy, on a dedicated stream on CUDA, and keeps the per-slot ranks.

A slot's bytes hold, for every layer and fused projection in turn, the A matrices, the B matrices and
the per-slice scalings; each projection's LoRAWeights are strided views across all slots:

    slot s: [ L0.qkv: A | B | scalings ][ L0.o_proj: A | B | scalings ] ... [ Ln.down_proj: ... ]
    LoRAWeights.a of L0.qkv = slots[:, a_offset : a_offset + a_bytes] viewed as [num_slots, 3 * R, hidden]
"""
from __future__ import annotations

import concurrent.futures
import math
import os
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.linear import LoRAWeights
from worker.lora.adapter import AdapterBytes, AdapterSource, ModuleBytes, ModuleSource

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_ALIGN = 256        # bytes; every region starts aligned (kernels specialise on 16-byte alignment)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024   # buffers per os.preadv
MIN_PART_BYTES = 4 << 20     # a read is split across threads in parts of at least this many bytes


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def read_scattered(fd: int, reads: list[tuple[int, memoryview]]) -> None:
    """Fill each (file offset, buffer) of `reads` from the file: one os.preadv per run of buffers whose
    file ranges follow each other (at most IOV_MAX buffers), going on after short reads."""
    reads = sorted(reads, key=lambda r: r[0])
    i = 0
    while i < len(reads):
        start, buffers = reads[i][0], []
        end = start
        while i < len(reads) and reads[i][0] == end and len(buffers) < _IOV_MAX:
            buffers.append(reads[i][1])
            end += len(reads[i][1])
            i += 1
        while start < end:
            done = os.preadv(fd, buffers, start)
            if done == 0:
                raise OSError(f"the file ended at byte {start}, before {end}")
            start += done
            while buffers and done >= len(buffers[0]):
                done -= len(buffers[0])
                buffers.pop(0)
            if done:
                buffers[0] = buffers[0][done:]


def split_reads(reads: list[tuple[int, memoryview]], parts: int,
                min_bytes: int | None = None) -> list[list[tuple[int, memoryview]]]:
    """`reads` (file offset, buffer) in file order, cut into at most `parts` groups of about equal bytes
    (none under `min_bytes` unless it is the only one); a buffer that crosses a cut is cut in two."""
    reads = sorted(reads, key=lambda r: r[0])
    total = sum(len(buffer) for _, buffer in reads)
    parts = max(1, min(parts, total // max(1, MIN_PART_BYTES if min_bytes is None else min_bytes)))
    ends = [(g + 1) * total // parts for g in range(parts)]       # the cut after each group, in bytes
    groups: list[list[tuple[int, memoryview]]] = [[] for _ in range(parts)]
    done = g = 0
    for offset, buffer in reads:
        while len(buffer):
            while done >= ends[g]:
                g += 1
            take = min(len(buffer), ends[g] - done)
            groups[g].append((offset, buffer[:take]))
            offset, buffer, done = offset + take, buffer[take:], done + take
    return [group for group in groups if group]


def read_in_parts(fd: int, reads: list[tuple[int, memoryview]], pool: concurrent.futures.Executor | None,
                  parts: int) -> None:
    """read_scattered, with the bytes split into `parts` groups read side by side on `pool`'s threads
    (page-cache copies run at a few GB/s per thread). Returns once every part has ended; raises the
    first failure then."""
    groups = split_reads(reads, parts) if pool is not None and parts > 1 else [reads]
    if len(groups) <= 1:
        read_scattered(fd, reads)
        return
    futures = [pool.submit(read_scattered, fd, group) for group in groups]
    concurrent.futures.wait(futures)        # none may still write into the buffer, nor use fd, after this
    for future in futures:
        future.result()


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
    """The byte layout of one adapter slot; `pack` writes an adapter in it, `views` reads it back."""

    def __init__(self, model: nn.Module, max_rank: int, dtype: torch.dtype):
        self.max_rank, self.dtype = max_rank, dtype
        self.targets = model.lora_targets          # LoRA target module -> (fused projection, slice)
        item = dtype.itemsize
        self.regions: dict[tuple[int, str], _Region] = {}
        offset = 0
        for layer in range(model.cfg.num_layers):
            for name in _PROJECTIONS:
                proj = model.projection(layer, name)
                n = len(proj.output_sizes)
                a_shape, b_shape = (n * max_rank, proj.in_features), (proj.slice_offsets[-1], max_rank)
                b_offset = offset + _aligned(a_shape[0] * a_shape[1] * item)
                s_offset = b_offset + _aligned(b_shape[0] * b_shape[1] * item)
                self.regions[(layer, name)] = _Region(offset, b_offset, s_offset, a_shape, b_shape,
                                                      tuple(proj.slice_offsets))
                offset = s_offset + _aligned(4 * n)
        self.num_bytes = offset

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

    @torch.no_grad()
    def pack(self, adapter: AdapterBytes, pin: bool) -> torch.Tensor:
        """`adapter` as one slot's bytes ([num_bytes] uint8), built by a single concatenation of its
        tensors' bytes, its scalings and zero fill (a few tensor operations in all, whatever the number
        of modules); modules it does not target stay zero.

        A slice of rank r < R is followed by R - r zero rows of lora_A, and its lora_B rows are padded to R.
        """
        assert adapter.dtype == self.dtype, f"adapter read as {adapter.dtype}, slots hold {self.dtype}"
        parts = [("bytes", m.a) if kind == "a" else ("bytes", self._b_rows(m)) if kind == "b" else (kind, m)
                 for kind, m in self._parts(adapter.modules)]
        return self._concatenate(parts, pin)

    @torch.no_grad()
    def read_packed(self, source: AdapterSource, pin: bool, out: torch.Tensor | None = None,
                    pool: concurrent.futures.Executor | None = None, parts: int = 1) -> torch.Tensor | None:
        """The slot bytes of `source` (adapter.locate_adapter) as `pack` builds them, with the weights read
        from the file straight into place: one scattered read (os.preadv) per file-contiguous run of
        tensors, no staging copy. None when the file stores another dtype than the slots' (read_adapter
        converts it, then pack). The reads release the GIL for their whole length, so a reader thread
        barely holds up the step loop. `out`: a [num_bytes] uint8 buffer to fill (every byte is written).
        `pool`, `parts`: split the file reads into up to `parts` pieces read side by side on `pool`.
        """
        if source.dtypes != {self.dtype}:
            return None
        item, R = self.dtype.itemsize, self.max_rank
        packed = torch.empty(self.num_bytes, dtype=torch.uint8, pin_memory=pin) if out is None else out
        assert packed.shape == (self.num_bytes,) and packed.dtype == torch.uint8 and packed.is_contiguous()
        # numpy for the small writes: no GIL hand-offs to the step loop between them (torch ops release
        # the GIL and wait up to a switch interval to get it back); the reads release it for their length
        buf = packed.numpy()
        view = memoryview(buf)
        reads: list[tuple[int, memoryview]] = []          # (file offset, destination)
        padded: list[tuple[int, ModuleSource, np.ndarray]] = []   # B rows of rank < R, read aside
        offset = 0
        for kind, value in self._parts(source.modules):
            if kind == "a":
                size = value.rank * value.in_features * item
                reads.append((value.a[0], view[offset:offset + size]))
            elif kind == "b":
                size = value.out_features * R * item
                if value.rank == R:
                    reads.append((value.b[0], view[offset:offset + size]))
                else:
                    rows = np.empty(value.b[1] - value.b[0], dtype=np.uint8)
                    reads.append((value.b[0], memoryview(rows)))
                    padded.append((offset, value, rows))
            elif kind == "scalings":
                size = 4 * len(value)
                buf[offset:offset + size] = np.array(value, dtype=np.float32).view(np.uint8)
            else:
                size = value
                buf[offset:offset + size] = 0
            offset += size
        with open(source.file, "rb") as f:
            read_in_parts(f.fileno(), reads, pool, parts)
        for offset, m, rows in padded:     # [out, R] rows of bytes: the first rank columns read, the rest zero
            b = buf[offset:offset + m.out_features * R * item].reshape(m.out_features, R * item)
            b[:, :m.rank * item] = rows.reshape(m.out_features, m.rank * item)
            b[:, m.rank * item:] = 0
        return packed

    def _parts(self, modules: dict) -> list[tuple[str, object]]:
        """The slot's bytes in order: ("a", module) its lora_A rows, ("b", module) its lora_B rows padded to R
        columns, ("zeros", count), ("scalings", floats); modules: (layer, target) -> ModuleBytes or ModuleSource."""
        item, R = self.dtype.itemsize, self.max_rank
        by_slice = {(layer, *self.targets[target]): m for (layer, target), m in modules.items()}
        parts: list[tuple[str, object]] = []
        for (layer, name), region in self.regions.items():
            slices = [by_slice.get((layer, name, s)) for s in range(len(region.slice_offsets) - 1)]
            in_features, out_features = region.a_shape[1], region.b_shape[0]
            for m in slices:
                parts += ([("zeros", R * in_features * item)] if m is None else
                          [("a", m), ("zeros", (R - m.rank) * in_features * item)])
            parts.append(("zeros", region.b_offset - region.a_offset - region.a_shape[0] * in_features * item))
            for m, lo, hi in zip(slices, region.slice_offsets, region.slice_offsets[1:]):
                parts.append(("zeros", (hi - lo) * R * item) if m is None else ("b", m))
            parts.append(("zeros", region.scalings_offset - region.b_offset - out_features * R * item))
            parts.append(("scalings", [0.0 if m is None else m.scaling for m in slices]))
            parts.append(("zeros", _aligned(4 * len(slices)) - 4 * len(slices)))
        return parts

    def _b_rows(self, m: ModuleBytes) -> torch.Tensor:
        """lora_B bytes with each row padded to R columns."""
        if m.rank == self.max_rank:
            return m.b
        rows = m.b.view(self.dtype).view(m.out_features, m.rank)
        return F.pad(rows, (0, self.max_rank - m.rank)).view(-1).view(torch.uint8)

    def _concatenate(self, parts: list[tuple[str, object]], pin: bool) -> torch.Tensor:
        zero_counts = [n for kind, n in parts if kind == "zeros"]
        zeros = iter(torch.zeros(sum(zero_counts), dtype=torch.uint8).split(zero_counts))
        values = [v for kind, floats in parts if kind == "scalings" for v in floats]
        scalings = iter(torch.tensor(values, dtype=torch.float32).view(torch.uint8).split(
            [4 * len(floats) for kind, floats in parts if kind == "scalings"]))
        tensors = [part if kind == "bytes" else next(zeros) if kind == "zeros" else next(scalings)
                   for kind, part in parts]
        packed = torch.empty(self.num_bytes, dtype=torch.uint8, pin_memory=pin)
        return torch.cat(tensors, out=packed)


@dataclass
class SlotLoad:
    """One host -> slot copy; `done` on CUDA once its end event has completed."""
    slot: int
    key: Hashable                     # the caller's name for what was loaded
    source: torch.Tensor              # the packed host buffer, kept alive until the copy completes
    start: torch.cuda.Event | None    # None on the CPU, where the copy is synchronous
    end: torch.cuda.Event | None
    seconds: float = 0.0              # copy time, known once done

    def done(self) -> bool:
        if self.end is None:
            return True
        if not self.end.query():
            return False
        self.seconds = self.start.elapsed_time(self.end) / 1e3
        return True


class GPULoRAPool:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, side_stream: bool = True):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.layout = SlotLayout(model, max_rank, dtype)
        self.slots = torch.zeros(num_slots, self.layout.num_bytes, dtype=torch.uint8, device=device)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)   # [num_slots]; 0 = empty
        self.ranks_host = [0] * num_slots
        self.weights = self.layout.views(self.slots)
        # LoRA kernels beside the base GEMMs (layers/linear.py); high priority: their few blocks go ahead
        # of the GEMM's when both are ready
        lora_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" and side_stream else None
        for (layer, name), w in self.weights.items():
            w.lora_stream = lora_stream
            model.projection(layer, name).lora = w
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None   # adapter copies only
        self._in_flight: list[SlotLoad] = []          # issue order, which is completion order
        self._unjoined: dict[int, torch.cuda.Event] = {}   # slot -> end of its latest copy
        self._last_use: dict[int, torch.cuda.Event] = {}   # slot -> end of the latest step that read it

    @property
    def num_bytes(self) -> int:
        return self.slots.numel()

    @torch.no_grad()
    def start_load(self, slot: int, packed: torch.Tensor, rank: int, key: Hashable) -> None:
        """Copy `packed` ([num_bytes] uint8, pinned on CUDA) into `slot` without waiting for it.

        The copy waits only for the latest step that read the slot (`record_use`), which may still read
        its previous adapter: it runs beside steps that do not use the slot, such as the one in flight
        when the slot was free. Nothing waits for the copy until `wait_for` names the slot.
        """
        if self._stream is None:
            start = time.perf_counter()
            self.slots[slot].copy_(packed)
            self.ranks[slot] = rank
            self._in_flight.append(SlotLoad(slot, key, packed, None, None, time.perf_counter() - start))
        else:
            used = self._last_use.pop(slot, None)
            if used is not None:
                self._stream.wait_event(used)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                start.record()
                self.slots[slot].copy_(packed, non_blocking=True)
                self.ranks[slot].fill_(rank)
                end.record()
            self._in_flight.append(SlotLoad(slot, key, packed, start, end))
            self._unjoined[slot] = end
        self.ranks_host[slot] = rank

    def finished_loads(self) -> list[SlotLoad]:
        """Loads found complete since the last call, in issue order; never waits."""
        done = 0
        while done < len(self._in_flight) and self._in_flight[done].done():
            done += 1
        finished, self._in_flight = self._in_flight[:done], self._in_flight[done:]
        return finished

    def wait_for(self, slots: Iterable[int]) -> None:
        """Make the compute stream wait for the latest copy into each of `slots` (once per copy)."""
        for slot in slots:
            end = self._unjoined.pop(slot, None)
            if end is not None:
                torch.cuda.current_stream().wait_event(end)

    def record_use(self, slots: Iterable[int]) -> None:
        """The step just enqueued on the compute stream reads `slots`: a later copy into one waits for it."""
        slots = list(slots)
        if self._stream is None or not slots:
            return
        used = torch.cuda.Event()
        used.record()
        for slot in slots:
            self._last_use[slot] = used
