"""--structured-outputs-config: vLLM's JSON fields and checks (vllm/config/structured_outputs.py, vLLM 0.33.0), and
`disable_any_whitespace` compacting every JSON grammar, a named tool call's included, on the demo model: no
whitespace but the one space json.dumps puts after "," and ":" (xgrammar's grammar with any_whitespace=False)."""
from __future__ import annotations

import argparse
import json

import pytest

from gateway.tool_calls import ToolChoice
from tests.structured_cases import SCHEMAS
from worker.config import (CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, StructuredOutputsConfig,
                           WorkerConfig, parse_structured_outputs_config)
from worker.config_flags import add_flags, config_from_flags
from worker.engine import Engine
from worker.ipc.messages import SamplingParams, StructuredOutput

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "array", "items": {"type": "integer"},
                                                                "maxItems": 3}}}}}]


def parse(*argv: str) -> StructuredOutputsConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, WorkerConfig)
    return config_from_flags(WorkerConfig, parser.parse_args(["--model", "m", *argv])).structured_outputs


def test_the_flag_takes_vllms_json():
    assert parse() == StructuredOutputsConfig()
    assert parse("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}') == \
        StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)


@pytest.mark.parametrize("text, message", [
    ('{"disable_any_whitespace": true}', "disable_any_whitespace is only supported for xgrammar and guidance "
                                         "backends."),
    ('{"backend": "guidance"}', "backend 'guidance' is not available"),
    ('{"backend": "xgrammar", "disable_additional_properties": true}',
     "disable_additional_properties is only supported for the guidance backend."),
    ('{"reasoning_parser": "deepseek_r1"}', "reasoning parsers are not supported"),
    ('{"any_whitespace": false}', "Unknown --structured-outputs-config field(s) any_whitespace"),
    ('{"disable_any_whitespace": "yes"}', "field disable_any_whitespace takes a bool, got 'yes'"),
    ('["xgrammar"]', "takes a JSON object"),
    ("{backend: xgrammar}", "Invalid JSON for --structured-outputs-config"),
])
def test_a_bad_config_is_refused_saying_what_is_wrong(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse_structured_outputs_config(text)
    assert message in str(refused.value)


@pytest.fixture(scope="module")
def compact_engine(demo):
    return Engine(WorkerConfig(ModelConfig(str(demo.model_dir)),
                               cache=CacheConfig(block_size=4, num_gpu_blocks_override=512),
                               lora=LoRAConfig(max_loras=2, max_lora_rank=16),
                               scheduler=SchedulerConfig(max_num_seqs=16), device="cpu",
                               structured_outputs=StructuredOutputsConfig(backend="xgrammar",
                                                                          disable_any_whitespace=True)))


def outputs_of(engine: Engine, tokenizer, spec: StructuredOutput, seeds: range) -> list[str]:
    """The texts of one sampled request per seed (temperature 1: the model's whitespace tokens are likely)."""
    for seed in seeds:
        engine.add_request(f"{spec.kind}-{seed}", tokenizer.encode("Answer:").ids,
                           SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured=spec))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(t for t in out.new_token_ids if t not in engine.eos_token_ids)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in tokens.values()]


@pytest.mark.parametrize("spec", [
    StructuredOutput("json", json.dumps(SCHEMAS["nested"])),       # the request leaves any whitespace on
    StructuredOutput("json_object", ""),
    ToolChoice.from_request(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None,
                            auto_enabled=False).constraint()],
    ids=["json_schema", "json_object", "named_tool_call"])
def test_disable_any_whitespace_gives_compact_json_from_every_json_grammar(compact_engine, tokenizer, spec):
    texts = outputs_of(compact_engine, tokenizer, spec, range(6))
    finished = [text for text in texts if _parses(text)]
    assert finished, texts
    for text in finished:     # one line, json.dumps's separators: xgrammar's any_whitespace=False, as vLLM compiles it
        assert text == json.dumps(json.loads(text), ensure_ascii=False), text


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False                 # cut off by max_tokens
    return True
