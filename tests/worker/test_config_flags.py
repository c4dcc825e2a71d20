"""Flags declared on config fields: each flagged field is set by its flag, a config dataclass field takes its own
fields' flags, and a field without a flag keeps its default."""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.config_flags import add_flags, config_from_flags, flag, positive_int


@dataclass(frozen=True)
class Inner:
    rank: int = field(default=16, metadata=flag("--rank", type=int, help="the rank"))
    dirs: tuple[str, ...] = field(default=(), metadata=flag("--dir", action="append"))
    threads: int = 2                      # internal: no flag


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    path: str = field(default="/m", metadata=flag("--path", "-p"))
    names: tuple[str, ...] = field(default=("a",), metadata=flag("--name", nargs="+"))
    eager: bool = field(default=False, metadata=flag("--eager", action="store_true"))
    env: str | None = field(default=None, metadata=flag("--env", default_from=lambda: ENV["value"]))


ENV = {"value": "from-env"}


def parse(argv: list[str], leave_out: tuple[str, ...] = ()) -> tuple[argparse.Namespace, Outer]:
    parser = argparse.ArgumentParser()
    add_flags(parser, Outer, leave_out)
    args = parser.parse_args(argv)
    return args, config_from_flags(Outer, args)


def test_no_flags_give_the_defaults_and_the_default_from_callable():
    assert parse([])[1] == Outer(env="from-env")


def test_each_flag_sets_its_field_and_nested_fields_take_their_flags():
    _, config = parse(["--rank", "8", "--dir", "/a", "--dir", "/b", "-p", "/x", "--name", "b", "c", "--eager",
                       "--env", "e"])
    assert config == Outer(Inner(rank=8, dirs=("/a", "/b")), path="/x", names=("b", "c"), eager=True, env="e")


def test_a_field_without_a_flag_has_no_option_and_keeps_its_default():
    with pytest.raises(SystemExit):
        parse(["--threads", "4"])
    assert parse(["--rank", "4"])[1].inner.threads == 2


def test_default_from_is_read_when_the_parser_is_built():
    ENV["value"] = "later"
    try:
        assert parse([])[1].env == "later"
    finally:
        ENV["value"] = "from-env"


def test_a_left_out_flag_is_not_on_the_parser_and_its_value_comes_from_the_namespace():
    parser = argparse.ArgumentParser()
    add_flags(parser, Outer, leave_out=("--path",))
    with pytest.raises(SystemExit):
        parser.parse_args(["--path", "/y"])
    args = parser.parse_args([])
    args.path = "/set-later"
    assert config_from_flags(Outer, args).path == "/set-later"


@dataclass(frozen=True)
class FlaggedWhole:
    inner: Inner = field(default_factory=Inner, metadata=flag("--inner-json"))


def test_a_config_field_with_its_own_flag_and_flagged_fields_is_refused():
    with pytest.raises(TypeError, match="FlaggedWhole.inner has its own flag --inner-json"):
        add_flags(argparse.ArgumentParser(), FlaggedWhole)


@pytest.mark.parametrize("text, ok", [("1", True), ("3", True), ("0", False), ("-2", False)])
def test_positive_int(text, ok):
    if ok:
        assert positive_int(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="must be at least 1"):
            positive_int(text)


def test_worker_config_fields_without_a_flag_keep_their_defaults():
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    config = config_from_flags(WorkerConfig, parser.parse_args(["--model", "/m", "--max-loras", "3"]))
    assert config.lora.max_loras == 3
    assert config == WorkerConfig(ModelConfig("/m"), lora=config.lora)
    assert (config.mixed_graph_max_tokens, config.scheduler.max_adapter_bypasses, config.lora.lora_load_workers) == \
        (WorkerConfig.mixed_graph_max_tokens, 16, 2)


def test_the_worker_config_and_its_flags_import_no_torch():
    code = "import sys, worker.config, worker.config_flags; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_flag_takes_vllms_names(name):
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    assert config_from_flags(WorkerConfig, parser.parse_args(["--model", "/m"])).cache.kv_cache_dtype == "auto"
    config = config_from_flags(WorkerConfig, parser.parse_args(["--model", "/m", "--kv-cache-dtype", name]))
    assert config.cache.kv_cache_dtype == name


@pytest.mark.parametrize("name", ["fp8_e5m2", "bfloat16", "fp8_inc", "int8", "FP8"])
def test_kv_cache_dtypes_we_lack_are_refused_naming_the_supported_ones(name, capsys):
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/m", "--kv-cache-dtype", name])
    assert f"--kv-cache-dtype {name!r} is not supported; choose auto (the model's dtype), fp8 or fp8_e4m3" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match=f"--kv-cache-dtype '{name}' is not supported"):
        CacheConfig(kv_cache_dtype=name)
