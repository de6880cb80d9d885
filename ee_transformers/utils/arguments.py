"""Typed configs and the command lines generated from them.

A config is a dataclass whose fields carry `metadata={"help": ...}`, plus `"choices"` for a fixed set of values,
`"min"` / `"max"` (inclusive) or `"above"` / `"below"` (exclusive) for numbers, and `"empty": True` for a list that may
be empty (`--forced ""`: none). `check_fields` validates an instance against its annotations and that metadata (call it
from `__post_init__`, then check what relates fields to each other), raising a `ValueError` that names the field and
what is allowed. `add_config_arguments` turns the fields into flags (`batch_sizes: list[int]` -> `--batch-sizes 1,8`,
`sweep: bool` -> `--sweep / --no-sweep`) and `config_from_args` builds the config back, so a setting is declared,
documented and validated in one place.
"""

import argparse
import dataclasses
import types
import typing

__all__ = [
    "ArgumentParser",
    "InputError",
    "add_config_arguments",
    "check_fields",
    "comma_list",
    "config_from_args",
    "flag_names",
    "run_command",
]


class InputError(ValueError):
    """A bad input (an argument, a file, a folder), found before any work: its message is one line that names it."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr, `prog: error: message`, with exit code 2 (no usage block), and
    whose help shows defaults."""

    def __init__(self, *args, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _unwrap(annotation):
    """(base type, element type or None, optional): `list[int] | None` -> (list, int, True)."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else object
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return list, (typing.get_args(annotation) or (object,))[0], optional
    return annotation, None, optional


def _describe(kind, meta) -> str:
    noun = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(kind, kind.__name__)
    if "choices" in meta:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    bounds = [
        f"> {meta['above']}" if "above" in meta else None,
        f">= {meta['min']}" if "min" in meta else None,
        f"<= {meta['max']}" if "max" in meta else None,
        f"< {meta['below']}" if "below" in meta else None,
    ]
    return " ".join([noun, " and ".join(b for b in bounds if b)]).strip()


def _valid(value, kind, meta) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            return False
        if value != value:  # NaN passes no bound
            return False
        return (
            (value > meta["above"] if "above" in meta else True)
            and value >= meta.get("min", value)
            and value <= meta.get("max", value)
            and (value < meta["below"] if "below" in meta else True)
        )
    if kind is str:
        return isinstance(value, str) and ("choices" not in meta or value in meta["choices"])
    return True


def check_fields(config) -> None:
    """Checks each field of a config dataclass against its annotation and metadata; `ValueError` names the field."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind, element, optional = _unwrap(hints[f.name])
        meta = f.metadata
        if value is None:
            if not optional:
                raise ValueError(f"`{f.name}` must be {_describe(kind, meta)}, got None.")
            continue
        if kind is list:
            empty_ok = meta.get("empty", False)
            if (
                not isinstance(value, (list, tuple))
                or not (value or empty_ok)
                or not all(_valid(v, element, meta) for v in value)
            ):
                noun = "a list" if empty_ok else "a non-empty list"
                raise ValueError(f"`{f.name}` must be {noun}, each element {_describe(element, meta)}; got {value!r}.")
        elif not _valid(value, kind, meta):
            raise ValueError(f"`{f.name}` must be {_describe(kind, meta)}, got {value!r}.")


def comma_list(element):
    """argparse `type` for comma-separated values: `comma_list(int)("1,8")` -> `[1, 8]`."""

    def parse(text):
        items = [item.strip() for item in str(text).split(",") if item.strip()]
        try:
            return [element(item) for item in items]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated {element.__name__} values, got {text!r}"
            ) from None

    return parse


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(parser, config_class, skip=(), defaults=None) -> None:
    """One flag per field of `config_class` (except `skip`); a field without a default is a required flag. Defaults
    stay in the dataclass: a flag that is not given is absent from the parsed namespace, and `defaults` (field ->
    value) only changes what the help says and what `config_from_args` fills in."""
    hints = typing.get_type_hints(config_class)
    defaults = defaults or {}
    for f in dataclasses.fields(config_class):
        if f.name in skip or not f.init:
            continue
        kind, element, _ = _unwrap(hints[f.name])
        if f.name in defaults:
            default = defaults[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        help_ = f.metadata.get("help", "")
        if default is not None:  # a None default is explained by the help text itself
            help_ = f"{help_} (default: {shown})" if help_ else f"default: {shown}"
        kwargs = dict(default=argparse.SUPPRESS, help=help_.replace("%", "%%"))
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in defaults:
            kwargs["required"] = True  # a field without a default is a required flag
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is list:
            kwargs["type"] = comma_list(element)
            kwargs["metavar"] = "A,B,..."
        else:
            kwargs["type"] = kind if kind in (int, float, str) else str
            if "choices" in f.metadata:
                kwargs["choices"] = list(f.metadata["choices"])
        parser.add_argument(flag(f.name), **kwargs)


def config_from_args(config_class, args, defaults=None, **values):
    """`config_class` from the flags given in `args` over `defaults`, plus `values`. A bad value raises `InputError`
    naming the flag (`--batch-sizes`) instead of the field."""
    names = [f.name for f in dataclasses.fields(config_class) if f.init]
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    try:
        return config_class(**{**(defaults or {}), **given, **values})
    except ValueError as error:
        raise InputError(flag_names(str(error), config_class)) from None


def flag_names(message: str, config_class) -> str:
    """`message` with the fields of `config_class` it names in backticks (`block_size`) as flags (`--block-size`)."""
    for f in dataclasses.fields(config_class):
        message = message.replace(f"`{f.name}`", f"`{flag(f.name)}`")
    return message


def run_command(parser, run, argv=None) -> int:
    """Parses `argv` and calls `run(args)`; a `ValueError` (an `InputError` or a public function's own argument check)
    ends the command with one line on stderr and exit code 2, not a traceback."""
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except ValueError as error:
        message = " ".join(str(error).split())
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    return 0 if result is None else result
