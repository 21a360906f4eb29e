"""Command-line flags generated from frozen config dataclasses (tokenweir/config.py).

Every field of a config class becomes one option (or positional): its name gives the spelling
(`max_num_seqs` -> `--max-num-seqs`) and the namespace attribute, its type the conversion, its
default the default, its metadata the help, choices and shape (the keys are listed in
config.py's docstring). No flag is written by hand, so a default lives in one place: the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import typing
from typing import Any, Callable, Iterable, Optional

from tokenweir.config import CONFIG_CLASSES

Field = dataclasses.Field


def field_kind(owner: type, field: Field) -> tuple[Any, bool]:
    """(the value type, whether the field holds a tuple of them): Optional[X] -> X,
    tuple[X, ...] -> X."""
    hint = _type_hints(owner)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and args:
        hint = args[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


@functools.cache
def _type_hints(owner: type) -> dict[str, Any]:
    """typing.get_type_hints(owner), evaluated once per class: it evaluates every annotation
    of the class, so calling it per field cost O(fields^2) (0.35 s of every `tokenweir` start,
    contended, for the 330 fields of all the commands' parsers)."""
    return typing.get_type_hints(owner)


def _converter(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse reports a ValueError from `type` as "invalid NAME value"; this keeps the
    parse function's own message."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def field_choices(field: Field) -> Optional[list[str]]:
    """The values the field declares as the only ones accepted, or None (any value)."""
    if "choices" in field.metadata:
        return list(field.metadata["choices"])
    if "choices_from" in field.metadata:
        module, _, name = field.metadata["choices_from"].partition(":")
        table = getattr(importlib.import_module(module), name)
        return sorted(table) if isinstance(table, dict) else list(table)
    return None


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def help_text(field: Field) -> str:
    """The field's help, "(default: X)" appended unless the help already names a default, the
    flag is a bare switch, or it must be given. (argparse formats help with %, so a literal % is doubled.)"""
    text = field.metadata.get("help", "")
    required = field.metadata.get("nargs") == "+" or field.metadata.get("required")
    if "default:" not in text and not field.metadata.get("switch") and not required:
        text = f"{text} (default: {_show(field.default)})"
    return text.replace("%", "%%")


def namespace_default(field: Field) -> Any:
    """What the namespace holds when the flag is not given: the field default, a tuple as a
    list (what argparse builds when the flag is given)."""
    return list(field.default) if isinstance(field.default, tuple) else field.default


def flag_names(field: Field) -> list[str]:
    if field.metadata.get("positional"):
        return [field.name]
    flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
    return [flag, *field.metadata.get("aliases", ())]


def flag_options(owner: type, field: Field, suppress_default: bool = False) -> dict[str, Any]:
    """The keyword arguments of `add_argument` for one field. `suppress_default`: leave the
    attribute unset when the flag is not given (engine flags: see config.engine_kwargs)."""
    meta = field.metadata
    kind, many = field_kind(owner, field)
    options: dict[str, Any] = {"help": help_text(field), "default": namespace_default(field)}
    if suppress_default:
        options["default"] = argparse.SUPPRESS
    if meta.get("positional"):
        options["nargs"] = "?"
    else:
        options["dest"] = field.name
    if kind is bool:
        options["action"] = "store_true" if meta.get("switch") else argparse.BooleanOptionalAction
        return options
    options["type"] = _converter(meta["parse"]) if "parse" in meta else kind
    if many and meta.get("repeat"):
        options["action"] = "append"  # each use of the flag adds one value
    elif many and "parse" not in meta:
        options["nargs"] = meta.get("nargs", "*")  # one flag, then any number of values
    elif "nargs" in meta:  # e.g. "?" with a const: a flag whose value may be left out
        options["nargs"] = meta["nargs"]
    for key in ("metavar", "required", "const"):
        if key in meta:
            options[key] = meta[key]
    choices = field_choices(field)
    if choices is not None:
        options["choices"] = choices
    return options


def add_config_flags(parser: argparse.ArgumentParser, owner: type, *,
                     suppress_defaults: bool = False, exclude: Iterable[str] = ()) -> None:
    """One flag per field of `owner`, in a help group titled by the class."""
    group = parser.add_argument_group(owner.__name__, _description(owner))
    for field in dataclasses.fields(owner):
        if field.name not in exclude:
            group.add_argument(*flag_names(field),
                               **flag_options(owner, field, suppress_defaults))


def add_engine_flags(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> None:
    """The engine flags: every field of every engine config; one the user does not give stays
    unset, so `config.engine_kwargs(args)` holds exactly the flags given."""
    for owner in CONFIG_CLASSES:
        add_config_flags(parser, owner, suppress_defaults=True, exclude=exclude)


def default_namespace(*owners: type) -> argparse.Namespace:
    """The namespace a command with these configs parses from no flags at all (required
    flags left None): for code that runs a command's function without a command line."""
    return argparse.Namespace(**{f.name: namespace_default(f)
                                 for owner in owners for f in dataclasses.fields(owner)})


def _description(owner: type) -> Optional[str]:
    doc = owner.__dict__.get("__doc__") or ""
    if doc.startswith(owner.__name__ + "("):  # the signature dataclass writes when none is given
        return None
    return doc.strip().splitlines()[0] if doc.strip() else None
