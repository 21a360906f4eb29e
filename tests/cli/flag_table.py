"""Describe every flag of every `tokenweir` subcommand as plain data, to compare parsers.

Run as a script to (re)write the recording the test compares against:
    PYTHONPATH=. .venv/bin/python tests/cli/flag_table.py --record
The recording was first made on the commit before the `tokenweir/cli/` package existed
(b2e2d84), so the test proves the generated parser kept every flag, default and choice.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RECORDING = Path(__file__).parent / "recorded_flags.json"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def walk(parser: argparse.ArgumentParser, prog: str = "tokenweir"):
    """(command path, parser) for every parser that has no subcommands of its own."""
    children = _subparsers(parser)
    if not children:
        yield prog, parser
    for name, child in children.items():
        yield from walk(child, f"{prog} {name}")


def _type_name(kind) -> str | None:
    return None if kind is None else getattr(kind, "__name__", repr(kind))


def describe(action: argparse.Action) -> dict:
    return {"dest": action.dest, "default": repr(action.default),
            "choices": None if action.choices is None else [str(c) for c in action.choices],
            "nargs": action.nargs, "required": action.required, "type": _type_name(action.type),
            "action": type(action).__name__, "metavar": action.metavar,
            "help": action.help or ""}


def flag_table(parser: argparse.ArgumentParser) -> dict[str, dict[str, dict]]:
    """{"tokenweir simulate": {"--num-requests": {...}, ...}, ...}; a positional is keyed by
    its dest, an option by its first spelling (the others are listed under "aliases")."""
    table = {}
    for prog, leaf in walk(parser):
        flags = {}
        for action in leaf._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            key = action.option_strings[0] if action.option_strings else action.dest
            flags[key] = {**describe(action), "aliases": list(action.option_strings)}
        table[prog] = flags
    return table


def main() -> int:
    from tokenweir.cli import build_parser

    table = flag_table(build_parser())
    if "--record" in sys.argv:
        RECORDING.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {RECORDING}")
    else:
        print(json.dumps(table, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
