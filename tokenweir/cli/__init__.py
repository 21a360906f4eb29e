"""`tokenweir`: one command line (tokenweir/cli/parser.py), its subcommands as a table
(commands.py), every flag generated from the config dataclasses (flags.py, config.py).

Nothing under tokenweir/server or tokenweir/sim imports this package: the commands' functions
take the parsed namespace and import only config.py.
"""

from tokenweir.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
