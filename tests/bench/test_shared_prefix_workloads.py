"""The prefix-caching workloads: each adapter's requests share its own system prompt, user turns are unique,
and the overhead check's prompts share nothing."""
from __future__ import annotations

from collections import defaultdict

import pytest

from bench.presets import PRESETS
from bench.serve import build_parser, workload_from_args
from bench.workloads import Workload, adapter_names

BLOCK = 16      # the server's default block size: prompts that share a full block would share KV


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chat_preset_groups_requests_by_adapter_behind_its_1000_token_system_prompt():
    preset = PRESETS["chat-shared-prefix"]
    requests = preset.workload.requests(seed=0)
    assert len(requests) == 640 and preset.workload.adapters == adapter_names("lora", 32)
    by_adapter = defaultdict(list)
    for spec in requests:
        assert spec.prompt_len == len(spec.prompt) and 1000 + 32 <= spec.prompt_len <= 1000 + 256
        assert 64 <= spec.output_len <= 256
        by_adapter[spec.adapter].append(spec.prompt)
    assert set(by_adapter) == set(adapter_names("lora", 32))
    systems = {adapter: prompts[0][:1000] for adapter, prompts in by_adapter.items()}
    assert len({tuple(s) for s in systems.values()}) == 32                       # one system prompt per adapter
    for adapter, prompts in by_adapter.items():
        assert all(p[:1000] == systems[adapter] for p in prompts)
        turns = [tuple(p[1000:]) for p in prompts]
        assert len(set(turns)) == len(turns)                                     # unique user turns
    assert max(common_prefix(a, b) for a, b in zip(systems.values(), list(systems.values())[1:])) < BLOCK
    assert "--enable-prompt-tokens-details" in preset.server_args and "--max-loras 32" in preset.server_args


def test_no_shared_prefix_preset_shares_no_block_between_prompts():
    preset = PRESETS["chat-no-shared-prefix"]
    requests = preset.workload.requests(seed=0)
    assert len(requests) == 640 and preset.workload.shared_prefix_len == 0
    assert preset.workload.max_concurrency == 64 and preset.workload.adapters == adapter_names("lora", 32)
    assert all(1032 <= spec.prompt_len <= 1256 for spec in requests)
    first_blocks = {tuple(spec.prompt[:BLOCK]) for spec in requests}
    assert len(first_blocks) == len(requests)


def test_system_prompts_are_fixed_by_seed_and_adapter_and_leave_other_draws_alone():
    plain = Workload(num_prompts=20, input_len=(4, 8), adapters=("a", "b"))
    shared = Workload(num_prompts=20, input_len=(4, 8), adapters=("a", "b"), shared_prefix_len=6)
    assert shared.requests(1) == shared.requests(1) and shared.requests(1) != shared.requests(2)
    for p, s in zip(plain.requests(1), shared.requests(1)):
        assert (s.prompt[6:], s.prompt_len - 6, s.output_len, s.adapter) == (p.prompt, p.prompt_len, p.output_len,
                                                                           p.adapter)


def test_base_model_requests_share_their_own_system_prompt():
    specs = Workload(num_prompts=5, input_len=(3, 3), shared_prefix_len=10).requests(0)
    assert all(s.adapter is None and s.prompt[:10] == specs[0].prompt[:10] for s in specs)


def test_shared_prefix_needs_random_prompts():
    with pytest.raises(ValueError, match="shared prefix"):
        Workload(shared_prefix_len=10, dataset_path="x.jsonl")


def test_flag_sets_the_shared_prefix():
    args = build_parser().parse_args(["--preset", "chat-shared-prefix", "--shared-prefix-len", "200"])
    assert workload_from_args(args).shared_prefix_len == 200
    assert workload_from_args(build_parser().parse_args(["--preset", "chat-shared-prefix"])).shared_prefix_len == 1000
