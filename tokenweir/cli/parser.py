"""The one `tokenweir` parser, built from the command table, and the entry point."""

from __future__ import annotations

import argparse
import importlib
from typing import Optional

from tokenweir.cli.commands import COMMANDS, GROUPS, Command
from tokenweir.cli.flags import add_config_flags, add_engine_flags

DESCRIPTION = """\
Command line: `tokenweir generate | serve | bench serve | simulate | sweep | study | calibrate
[flags]`.

Every flag is generated from the config dataclasses (tokenweir/config.py): every field becomes
`--field-name`, with its help text, type, default and choices. Nothing is mirrored by hand.
"""


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error is one line naming the flag (argparse's own message) and where to read
    more, exit status 2; not the whole usage block (generate's runs to 40 lines), above which
    the one line that matters scrolls away. Subcommand parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="tokenweir", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        if len(command.path) == 1:
            siblings = top
        else:
            siblings = groups.get(command.path[0]) or _add_group(top, groups, command.path[0])
        _add_command(siblings.add_parser(command.path[-1], help=command.help,
                                         description=command.help), command)
    return parser


def _add_group(top: argparse._SubParsersAction, groups: dict, name: str):
    group = next(g for g in GROUPS if g.name == name)
    groups[name] = top.add_parser(name, help=group.help).add_subparsers(dest=group.dest,
                                                                        required=True)
    return groups[name]


def _add_command(parser: argparse.ArgumentParser, command: Command) -> None:
    for owner in command.configs:
        add_config_flags(parser, owner)
    if command.engine_flags:
        add_engine_flags(parser, exclude=command.engine_exclude)


def command_of(args: argparse.Namespace) -> Command:
    """The table row a parsed namespace belongs to."""
    path = (args.command,)
    group = next((g for g in GROUPS if g.name == args.command), None)
    if group is not None:
        path += (getattr(args, group.dest),)
    return next(c for c in COMMANDS if c.path == path)


def main(argv: Optional[list[str]] = None) -> int:
    """`tokenweir ...`, `python -m tokenweir ...`: parse, then run the command's function."""
    args = build_parser().parse_args(argv)
    module, _, function = command_of(args).run.partition(":")
    return getattr(importlib.import_module(module), function)(args)
