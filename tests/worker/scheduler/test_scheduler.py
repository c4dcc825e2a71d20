import random

import pytest

from worker.config import SchedulerConfig
from worker.ipc.messages import SamplingParams
from worker.kv_cache.block_allocator import BlockAllocator
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef, Request, RequestStatus
from worker.scheduler.scheduler import Scheduler
from tests.worker.lora.slot_refs import refcount

HOT, COLD = AdapterRef("hot", 1), AdapterRef("cold", 1)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_loras=2,
                   max_bypasses=16):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_adapter_bypasses=max_bypasses)
    return Scheduler(config, BlockAllocator(num_blocks, block_size), SlotTable(max_loras))


def make_request(i, prompt_len, max_tokens, adapter=None):
    prompt = [(7 * i + k) % 50 for k in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_seq=i, adapter=adapter)


def run_step(scheduler, batch, sampled):
    """The engine's order for a synchronous step: launched, then the sampled tokens filed."""
    return scheduler.launched(batch) + scheduler.tokens_arrived(batch, sampled)


def fake_token(request):
    """Depends only on the request and how many tokens it already has, so recompute is invisible."""
    return 1000 * (request.arrival_seq + 1) + len(request.output_token_ids)


def expected_outputs(request):
    return [1000 * (request.arrival_seq + 1) + k for k in range(request.params.max_tokens)]


class FakeRunner:
    """Drives schedule, launched and tokens_arrived, and checks every batch against an independent model of the runner:
    the tokens whose K/V it holds per request, and which adapter each GPU slot holds."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.kv: dict[str, list[int]] = {}
        self.gpu_slots: dict[int, AdapterRef] = {}
        self.reported: dict[str, list[int]] = {}
        self.finished: dict[str, Request] = {}
        self.num_preempted = 0

    def step(self):
        batch = self.scheduler.schedule()
        self._check_batch(batch)
        plan = summary(batch)
        sampled = []
        for seq in batch.seqs:
            kv = self.kv.setdefault(seq.request.request_id, [])
            assert seq.start == len(kv), "a step starts right after the cached tokens"
            kv.extend(seq.token_ids)
            assert kv == (seq.request.prompt_token_ids + seq.request.output_token_ids)[:len(kv)]
            assert seq.samples == (len(kv) == seq.request.num_tokens)
            if seq.samples:
                sampled.append(fake_token(seq.request))
        outputs = run_step(self.scheduler, batch, sampled)
        self._record(outputs)
        self._check_ownership()
        return plan, batch, outputs

    def run(self, arrivals=None, max_steps=2000):
        arrivals = arrivals or {}
        last_arrival = max(arrivals, default=0)
        for step in range(max_steps):
            for request in arrivals.get(step, []):
                self.scheduler.add_request(request)
            self.step()
            if step >= last_arrival and not self.scheduler.has_unfinished():
                return step
        raise AssertionError("requests did not finish")

    def _check_batch(self, batch):
        config = self.scheduler.config
        assert batch.num_tokens <= config.max_num_batched_tokens
        assert len(batch.seqs) <= config.max_num_seqs
        assert self.scheduler.num_running <= config.max_num_seqs
        assert len({id(s.request) for s in batch.seqs}) == len(batch.seqs)
        for request in batch.preempted:
            self.kv.pop(request.request_id, None)
            self.num_preempted += 1
            assert request.status is RequestStatus.WAITING and request.block_ids == []
        assert not {id(r) for r in batch.preempted} & {id(s.request) for s in batch.seqs}
        assert len({slot for _, slot in batch.adapter_loads}) == len(batch.adapter_loads)
        for ref, slot in batch.adapter_loads:
            self.gpu_slots[slot] = ref
        for seq in batch.seqs:
            adapter = seq.request.adapter
            expected = -1 if adapter is None else seq.lora_slot
            assert seq.lora_slot == expected and self.gpu_slots.get(seq.lora_slot) == adapter
            block_size = self.scheduler.blocks.block_size
            assert len(seq.request.block_ids) == -(-(seq.start + seq.num_new_tokens) // block_size)
        adapters = {s.request.adapter for s in batch.seqs} - {None}
        assert len(adapters) <= self.scheduler.slots.num_slots

    def _check_ownership(self):
        scheduler = self.scheduler
        owned = [b for r in scheduler.running for b in r.block_ids]
        assert len(set(owned)) == len(owned)
        assert len(owned) + scheduler.blocks.num_free == scheduler.blocks.num_blocks
        assert all(r.block_ids == [] for r in scheduler.waiting)
        refs = {r.adapter for r in scheduler.running + scheduler.waiting} - {None}
        for ref in refs:
            users = sum(r.adapter == ref for r in scheduler.running)
            assert refcount(scheduler.slots, ref) == users

    def _record(self, outputs):
        for request in outputs:
            if request.finish_reason not in ("error", "abort"):
                self.reported.setdefault(request.request_id, []).append(request.output_token_ids[-1])
            if request.is_finished:
                assert request.request_id not in self.finished
                self.finished[request.request_id] = request


def summary(batch):
    """(request id, start, new tokens, samples) per seq; read before the tokens are filed, which changes the requests."""
    return [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in batch.seqs]


def test_requests_join_and_leave_between_steps():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    a, b = make_request(0, 3, 3), make_request(1, 2, 2)
    scheduler.add_request(a)
    plan, batch, outputs = runner.step()
    assert plan == [("r0", 0, 3, True)] and outputs == [a]
    scheduler.add_request(b)
    plan, batch, outputs = runner.step()
    assert plan == [("r0", 3, 1, True), ("r1", 0, 2, True)] and outputs == [a, b]
    plan, batch, outputs = runner.step()
    assert plan == [("r0", 4, 1, True), ("r1", 2, 1, True)] and outputs == [a, b]
    assert a.finish_reason == b.finish_reason == "length"
    assert a.output_token_ids == expected_outputs(a) and b.output_token_ids == expected_outputs(b)
    assert not scheduler.has_unfinished() and scheduler.num_running == 0
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks
    assert scheduler.schedule().is_empty


@pytest.mark.parametrize("prompt_len, budget", [(10, 4), (8, 4), (1, 4), (5, 5), (13, 3)])
def test_chunked_prefill_splits_long_prompt_under_budget(prompt_len, budget):
    scheduler = make_scheduler(budget=budget)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(0, prompt_len, 2))
    starts = list(range(0, prompt_len, budget))
    expected = [("r0", s, min(budget, prompt_len - s), s + budget >= prompt_len) for s in starts]
    expected += [("r0", prompt_len, 1, True)]
    assert [runner.step()[0][0] for _ in expected] == expected
    assert not scheduler.has_unfinished()


def test_waiting_prefill_chunked_to_leftover_budget():
    scheduler = make_scheduler(budget=4)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(0, 6, 2))
    scheduler.add_request(make_request(1, 3, 1))
    steps = [runner.step()[0] for _ in range(3)]
    assert steps == [
        [("r0", 0, 4, False)],
        [("r0", 4, 2, True), ("r1", 0, 2, False)],
        [("r0", 6, 1, True), ("r1", 2, 1, True)],
    ]


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(scheduler)
    for i in range(5):
        scheduler.add_request(make_request(i, 2, 3))
    ids = [[s[0] for s in runner.step()[0]] for _ in range(9)]
    assert ids == [["r0", "r1"]] * 3 + [["r2", "r3"]] * 3 + [["r4"]] * 3
    assert not scheduler.has_unfinished()


def test_head_without_blocks_stops_admission_strict_fcfs():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeRunner(scheduler)
    r0, r1, r2 = make_request(0, 8, 5), make_request(1, 12, 1), make_request(2, 2, 1)
    for request in (r0, r1, r2):
        scheduler.add_request(request)
    plan, _, _ = runner.step()    # r1 needs 3 blocks, 2 are free; r2 would fit but must not jump ahead
    assert plan == [("r0", 0, 8, True)] and scheduler.waiting == [r1, r2]
    runner.run()
    assert r1.output_token_ids == expected_outputs(r1) and r2.output_token_ids == expected_outputs(r2)


def test_adapter_without_free_slot_waits_and_shared_adapter_loads_once():
    scheduler = make_scheduler(max_loras=1)
    runner = FakeRunner(scheduler)
    requests = [make_request(0, 2, 2, HOT), make_request(1, 2, 2, COLD), make_request(2, 2, 2, HOT)]
    for request in requests:
        scheduler.add_request(request)
    plan, batch, _ = runner.step()
    assert [s[0] for s in plan] == ["r0", "r2"]
    assert batch.adapter_loads == [(HOT, 0)] and [s.lora_slot for s in batch.seqs] == [0, 0]
    assert requests[1].num_adapter_bypasses == 1
    plan, batch, _ = runner.step()
    assert batch.adapter_loads == [] and requests[1].status is RequestStatus.WAITING
    plan, batch, _ = runner.step()
    assert plan == [("r1", 0, 2, True)] and batch.adapter_loads == [(COLD, 0)]


def test_kv_exhaustion_preempts_newest_and_it_recomputes_prompt_and_outputs():
    scheduler = make_scheduler(num_blocks=4, block_size=2, budget=16)
    runner = FakeRunner(scheduler)
    r0, r1 = make_request(0, 3, 6), make_request(1, 3, 6)
    scheduler.add_request(r0)
    scheduler.add_request(r1)
    runner.step()
    runner.step()
    plan, batch, _ = runner.step()      # r0 needs a third block; none is free
    assert batch.preempted == [r1] and plan == [("r0", 4, 1, True)]
    assert (r1.num_computed_tokens, r1.num_preemptions, r1.block_ids) == (0, 1, [])
    assert scheduler.waiting == [r1] and scheduler.blocks.num_free == 1
    outputs_before = list(r1.output_token_ids)
    while r1.status is RequestStatus.WAITING:
        plan, batch, _ = runner.step()
    first = next(s for s in batch.seqs if s.request is r1)
    assert first.start == 0 and first.token_ids == r1.prompt_token_ids + outputs_before
    runner.run()
    assert r0.output_token_ids == expected_outputs(r0) and r1.output_token_ids == expected_outputs(r1)


def test_kv_cache_usage_and_preemption_count_follow_the_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=2, budget=16)
    runner = FakeRunner(scheduler)
    r0, r1 = make_request(0, 3, 6), make_request(1, 3, 6)
    scheduler.add_request(r0)
    scheduler.add_request(r1)
    assert (scheduler.kv_cache_usage, scheduler.num_preemptions) == (0.0, 0)
    runner.step()                       # each prompt of 3 takes 2 blocks of 2
    assert scheduler.kv_cache_usage == 1.0
    runner.step()
    runner.step()                       # r0 needs a third block: r1 is preempted, r0 grows into one of its two
    assert (scheduler.kv_cache_usage, scheduler.num_preemptions) == (0.75, 1)
    runner.run()
    assert scheduler.num_preemptions == runner.num_preempted >= 1
    assert scheduler.kv_cache_usage == 0.0


def test_preempted_request_goes_to_front_of_waiting():
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_loras=1)
    runner = FakeRunner(scheduler)
    r0, r1, r2 = make_request(0, 4, 4, HOT), make_request(1, 2, 2, COLD), make_request(2, 4, 4, HOT)
    for request in (r0, r1, r2):
        scheduler.add_request(request)
    plan, _, _ = runner.step()    # r1 waits for the slot; r2 overtakes it
    assert [p[0] for p in plan] == ["r0", "r2"]
    plan, batch, _ = runner.step()
    assert batch.preempted == [r2] and plan == [("r0", 4, 1, True)]
    assert scheduler.waiting == [r2, r1]


def test_newest_request_preempts_itself():
    scheduler = make_scheduler(num_blocks=2, block_size=4, budget=16)
    runner = FakeRunner(scheduler)
    r0, r1 = make_request(0, 2, 2), make_request(1, 4, 3)
    scheduler.add_request(r0)
    scheduler.add_request(r1)
    runner.step()
    plan, batch, _ = runner.step()      # r1 crosses into a second block; it is the newest
    assert batch.preempted == [r1] and plan == [("r0", 2, 1, True)]
    assert r0.is_finished
    plan, batch, _ = runner.step()
    assert plan == [("r1", 0, 5, True)]
    runner.run()
    assert r1.output_token_ids == expected_outputs(r1)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kv_exhaustion_preempts_and_every_request_finishes(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=6, budget=16)
    runner = FakeRunner(scheduler)
    requests = [make_request(i, rng.randint(1, 12), rng.randint(1, 12)) for i in range(30)]
    arrivals = {}
    for request in requests:
        arrivals.setdefault(rng.randrange(20), []).append(request)
    runner.run(arrivals)
    assert runner.num_preempted > 0
    for request in requests:
        assert request.finish_reason == "length"
        assert request.output_token_ids == expected_outputs(request)
        assert runner.reported[request.request_id] == expected_outputs(request)
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks


@pytest.mark.parametrize("max_loras", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_distinct_adapters_never_exceed_slots_in_random_workload(max_loras, seed):
    rng = random.Random(seed)
    adapters = [None] + [AdapterRef(f"a{k}", 1) for k in range(5)] + [AdapterRef("a0", 2)]
    scheduler = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=5, budget=20,
                               max_loras=max_loras, max_bypasses=3)
    runner = FakeRunner(scheduler)
    requests = [make_request(i, rng.randint(1, 20), rng.randint(1, 8), rng.choice(adapters))
                for i in range(40)]
    arrivals = {}
    for request in requests:
        arrivals.setdefault(rng.randrange(30), []).append(request)
    runner.run(arrivals)
    for request in requests:
        assert request.output_token_ids == expected_outputs(request)
    assert all(refcount(scheduler.slots, a) == 0 for a in adapters if a is not None)


def test_abort_running_frees_blocks_and_slot_reference_immediately():
    scheduler = make_scheduler(max_loras=1)
    runner = FakeRunner(scheduler)
    request = make_request(0, 9, 5, HOT)
    scheduler.add_request(request)
    runner.step()
    assert scheduler.blocks.num_free < scheduler.blocks.num_blocks and refcount(scheduler.slots, HOT) == 1
    assert scheduler.abort_request("r0") is request
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks
    assert refcount(scheduler.slots, HOT) == 0 and scheduler.slots.slot_of(HOT) == 0
    assert request.status is RequestStatus.FINISHED and request.finish_reason == "abort"
    assert request.block_ids == [] and scheduler.num_running == 0
    assert scheduler.get_request("r0") is None and not scheduler.has_unfinished()
    assert scheduler.abort_request("r0") is None


def test_failed_adapter_ends_its_requests_and_leaves_the_others_in_the_batch():
    """A blocking load that fails in the step that admitted its requests: they end with "error", leave the
    batch unlaunched, give back their blocks and slot reference, and the slot is free again."""
    scheduler = make_scheduler(max_loras=2, max_num_seqs=2)
    running, other, waiting = make_request(0, 3, 4, HOT), make_request(1, 3, 4), make_request(2, 3, 4, HOT)
    scheduler.add_request(running)
    run_step(scheduler, scheduler.schedule(), [1])
    for request in (other, waiting):        # max_num_seqs 2: the second one waits
        scheduler.add_request(request)
    batch = scheduler.schedule()
    assert [s.request for s in batch.seqs] == [other, running] and scheduler.waiting == [waiting]   # base rows first
    assert scheduler.fail_adapter(HOT, batch) == [running, waiting]
    assert [s.request for s in batch.seqs] == [other]
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason == "error" for r in (running, waiting))
    assert scheduler.waiting == [] and scheduler.running == [other]
    assert scheduler.slots.slot_of(HOT) is None and scheduler.slots.num_used == 0
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks - len(other.block_ids)
    assert run_step(scheduler, batch, [7]) == [other] and other.output_token_ids == [7]


def test_abort_waiting_and_unknown_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    r0, r1 = make_request(0, 2, 2), make_request(1, 2, 2)
    scheduler.add_request(r0)
    scheduler.add_request(r1)
    run_step(scheduler, scheduler.schedule(), [1])
    assert scheduler.abort_request("r1") is r1 and scheduler.num_waiting == 0
    assert r1.finish_reason == "abort" and r1.status is RequestStatus.FINISHED
    assert scheduler.abort_request("nope") is None
    assert scheduler.get_request("r0") is r0


def test_abort_between_schedule_and_filing_is_ignored():
    scheduler = make_scheduler()
    requests = [make_request(i, 2, 4) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler, scheduler.schedule(), [10, 11, 12])
    batch = scheduler.schedule()
    scheduler.abort_request("r1")
    outputs = run_step(scheduler, batch, [20, 21, 22])
    assert outputs == [requests[0], requests[2]]
    assert [r.output_token_ids for r in requests] == [[10, 20], [11], [12, 22]]
    assert requests[0].num_computed_tokens == 3 and requests[1].num_computed_tokens == 2


@pytest.mark.parametrize("max_bypasses", [1, 3, 6])
def test_cold_adapter_behind_hot_stream_is_admitted_within_bound(max_bypasses):
    max_tokens = 4
    scheduler = make_scheduler(max_num_seqs=64, budget=256, num_blocks=256, max_loras=1,
                               max_bypasses=max_bypasses)
    runner = FakeRunner(scheduler)
    cold = make_request(1, 2, 2, COLD)
    arrival = iter(range(2, 10_000))
    scheduler.add_request(make_request(0, 2, max_tokens, HOT))
    runner.step()
    scheduler.add_request(cold)
    hot_ahead = 0
    for step in range(1, 60):
        base = make_request(next(arrival), 2, 1)
        scheduler.add_request(base)
        scheduler.add_request(make_request(next(arrival), 2, max_tokens, HOT))
        plan, batch, _ = runner.step()
        assert ("r%d" % base.arrival_seq, 0, 2, True) in plan, "base-model requests are never held back"
        if cold.status is not RequestStatus.WAITING:
            break
        hot_ahead += sum(start == 0 and rid != "r0" for rid, start, _, _ in plan) - 1
    assert cold.status is RequestStatus.RUNNING and batch.adapter_loads == [(COLD, 0)]
    # each step one base and then one hot request overtake it; both count as bypasses
    assert hot_ahead == max_bypasses // 2
    assert cold.num_adapter_bypasses >= max_bypasses
    assert step <= max_bypasses + max_tokens + 1


def test_only_the_slot_that_frees_soonest_is_drained_for_a_cold_adapter():
    """Two slots busy with a long-running and a short-running adapter; a cold adapter waits past the
    bypass cap. New requests of the long one keep being admitted; those of the short one wait, its
    slot drains, and the cold request takes it."""
    long, short = AdapterRef("long", 1), AdapterRef("short", 1)
    scheduler = make_scheduler(max_num_seqs=64, budget=256, num_blocks=256, max_loras=2, max_bypasses=2)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request(0, 2, 40, long))
    scheduler.add_request(make_request(1, 2, 6, short))
    runner.step()
    cold = make_request(2, 2, 2, COLD)
    scheduler.add_request(cold)
    arrival = iter(range(3, 10_000))
    admitted = {long: 0, short: 0}
    for step in range(30):
        new = {ref: make_request(next(arrival), 2, 3, ref) for ref in (long, short)}
        for request in new.values():
            scheduler.add_request(request)
        runner.step()
        for ref, request in new.items():
            admitted[ref] += request.status is not RequestStatus.WAITING
        if cold.status is not RequestStatus.WAITING:
            break
    assert cold.status is RequestStatus.RUNNING and scheduler.slots.slot_of(short) is None
    assert admitted[long] == step + 1                  # the long adapter's slot never stopped admitting
    assert admitted[short] <= 2                        # the short one's stopped at the cap
    assert step <= 6 + 2                               # drained within the short adapter's remaining tokens


def test_cold_adapter_starves_without_bypass_cap():
    scheduler = make_scheduler(max_num_seqs=64, budget=256, num_blocks=256, max_loras=1,
                               max_bypasses=10**9)
    runner = FakeRunner(scheduler)
    cold = make_request(1, 2, 2, COLD)
    scheduler.add_request(make_request(0, 2, 4, HOT))
    runner.step()
    scheduler.add_request(cold)
    for i in range(2, 60):
        scheduler.add_request(make_request(i, 2, 4, HOT))
        runner.step()
    assert cold.status is RequestStatus.WAITING and cold.num_adapter_bypasses == 58


def test_prompt_larger_than_pool_errors_and_others_continue():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=8)
    runner = FakeRunner(scheduler)
    too_big, exact, small = make_request(0, 17, 2), make_request(1, 16, 1), make_request(2, 5, 3)
    for request in (too_big, exact, small):
        scheduler.add_request(request)
    plan, batch, outputs = runner.step()
    assert too_big in outputs and too_big.finish_reason == "error"
    assert too_big.status is RequestStatus.FINISHED and too_big.output_token_ids == []
    assert plan == [("r1", 0, 8, False)]
    runner.run()
    assert exact.output_token_ids == expected_outputs(exact)
    assert small.output_token_ids == expected_outputs(small)
    assert runner.finished.keys() == {"r0", "r1", "r2"}


def test_duplicate_request_id_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request(0, 2, 2))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request(0, 2, 2))


def test_rows_are_grouped_by_slot_so_each_adapter_is_one_lora_segment():
    """Running requests and admissions of three adapters and the base, interleaved in arrival order, come out
    of schedule() grouped by slot (base first), arrival order kept within a slot."""
    scheduler = make_scheduler(max_loras=3, max_num_seqs=8)
    adapters = [HOT, None, COLD, HOT, None, COLD]
    requests = [make_request(i, 3, 4, a) for i, a in enumerate(adapters)]
    for r in requests[:3]:
        scheduler.add_request(r)
    run_step(scheduler, scheduler.schedule(), [1, 1, 1])
    for r in requests[3:]:
        scheduler.add_request(r)
    batch = scheduler.schedule()
    slots = [s.lora_slot for s in batch.seqs]
    assert slots == sorted(slots) and slots[0] == -1 and len(set(slots)) == 3
    by_slot = {}
    for s in batch.seqs:
        by_slot.setdefault(s.lora_slot, []).append(s.request.arrival_seq)
    assert all(v == sorted(v) for v in by_slot.values()) and sum(map(len, by_slot.values())) == 6
