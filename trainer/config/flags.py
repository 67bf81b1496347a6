"""The command line's spellings and value types: every spelling `--help` prints is taken, and every
bad value is a one-line `ConfigError` naming the field, the value and the type it needs.

    --max_steps 5   --max-steps 5   --max_steps=5   --max-steps=5     every field, both spellings
    --do_eval false   --no_do_eval   --no-do-eval   --bf16            bools (a bare flag: true)
    --max_steps null                                                   unset: the file's value is dropped
    --config FILE   --config=FILE                                      the file `parse_config` reads
    --max_steps 1e3   ->   max_steps='1e3' is not an integer; write 1000

`build_parser` makes the `HfArgumentParser` (its `--name` / `--name-with-dashes` options, `--no_*` for
bools that default to true) with each value's conversion checked (`FieldKind`); `argparse`'s own
errors (`expected one argument`) come back as `argparse.ArgumentError`, which `parse_config` turns
into a `ConfigError` (`argument_error`). Values from the file that YAML already typed are checked
here too (`check_file_value`): `max_steps: 2.5` trained 3 steps before.
"""

from __future__ import annotations

import argparse
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from trainer.errors import ConfigError

if typing.TYPE_CHECKING:
    from transformers import HfArgumentParser

BOOL_WORDS = "true/false, yes/no, 1/0"
# Fields whose file value may be a bool besides their type (the HF meaning: true = the latest checkpoint).
BOOL_TOO = ("resume_from_checkpoint",)


@dataclass(frozen=True)
class FieldKind:
    """What a field's value must be: `base` int, float, bool, str, list (of str) or other; `optional`:
    None is a value of it (else `null` unsets it: the default applies)."""

    base: str
    optional: bool


def field_kinds(sections: Sequence[type]) -> dict[str, FieldKind]:
    """Every field of `sections` -> its FieldKind, from the resolved type hints."""
    out = {}
    for cls in sections:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            args = typing.get_args(hints[f.name])
            optional = type(None) in args
            core = [a for a in args if a is not type(None)] if args and optional else [hints[f.name]]
            tp = core[0] if len(core) == 1 else None
            base = "list" if typing.get_origin(tp) is list else getattr(tp, "__name__", "other")
            out[f.name] = FieldKind(
                base if base in ("int", "float", "bool", "str", "list") else "other", optional
            )
    return out


def build_parser(sections: Sequence[type], usage: str, description: str) -> HfArgumentParser:
    """The `HfArgumentParser` of `sections`, raising `argparse.ArgumentError` instead of exiting,
    with each int / float / bool value's conversion naming the field and the type (`_checked`),
    and a bare flag meaning true for `bool | None` fields too (HF gives them no `nargs='?'`)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(sections, usage=usage, description=description, exit_on_error=False)  # type: ignore[arg-type]
    kinds = field_kinds(sections)
    for action in parser._actions:
        kind = kinds.get(action.dest)
        if kind is None or action.nargs == 0:  # --help, --no_* (store_false)
            continue
        if kind.base == "bool" and action.nargs is None:
            action.nargs, action.const = "?", True
        if kind.base in CONVERT and callable(action.type):
            action.type = _checked(action.dest, kind.base, action.type)
    return parser


def options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option string the parser takes (`--max_steps`, `--max-steps`, `--no-do-eval`, `-h`) ->
    its field (dest); those that take a value are the ones `take_nulls` may unset."""
    return {s: a.dest for a in parser._actions for s in a.option_strings}


def takes_value(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings that take a value (not --help, not the --no_* switches)."""
    return {s for a in parser._actions if a.nargs != 0 for s in a.option_strings}


def take_config(argv: list[str]) -> str | None:
    """Remove `--config FILE` / `--config=FILE` from `argv` (in place); returns FILE (None: none given).

    Raises:
        ConfigError: --config without a path, or given twice.
    """
    found: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("--config needs a file path (--config configs/tiny.yaml)")
            found.append(argv[i + 1])
            del argv[i : i + 2]
        elif arg.startswith("--config="):
            found.append(arg.split("=", 1)[1])
            del argv[i]
        else:
            i += 1
    if len(found) > 1:
        raise ConfigError(f"--config given {len(found)} times ({found}); give one file, override with flags")
    if found and not found[0]:
        raise ConfigError("--config needs a file path (--config configs/tiny.yaml)")
    return found[0] if found else None


def take_nulls(argv: list[str], valued: dict[str, str]) -> set[str]:
    """Remove `--field null` / `--field=null` (either spelling) from `argv` (in place); returns the fields.

    argparse would read "null" as the string "null" (or fail on a number); on the command line it
    means: unset what the config file set, as `field: null` would in the file.

    Args:
        argv: the flags (changed in place).
        valued: option string -> field, for the options that take a value.
    """
    out: set[str] = set()
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in valued and eq and value == "null":
            out.add(valued[name])
            del argv[i]
        elif name in valued and not eq and i + 1 < len(argv) and argv[i + 1] == "null":
            out.add(valued[name])
            del argv[i : i + 2]
        else:
            i += 1
    return out


def argument_error(err: argparse.ArgumentError) -> ConfigError:
    """argparse's failure as one line: the checked conversions' own message, else `--flag: message`."""
    flag = (err.argument_name or "").split("/")[0]
    message = err.message
    return ConfigError(message if message.startswith(flag.lstrip("-") + "=") else f"{flag}: {message}")


def check_file_value(name: str, value: Any, kind: FieldKind, where: str) -> Any:
    """A value the config file gave, as the field takes it (a number as a str field's text, list
    items as text); strings are left to the parser, which converts them as it does flags.

    Raises:
        ConfigError: `config file 'X': max_steps=2.5 is not an integer`.
    """
    if isinstance(value, str) or value is None or kind.base == "other":
        return value
    if kind.base == "bool" and isinstance(value, bool):
        return value
    if kind.base == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind.base == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind.base == "str" and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if kind.base == "str" and isinstance(value, bool) and name in BOOL_TOO:
        return value
    if kind.base == "list":
        items = value if isinstance(value, list) else [value]
        if all(isinstance(x, str | int | float) and not isinstance(x, bool) for x in items):
            return [str(x) for x in items]
    raise ConfigError(f"config file {where!r}: {_not_a(name, value, kind.base)}")


def _not_a(name: str, value: Any, base: str) -> str:
    """`max_steps='1e3' is not an integer; write 1000` (the field, the value, the type it needs)."""
    what = {
        "int": "an integer",
        "float": "a number",
        "bool": f"a boolean ({BOOL_WORDS})",
        "str": "a string",
        "list": "a list of strings",
    }[base]
    hint = ""
    if base == "int":
        number = _float(value)
        if number is not None and math.isfinite(number) and number.is_integer():
            hint = f"; write {int(number)}"
    elif base == "str" and isinstance(value, bool):
        hint = " (YAML reads yes/no/on/off as booleans: quote it)"
    return f"{name}={value!r} is not {what}{hint}"


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _checked(name: str, base: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """`convert` whose failure says `_not_a` (argparse reports an ArgumentTypeError's text as it is)."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            raise argparse.ArgumentTypeError(_not_a(name, text, base)) from None

    return parse


CONVERT = ("int", "float", "bool")
