"""`loraplex bench ...` is bench.serve's command line, flags untouched, found through the `loraplex.commands`
entry points (tests/test_dependency_direction.py checks that nothing under gateway/ or worker/ imports bench)."""
from __future__ import annotations

import pytest

from gateway.__main__ import build_parser, main, plugin_commands


def test_bench_subcommand_hands_every_flag_to_bench_serve(capsys):
    main(["bench", "--list-presets"])
    out = capsys.readouterr().out
    assert "sglang-multi-adapter" in out and "server: --max-loras 3" in out


def test_bench_is_an_entry_point_listed_in_the_help(capsys):
    assert plugin_commands()["bench"].value == "bench.serve:main"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "bench" in capsys.readouterr().out

