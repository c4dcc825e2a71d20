"""The scheduler with prefix caching, against a model of what every KV block holds.

The model records, for each position a step computes, the adapter version and every token up to it (what
the K/V there depend on). Each scheduled step must read only positions that hold exactly its own request's
tokens under its own adapter version: a hit on another adapter's, another version's or an evicted block fails.
"""
import random

import pytest

from worker.config import SchedulerConfig
from worker.ipc.messages import SamplingParams
from worker.kv_cache.block_allocator import BlockAllocator
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef, Request, RequestStatus
from worker.scheduler.scheduler import Scheduler

A1, A2, B = AdapterRef("a", 1), AdapterRef("a", 2), AdapterRef("b", 3)


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_num_seqs=8, enabled=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, BlockAllocator(num_blocks, block_size), SlotTable(3), enable_prefix_caching=enabled)


def make_request(i, prompt, max_tokens, adapter=None, prompt_logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return Request(f"r{i}", list(prompt), params, arrival_seq=i, adapter=adapter)


def true_token(request, k):
    """The k-th output of `request` (known to the model even while it is pending on the host)."""
    return 1000 * (request.arrival_seq + 1) + k


class KVModel:
    """Runs schedule / launched / tokens_arrived (synchronously, or with one step in flight) and checks reads."""

    def __init__(self, scheduler, in_flight: bool):
        self.scheduler = scheduler
        self.in_flight = in_flight
        self.kv: dict[int, dict[int, tuple]] = {}    # block -> offset -> (adapter, tokens up to the position)
        self.pending = None                           # (batch, sampled) launched, tokens not filed
        self.starts: dict[str, list[int]] = {}        # request id -> start of each of its steps

    def context(self, request, position):
        tokens = request.prompt_token_ids + [true_token(request, k) for k in range(position + 1)]
        return request.adapter, tuple(tokens[:position + 1])

    def step(self):
        scheduler, size = self.scheduler, self.scheduler.blocks.block_size
        batch = scheduler.schedule()
        sampled = []
        for seq in batch.seqs:
            request = seq.request
            self.starts.setdefault(request.request_id, []).append(seq.start)
            for p in range(seq.start):
                assert self.kv[request.block_ids[p // size]][p % size] == self.context(request, p), \
                    f"{request.request_id} reads a block that does not hold its prefix at position {p}"
            for p in range(seq.start, seq.start + seq.num_new_tokens):
                self.kv.setdefault(request.block_ids[p // size], {})[p % size] = self.context(request, p)
            if seq.samples:
                sampled.append(true_token(request, request.num_generated))
        scheduler.launched(batch)
        if self.pending is not None:
            scheduler.tokens_arrived(*self.pending)
            self.pending = None
        if self.in_flight and not batch.is_empty:
            self.pending = (batch, sampled)
        else:
            scheduler.tokens_arrived(batch, sampled)

    def run(self, requests, arrivals_per_step=2, max_steps=5000):
        queue = list(requests)
        for _ in range(max_steps):
            for _ in range(arrivals_per_step):
                if queue:
                    self.scheduler.add_request(queue.pop(0))
            self.step()
            if not queue and not self.scheduler.has_unfinished() and self.pending is None:
                return
        raise AssertionError("requests did not finish")


def test_second_request_starts_after_the_shared_blocks_and_counts_them():
    scheduler = make_scheduler(block_size=4)
    model = KVModel(scheduler, in_flight=False)
    system = list(range(100, 110))
    first, second = make_request(0, system + [1], 2, A1), make_request(1, system + [2, 3], 2, A1)
    model.run([first])
    model.run([second])
    assert model.starts == {"r0": [0, 11], "r1": [8, 12]}
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 8)
    assert (scheduler.blocks.queries, scheduler.blocks.hits) == (11 + 12, 8)


@pytest.mark.parametrize("adapter", [A2, B, None])
def test_prefix_of_adapter_a_is_not_found_by_another_version_adapter_or_the_base(adapter):
    scheduler = make_scheduler()
    model = KVModel(scheduler, in_flight=False)
    prompt = list(range(100, 120))
    model.run([make_request(0, prompt, 2, A1)])
    other = make_request(1, prompt, 2, adapter)
    model.run([other])
    assert other.num_cached_tokens == 0 and model.starts["r1"][0] == 0


def test_prompt_logprobs_request_computes_every_position():
    scheduler = make_scheduler()
    model = KVModel(scheduler, in_flight=False)
    prompt = list(range(100, 120))
    model.run([make_request(0, prompt, 2)])
    scored = make_request(1, prompt, 2, prompt_logprobs=1)
    model.run([scored])
    assert model.starts["r1"][0] == 0 and scored.num_cached_tokens == 0


def test_cached_blocks_free_when_idle_and_evicted_for_new_work():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    model = KVModel(scheduler, in_flight=False)
    model.run([make_request(0, range(100, 120), 4)])     # 24 tokens: 6 blocks, 5 full and cached
    assert scheduler.blocks.num_free == 8 and scheduler.kv_cache_usage == 0.0
    assert scheduler.blocks.num_cached == 5
    model.run([make_request(1, range(200, 228), 4)])     # 32 tokens: every block, the cached ones evicted
    assert scheduler.blocks.num_free == 8


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("in_flight", [False, True])
def test_random_shared_prefix_traffic_reads_only_its_own_kv(seed, in_flight):
    """Shared system prompts over adapters and versions, a small pool (eviction, preemption), chunked
    prefill; with a step in flight, blocks whose last token is pending wait for it."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=rng.choice([15, 24, 40]), block_size=rng.choice([2, 4]),
                               budget=rng.choice([6, 16, 64]), max_num_seqs=rng.choice([2, 4, 8]))
    systems = [list(range(100 * k, 100 * k + rng.randint(3, 14))) for k in range(1, 4)]
    requests = []
    for i in range(30):
        prompt = rng.choice(systems) + [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        requests.append(make_request(i, prompt, rng.randint(1, 8), rng.choice([A1, A2, B, None]),
                                     rng.choice([None] * 5 + [1])))
    model = KVModel(scheduler, in_flight)
    model.run(requests, arrivals_per_step=rng.choice([1, 3]))
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    assert all(r.output_token_ids == [true_token(r, k) for k in range(r.params.max_tokens)] for r in requests)
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks
    assert scheduler.blocks.hits > 0 and sum(r.num_cached_tokens for r in requests) > 0


def test_off_computes_every_prompt_in_full():
    scheduler = make_scheduler(enabled=False)
    model = KVModel(scheduler, in_flight=False)
    prompt = list(range(100, 120))
    model.run([make_request(0, prompt, 2), make_request(1, prompt, 2)], arrivals_per_step=1)
    assert model.starts["r1"][0] == 0 and scheduler.blocks.num_cached == 0
    assert (scheduler.blocks.queries, scheduler.blocks.hits) == (0, 0)


def test_old_versions_blocks_are_never_found_and_leave_when_the_pool_needs_them():
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    model = KVModel(scheduler, in_flight=False)
    prompt = list(range(100, 117))
    model.run([make_request(0, prompt, 2, A1)])              # 4 full blocks cached under version 1
    reloaded = make_request(1, prompt, 2, A2)                 # load_inplace: version 2, same name
    model.run([reloaded])
    assert reloaded.num_cached_tokens == 0 and scheduler.blocks.num_cached == 8
    assert scheduler.blocks.num_free == 10                   # nobody holds the old version's blocks
    model.run([make_request(2, range(300, 338), 2, B)])       # 40 tokens: every block, both versions evicted
    assert scheduler.blocks.num_cached == 9 and all(        # 9 full blocks of the new request alone
        scheduler.blocks.cached_prefix(make_request(3, prompt, 2, ref)) == [] for ref in (A1, A2))
