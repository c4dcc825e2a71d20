"""bench.decode_step's bookkeeping: every ratio compares runs a mode makes, and is given only where both were
made; its request handling through the engine's public methods, on a CPU engine (the timing itself needs a GPU)."""
from __future__ import annotations

import pytest

from bench import decode_step
from worker.config import CacheConfig, KernelConfig, ModelConfig, WorkerConfig


def test_every_ratio_names_runs_that_some_mode_makes():
    made = {f"{mode}_{run}" for mode, runs in decode_step.MODE_RUNS.items() for run in runs}
    assert set(decode_step.MODE_RUNS["graphs"]) == set(decode_step.RUNS)     # the bars' runs
    for name, (num, num_field, den, den_field) in decode_step.RATIOS.items():
        assert num in made and den in made, name
        assert {num_field, den_field} <= {"step_ms_median", "replay_ms", "floor_ms"}, name


def test_each_mode_compared_against_graphs_has_its_ratios():
    """The modes added to compare one setting (nopdl, cublas, inline, sync, eager) each have a ratio against
    the default graphs runs (graphs-large, a batch the others do not run, compares its runs among themselves, and
    graphs-large-inline against it)."""
    for mode in decode_step.MODE_RUNS:
        if mode in ("graphs", "graphs-large"):
            continue
        against = "graphs-large_" if mode.startswith("graphs-large") else "graphs_"
        assert any(num.startswith(mode + "_") and den.startswith(against)
                   for num, _, den, _ in decode_step.RATIOS.values()), mode


def test_the_large_batch_compares_adapters_against_its_own_base_run():
    adapted = {run for run in decode_step.LARGE_RUNS if run != "b256_base"}
    compared = {num.removeprefix("graphs-large_") for num, _, den, _ in decode_step.RATIOS.values()
                if den == "graphs-large_b256_base"}
    assert compared == adapted
    assert len(set(decode_step.LARGE_RUNS["b256_64lora16"][1])) == decode_step.LARGE["max_loras"]


def test_ratios_are_given_only_where_both_runs_were_made():
    runs = {"graphs_b1_base": {"step_ms_median": 6.0, "floor_ms": 5.0, "replay_ms": 5.5},
            "graphs-nopdl_b1_base": {"step_ms_median": 6.6}}
    got = decode_step.ratios(runs)
    assert got == pytest.approx({"b1_base_step_over_floor": 1.2, "b1_base_replay_over_floor": 1.1,
                                 "b1_base_nopdl_over_pdl": 1.1})


def test_each_kernel_mode_is_a_mode_with_a_choice_off():
    for mode, kernels in decode_step.MODE_KERNELS.items():
        assert mode in decode_step.MODE_RUNS and kernels != KernelConfig(), mode


def test_time_decode_times_the_whole_batch_and_leaves_no_request(hf_models):
    """Every request is prefilled before the timed steps, all of them run every timed step, and all are aborted
    after, so the next run may reuse their ids (a CPU engine: no graph, so no replay time)."""
    from tests.hf_fixtures import ADAPTERS, adapter_dir
    from worker.engine import Engine
    engine = Engine(WorkerConfig(ModelConfig(str(hf_models["llama"])), cache=CacheConfig(block_size=4),
                                 device="cpu"))
    engine.add_adapter(ADAPTERS[0].name, str(adapter_dir(hf_models["llama"], ADAPTERS[0].name)))
    for adapters in ([None], [None, ADAPTERS[0].name]):
        result = decode_step.time_decode(engine, 3, adapters, steps=2)
        assert result["batch"] == 3 and result["step_ms_median"] > 0 and "replay_ms" not in result
        assert not engine.has_unfinished()
