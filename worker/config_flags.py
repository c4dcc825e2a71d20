"""Command-line flags declared on the fields of config dataclasses, so that a flag is written once, beside the
field it sets.

    max_loras: int = field(default=4, metadata=flag("--max-loras", type=int, help="adapters resident ..."))

A field with a `flag` is set by it (the keywords are argparse's `add_argument`'s; the parser's default is the
field's); a field whose type is a config dataclass and has no flag of its own takes the flags of that dataclass's
fields; any other field has no flag: an internal setting, which keeps its default. `add_flags` puts a config's
flags on a parser, `config_from_flags` builds the config from what the parser read. Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

_KEY = "flag"


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag."""
    names: tuple[str, ...]                       # the long name first ("--tensor-parallel-size", "-tp")
    options: dict[str, Any]                      # argparse.add_argument's keywords, less `default`
    default_from: Callable[[], Any] | None       # the parser's default, read as the parser is built (an
                                                 # environment variable); None: the field's default

    @property
    def dest(self) -> str:
        """Where argparse puts the value: the long name without its dashes, as argparse names it."""
        return self.names[0].lstrip("-").replace("-", "_")

    @property
    def collects(self) -> bool:
        """The flag reads a list (nargs, append, extend): its parser default is None, its field gets a tuple."""
        return "nargs" in self.options or self.options.get("action") in ("append", "extend")

    def parser_default(self, field_default: Any) -> Any:
        if self.default_from is not None:
            return self.default_from()
        return None if self.collects else field_default

    def field_value(self, parsed: Any, field_default: Any) -> Any:
        if self.collects:
            return field_default if parsed is None else tuple(parsed)
        return parsed


def flag(*names: str, default_from: Callable[[], Any] | None = None, **options: Any) -> dict[str, Flag]:
    """The `metadata` of a field set by the flag `names` (`options`: argparse.add_argument's keywords)."""
    return {_KEY: Flag(names, options, default_from)}


def add_flags(parser: argparse.ArgumentParser, config_type: type, leave_out: tuple[str, ...] = ()) -> None:
    """Add the flags of `config_type`'s fields and of its config dataclasses' fields, in field order, less the
    flags named in `leave_out`."""
    for f, spec, nested in _walk(config_type):
        if nested is not None:
            add_flags(parser, nested, leave_out)
        elif spec is not None and spec.names[0] not in leave_out:
            parser.add_argument(*spec.names, default=spec.parser_default(_default_of(f)), **spec.options)


def config_from_flags(config_type: type, args: argparse.Namespace) -> Any:
    """The `config_type` the flags in `args` describe; fields without a flag keep their defaults."""
    values = {}
    for f, spec, nested in _walk(config_type):
        if nested is not None:
            values[f.name] = config_from_flags(nested, args)
        elif spec is not None:
            values[f.name] = spec.field_value(getattr(args, spec.dest), _default_of(f))
    return config_type(**values)


def positive_int(text: str) -> int:
    """An argparse `type`: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _walk(config_type: type):
    """(field, its Flag or None, the config dataclass it holds when it has no flag, else None) per field. A field
    holding a config dataclass is set by its own flag (`--kernel-config JSON`) or by its fields' flags, not both."""
    hints = get_type_hints(config_type)
    for f in dataclasses.fields(config_type):
        spec = f.metadata.get(_KEY)
        held = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        if spec is not None and held is not None and any(_KEY in g.metadata for g in dataclasses.fields(held)):
            raise TypeError(f"{config_type.__name__}.{f.name} has its own flag {spec.names[0]}, so the flags of "
                            f"{held.__name__}'s fields would never be read; declare one or the other")
        yield f, spec, held if spec is None else None


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
