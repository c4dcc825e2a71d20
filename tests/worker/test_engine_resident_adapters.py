"""Engine.running_adapter_names: what /metrics lists as running_lora_adapters, the adapters resident in a
GPU slot (busy or idle) and those of running requests, as the endpoint picker's LoRA affinity needs."""
from __future__ import annotations

import pytest

from tests.hf_fixtures import ADAPTERS
from tests.worker.test_engine import make_engine, prompt, run_all
from worker.ipc.messages import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture
def engine(hf_models):
    return make_engine(hf_models["llama"])        # two GPU slots, every test adapter registered


def test_an_adapter_stays_listed_while_resident_after_its_requests_finish(engine):
    assert engine.running_adapter_names() == []
    engine.add_request("a", prompt(5), PARAMS, "r8-all")
    run_all(engine)
    assert engine.running_adapter_names() == ["r8-all"]
    assert engine.waiting_adapter_names() == []


def test_an_evicted_or_unloaded_adapter_leaves_the_list(engine):
    names = [spec.name for spec in ADAPTERS[:3]]
    for i, name in enumerate(names):          # three adapters through two slots: the first is evicted
        engine.add_request(f"r{i}", prompt(5, seed=i), PARAMS, name)
        run_all(engine)
    assert engine.running_adapter_names() == sorted(names[1:])
    engine.remove_adapter(names[2])
    assert engine.running_adapter_names() == [names[1]]
