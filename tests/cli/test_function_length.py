"""The command line's code keeps functions short (none over 60 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenweir

PACKAGE = Path(tokenweir.__file__).parent
FILES = [*sorted((PACKAGE / "cli").glob("*.py")), PACKAGE / "config.py", PACKAGE / "__main__.py"]


def test_no_function_over_60_lines():
    long = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.name}:{node.name} {length}")
    assert len(FILES) > 5 and long == []
