"""`loraplex bench ...` is bench.serve's command line, flags untouched."""
from __future__ import annotations

from gateway.__main__ import main


def test_bench_subcommand_hands_every_flag_to_bench_serve(capsys):
    main(["bench", "--list-presets"])
    out = capsys.readouterr().out
    assert "sglang-multi-adapter" in out and "server: --max-loras 3" in out
