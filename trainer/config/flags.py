"""The command line's spellings and value types: every spelling `--help` prints is taken, and every
bad value is a one-line `ConfigError` naming the field, the value and the type it needs.

    --max_steps 5   --max-steps 5   --max_steps=5   --max-steps=5     every field, both spellings
    --do_eval false   --no_do_eval   --no-do-eval   --bf16            bools (a bare flag: true)
    --max_steps null                                                   unset: the file's value is dropped
    --config FILE   --config=FILE                                      the file `parse_config` reads
    --max_steps 1e3   ->   max_steps='1e3' is not an integer; write 1000

`build_parser` makes the `HfArgumentParser` (its `--name` / `--name-with-dashes` options, `--no_*` for
bools that default to true) with each value's conversion checked (`FieldKind`); `argparse`'s own
errors (`expected one argument`, a missing required flag) become one `ConfigError` instead of a usage
block and exit (`one_line`, `argument_error`), and `parse_dataclasses` reads the flags with unknown ones
named, each with a hint where one fits (`hints`: another trainer's name for one of ours, a dashed
key, a near miss such as `--max_stpes`). Every entry point parses its flags this way
(`trainer.train`, `.plan`, `.export`, `.translate`, `.evaluate`). Values from the file that YAML
already typed are checked here too (`check_file_value`): `max_steps: 2.5` trained 3 steps before.
"""

from __future__ import annotations

import argparse
import difflib
import math
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
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


def build_parser(
    sections: Sequence[type], usage: str | None = None, description: str | None = None
) -> HfArgumentParser:
    """The `HfArgumentParser` of `sections`, raising `argparse.ArgumentError` instead of exiting,
    with each int / float / bool value's conversion naming the field and the type (`checked`),
    and a bare flag meaning true for `bool | None` fields too (HF gives them no `nargs='?'`)."""
    from transformers import HfArgumentParser

    parser = one_line(HfArgumentParser(sections, usage=usage, description=description))  # type: ignore[arg-type]
    kinds = field_kinds(sections)
    for action in parser._actions:
        kind = kinds.get(action.dest)
        if kind is None or action.nargs == 0:  # --help, --no_* (store_false)
            continue
        if kind.base == "bool" and action.nargs is None:
            action.nargs, action.const = "?", True
        if kind.base in CONVERT and callable(action.type):
            action.type = checked(action.dest, kind.base, action.type)
    return parser


P = typing.TypeVar("P", bound=argparse.ArgumentParser)


def one_line(parser: P) -> P:
    """`parser`, raising instead of printing its usage block and exiting: a bad value or a missing
    argument as `argparse.ArgumentError` (`exit_on_error=False`; `argument_error` makes it one
    line), what argparse reports through `error()` itself (a missing required flag in Python 3.11,
    the checks a caller makes with `parser.error`) as a `ConfigError`. `--help` still prints and exits."""

    def error(message: str) -> typing.NoReturn:
        raise ConfigError(message)

    parser.exit_on_error = False
    parser.error = error  # type: ignore[method-assign]
    return parser


def parse_dataclasses(
    parser: HfArgumentParser, argv: list[str], renames: Mapping[str, str] | None = None
) -> tuple[Any, ...]:
    """`parser.parse_args_into_dataclasses(argv)` (a `build_parser` parser) with every failure one
    `ConfigError`: an unknown flag named with `hints` (`renames`: other trainers' names for ours),
    a bad value by `argument_error`, a dataclass's own check as it raised it.

    Raises:
        ConfigError: `unknown flag(s) ['--max_stpes'] (max_stpes: did you mean max_steps?); see --help ...`.
    """
    flags = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a != "--"]
    spelled = options(parser)
    bad = sorted({f for f in flags if f not in spelled})
    if bad:
        known = sorted({dest for dest in spelled.values() if dest != "help"})
        raise ConfigError(
            f"unknown flag(s) {bad}{hints([b[2:] for b in bad], known, renames or {})}; see --help for valid flags"
        )
    try:
        return tuple(parser.parse_args_into_dataclasses(args=argv))
    except argparse.ArgumentError as e:
        raise argument_error(e) from None
    except ConfigError:
        raise
    except ValueError as e:  # "Some specified arguments are not used" (a stray positional), a field's check
        raise ConfigError(str(e)) from None


def hints(names: Sequence[str], known: Collection[str], renames: Mapping[str, str]) -> str:
    """` (a: use X; b: write max_steps; c: did you mean max_steps?)` for the unknown `names`, either
    spelling (`max-update` is `max_update`): another trainer's name for one of ours (`renames`: name
    -> what to use), a known field spelled with dashes where only underscores are taken (file keys),
    or a near miss of a known field (difflib); "" where none fits."""
    out = []
    for n in names:
        under = n.replace("-", "_")
        if under in renames:
            out.append(f"{n}: use {renames[under]}")
        elif under in known and under != n:
            out.append(f"{n}: write {under}")
        elif close := difflib.get_close_matches(under, list(known), n=1, cutoff=0.8):
            out.append(f"{n}: did you mean {close[0]}?")
    return f" ({'; '.join(out)})" if out else ""


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
    means: unset what the config file set, as `field: null` would in the file, and what a flag
    before it set (the last flag of a field wins, as argparse takes repeated flags: the planner
    writes `--virtual_pipeline_stages null` after the user's flags).

    Args:
        argv: the flags (changed in place).
        valued: option string -> field, for the options that take a value.
    """
    out: set[str] = set()
    kept: list[tuple[str | None, list[str]]] = []  # (the field of a valued option or None, its tokens)
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        field = valued.get(name)
        n = 1
        while not eq and field is not None and i + n < len(argv) and not argv[i + n].startswith("--"):
            n += 1  # its value(s): a list field takes several
        tokens = argv[i : i + n]
        i += n
        given = value if eq else tokens[1] if n == 2 else None
        if field is not None and given == "null":
            out.add(field)
            kept = [k for k in kept if k[0] != field]
        else:
            kept.append((field, tokens))
    argv[:] = [t for _, tokens in kept for t in tokens]
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


def checked(name: str, base: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """`convert` whose failure says `_not_a` (argparse reports an ArgumentTypeError's text as it is)."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            raise argparse.ArgumentTypeError(_not_a(name, text, base)) from None

    return parse


CONVERT = ("int", "float", "bool")
