"""Queue-driven prefetch: the prefetcher alone (real slot table and host cache, a recording reader), then
in an engine, where a queued request's adapter is resident before its turn comes."""

import torch

from tests.hf_fixtures import ADAPTERS, adapter_dir
from tests.worker.lora.engine_runs import make_engine
from worker.ipc.messages import SamplingParams
from worker.lora.host_cache import HostAdapter, HostCache
from worker.lora.prefetcher import Prefetcher
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef, Request

REFS = [AdapterRef(f"a{i}", 1) for i in range(8)]


class RecordingReader:
    """Stands in for AdapterReader: remembers which reads were started; they never finish by themselves."""

    def __init__(self):
        self.started: list[AdapterRef] = []

    def start(self, ref):
        self.started.append(ref)

    def entry_bytes(self, ref):
        return 4

    @property
    def num_in_flight(self):
        return len(self.started)


def queue(*adapters) -> list[Request]:
    return [Request(f"r{i}", [1, 2], SamplingParams(), arrival_seq=i, adapter=a) for i, a in enumerate(adapters)]


def on_host(host: HostCache, *refs):
    for ref in refs:
        assert host.reserve(ref)
        host.fill(ref, HostAdapter(torch.zeros(4, dtype=torch.uint8), 4))


def loaded(slots: SlotTable, *refs):
    for ref in refs:
        slots.reserve(ref)
        slots.mark_loaded(ref)


def make(num_slots=2, host_capacity=None, window=8, max_reads=4):
    slots, host, reader = SlotTable(num_slots), HostCache(host_capacity), RecordingReader()
    return Prefetcher(slots, host, reader, window, max_reads), slots, host, reader


def test_adapters_on_the_host_get_slots_in_queue_order_and_others_are_read():
    prefetcher, slots, host, reader = make(num_slots=2)
    on_host(host, REFS[1], REFS[2], REFS[3])
    plan = prefetcher.prefetch(queue(REFS[0], None, REFS[2], REFS[1], REFS[3], REFS[2]))
    assert plan.loads == [(REFS[2], 0), (REFS[1], 1)]
    assert plan.starved == {REFS[3]}
    assert reader.started == [REFS[0]] and REFS[0] in host and not host.is_filled(REFS[0])
    assert slots.is_loading(REFS[2]) and not slots.is_loaded(REFS[2])
    again = prefetcher.prefetch(queue(REFS[0], REFS[2]))     # nothing new to do while loads are in flight
    assert again.loads == [] and reader.started == [REFS[0]]


def test_prefetch_never_evicts_a_running_or_earlier_queued_adapter():
    prefetcher, slots, host, _ = make(num_slots=2)
    loaded(slots, REFS[0], REFS[1])
    slots.acquire(REFS[0])                  # a running request holds REFS[0]
    on_host(host, REFS[2], REFS[3])
    plan = prefetcher.prefetch(queue(REFS[1], REFS[2]))
    assert plan.loads == [] and plan.starved == {REFS[2]}
    assert slots.slot_of(REFS[1]) == 1 and slots.slot_of(REFS[0]) == 0
    plan = prefetcher.prefetch(queue(REFS[2], REFS[1]))     # now REFS[1] is queued later: it may go
    assert plan.loads == [(REFS[2], 1)] and slots.slot_of(REFS[1]) is None


def test_the_adapter_needed_latest_is_evicted_first():
    prefetcher, slots, host, _ = make(num_slots=3)
    loaded(slots, REFS[0], REFS[1], REFS[2])
    on_host(host, REFS[3])
    plan = prefetcher.prefetch(queue(REFS[3], REFS[0], REFS[2], REFS[1]))
    assert plan.loads == [(REFS[3], 1)]      # REFS[1] is needed last of the three
    assert [slots.slot_of(r) for r in REFS[:3]] == [0, None, 2]


def test_a_slot_still_loading_is_never_taken():
    prefetcher, slots, host, _ = make(num_slots=1)
    slots.reserve(REFS[0])
    on_host(host, REFS[1])
    assert prefetcher.prefetch(queue(REFS[1])).starved == {REFS[1]}
    slots.mark_loaded(REFS[0])
    assert prefetcher.prefetch(queue(REFS[1])).loads == [(REFS[1], 0)]


def test_host_reads_stop_at_max_reads_and_never_evict_earlier_queued_entries():
    prefetcher, slots, host, reader = make(num_slots=1, host_capacity=2, max_reads=8)
    on_host(host, REFS[0])
    loaded(slots, REFS[0])
    prefetcher.prefetch(queue(REFS[0], REFS[1], REFS[2], REFS[3]))
    assert reader.started == [REFS[1]]      # the host holds REFS[0] (queued first) and REFS[1]: full
    prefetcher, _, host, reader = make(host_capacity=None, max_reads=2)
    prefetcher.prefetch(queue(*REFS[:5]))
    assert reader.started == REFS[:2]


def test_window_bounds_how_far_the_queue_is_read():
    prefetcher, _, _, reader = make(window=3, max_reads=8)
    prefetcher.prefetch(queue(REFS[0], REFS[0], None, REFS[1], REFS[2], REFS[3], REFS[4]))
    assert reader.started == REFS[:3]


def test_queued_adapter_is_on_the_gpu_before_its_turn(llama):
    """One request runs at a time; the next one's adapter loads meanwhile, and it starts the very next
    step after the first finishes, with no load in between."""
    first, second = ADAPTERS[0].name, ADAPTERS[1].name
    # reads run inline, finishing when started: the steps are deterministic
    engine = make_engine(llama, {name: str(adapter_dir(llama, name)) for name in (first, second)}, max_loras=2,
                         max_num_seqs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], greedy, first)
    engine.add_request("b", [8, 9], greedy, second)
    loads = []
    pool = engine.adapters.pool
    load = pool.start_load
    pool.start_load = lambda slot, packed, rank, key, layout=None: (loads.append(key.name),
                                                                    load(slot, packed, rank, key, layout))
    steps, finished_a = [], None
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step()}
        steps.append(dict(outs))
        if "a" in outs and outs["a"].finish_reason and finished_a is None:
            finished_a = len(steps) - 1
            assert {s.name: s.residency for s in engine.adapter_states()}[second] == "gpu"
    assert loads == [first, second]
    assert "b" in steps[finished_a + 1] and len(steps) == finished_a + 1 + 6
