"""Workloads: prompt lengths, adapter choice distributions, arrival processes, JSONL prompts."""
from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from bench.workloads import (RequestSpec, Workload, adapter_names, arrival_times, choose_adapters, length_range,
                             zipf_weights)

NAMES = ("a", "b", "c", "d")


def test_zipf_weights_are_normalised_power_law():
    assert zipf_weights(3, 1.0) == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert zipf_weights(2, 2.0) == pytest.approx([4 / 5, 1 / 5])
    assert zipf_weights(4, 0.0) == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_zipf_choice_frequencies_follow_power_law(alpha):
    draws = 20_000
    counts = Counter(choose_adapters("zipf", NAMES, draws, random.Random(0), alpha))
    for k, name in enumerate(NAMES):
        expected = 1 / (k + 1) ** alpha / sum(1 / (j + 1) ** alpha for j in range(len(NAMES)))
        sigma = math.sqrt(draws * expected * (1 - expected))
        assert abs(counts[name] - draws * expected) < 4 * sigma, (name, counts)


def test_uniform_choice_frequencies_are_flat():
    draws = 8_000
    counts = Counter(choose_adapters("uniform", NAMES, draws, random.Random(1)))
    sigma = math.sqrt(draws * 0.25 * 0.75)
    assert all(abs(counts[name] - draws / 4) < 4 * sigma for name in NAMES), counts


def test_distinct_choice_cycles_so_consecutive_requests_differ():
    chosen = choose_adapters("distinct", NAMES, 10, random.Random(0))
    assert chosen == ["a", "b", "c", "d", "a", "b", "c", "d", "a", "b"]
    assert all(len(set(chosen[i:i + 4])) == 4 for i in range(7))


def test_identical_choice_uses_the_first_adapter():
    assert choose_adapters("identical", NAMES, 3, random.Random(0)) == ["a", "a", "a"]


@pytest.mark.parametrize("choice", ["identical", "uniform", "distinct", "zipf"])
def test_no_adapter_names_send_everything_to_the_base_model(choice):
    assert choose_adapters(choice, (), 3, random.Random(0)) == [None, None, None]


def test_random_prompts_have_lengths_in_range_and_ids_below_vocab():
    workload = Workload(num_prompts=300, input_len=(3, 9), output_len=(2, 4), vocab_size=50)
    specs = workload.requests(seed=0)
    assert len(specs) == 300
    assert {s.prompt_len for s in specs} == set(range(3, 10))
    assert {s.output_len for s in specs} == {2, 3, 4}
    assert all(len(s.prompt) == s.prompt_len and all(0 <= t < 50 for t in s.prompt) for s in specs)


def test_requests_are_reproducible_from_the_seed():
    workload = Workload(num_prompts=20, input_len=(1, 30), adapters=NAMES, adapter_choice="zipf")
    assert workload.requests(seed=3) == workload.requests(seed=3)
    assert workload.requests(seed=3) != workload.requests(seed=4)


def test_jsonl_prompts_keep_their_max_tokens_and_cycle(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there", "max_tokens": 7}, {"prompt": [5, 6, 7]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    specs = Workload(num_prompts=3, output_len=(4, 4), dataset_path=str(path)).requests(seed=0)
    assert specs == [RequestSpec("hello there", None, 7, None), RequestSpec([5, 6, 7], 3, 4, None),
                     RequestSpec("hello there", None, 7, None)]


@pytest.mark.parametrize("length, ratio, expected", [
    (100, 0.0, (100, 100)), (100, 0.5, (50, 150)), (10, 0.25, (7, 13)), (1, 0.9, (1, 2)),
])
def test_length_range_follows_vllm_range_ratio(length, ratio, expected):
    assert length_range(length, ratio) == expected


def test_adapter_names_match_make_adapters():
    assert adapter_names("lora", 3) == ("lora-0", "lora-1", "lora-2")


@pytest.mark.parametrize("fields, message", [
    ({"input_len": (0, 5)}, "input length"), ({"output_len": (6, 5)}, "output length"),
    ({"adapter_choice": "random"}, "adapter choice"), ({"arrival": "gamma"}, "arrival"),
    ({"request_rate": 0.0}, "request rate"),
])
def test_invalid_workloads_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Workload(**fields)


def test_constant_arrivals_are_evenly_spaced():
    assert arrival_times(5, 4.0, "constant", random.Random(0)) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("arrival", ["poisson", "constant"])
def test_infinite_rate_sends_everything_at_once(arrival):
    assert arrival_times(4, math.inf, arrival, random.Random(0)) == [0.0] * 4


def test_poisson_arrivals_have_exponential_gaps():
    rate, num = 10.0, 20_001
    times = arrival_times(num, rate, "poisson", random.Random(0))
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert times[0] == 0.0 and all(g > 0 for g in gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert std / mean == pytest.approx(1.0, rel=0.05)                      # exponential: CV = 1
    assert sum(g > mean for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)


def test_workload_arrival_times_use_its_rate_and_process():
    workload = Workload(num_prompts=3, request_rate=2.0, arrival="constant")
    assert workload.arrival_times(seed=0) == pytest.approx([0.0, 0.5, 1.0])
