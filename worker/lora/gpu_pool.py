"""Device memory for adapters: `max_loras` slots, each one contiguous buffer sized to `max_lora_rank`.

Owned by the model runner. Slot assignment is decided elsewhere (the scheduler's slot table); this
pool writes a host-cache entry (host_cache.HostAdapter: the adapter at its own size, in its entry layout,
lora/slot_layout.py) into a slot, on a dedicated stream on CUDA: one host-to-device copy into a staging buffer
the size of a slot, then the strided copies of lora/expansion.py that lay it out in the slot. It keeps the
per-slot ranks. Every projection's `Linear.lora` and every sparse MoE layer's `SparseMoE.lora` are views of
these slots.
"""
from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from worker.lora.expansion import Expansion
from worker.lora.slot_layout import SlotLayout


@dataclass
class SlotLoad:
    """One host -> slot copy; `done` on CUDA once its end event has completed."""
    slot: int
    key: Hashable                     # the caller's name for what was loaded
    source: torch.Tensor              # the entry's host buffer, kept alive until the copy completes
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
        self.expert_weights = self.layout.expert_views(self.slots)     # sparse MoE layer -> MoELoRAWeights
        for layer, w in self.expert_weights.items():
            model.moe_block(layer).lora = w
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None   # adapter copies only
        # an entry's bytes on the device, laid out from there into its slot; reused in the copy stream's order
        self._staging = (torch.empty(self.layout.num_bytes, dtype=torch.uint8, device=device)
                         if self._stream is not None else None)
        self._expansions: dict[SlotLayout, Expansion] = {}   # an entry layout -> how it lands in a slot
        self._in_flight: list[SlotLoad] = []          # issue order, which is completion order
        self._unjoined: dict[int, torch.cuda.Event] = {}   # slot -> end of its latest copy
        self._last_use: dict[int, torch.cuda.Event] = {}   # slot -> end of the latest step that read it

    @property
    def num_bytes(self) -> int:
        """The slots' bytes and the staging buffer's."""
        return self.slots.numel() + (self._staging.numel() if self._staging is not None else 0)

    @torch.no_grad()
    def start_load(self, slot: int, packed: torch.Tensor, rank: int, key: Hashable,
                   layout: SlotLayout | None = None) -> None:
        """Write `packed` ([layout.num_bytes] uint8, page-locked on CUDA), an entry in `layout` (an entry layout of
        this pool's, SlotLayout.entry_layout; None: the slot's own), into `slot` without waiting for it.

        The copy waits only for the latest step that read the slot (`record_use`), which may still read
        its previous adapter: it runs beside steps that do not use the slot, such as the one in flight
        when the slot was free. Nothing waits for the copy until `wait_for` names the slot.
        """
        expansion = self._expansion(layout or self.layout)
        if self._stream is None:
            start = time.perf_counter()
            expansion.apply(packed, self.slots[slot])
            self.ranks[slot] = rank
            self._in_flight.append(SlotLoad(slot, key, packed, None, None, time.perf_counter() - start))
        else:
            used = self._last_use.pop(slot, None)
            if used is not None:
                self._stream.wait_event(used)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                start.record()
                if expansion.whole:
                    self.slots[slot].copy_(packed, non_blocking=True)
                else:
                    staged = self._staging[:packed.numel()]
                    staged.copy_(packed, non_blocking=True)
                    expansion.apply(staged, self.slots[slot])
                self.ranks[slot].fill_(rank)
                end.record()
            self._in_flight.append(SlotLoad(slot, key, packed, start, end))
            self._unjoined[slot] = end
        self.ranks_host[slot] = rank

    def _expansion(self, layout: SlotLayout) -> Expansion:
        expansion = self._expansions.get(layout)
        if expansion is None:
            assert layout is self.layout or layout.model is self.layout.model, "an entry of another model's layout"
            expansion = self._expansions[layout] = Expansion(layout, self.layout)
        return expansion

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
