"""A refused argument, told in one line: `tokenweir <command>: error: <flag>: <what and the
fix>` on stderr, exit status 2 (argparse's status for a usage error), no traceback. Commands
check what they can before loading anything (engine/preflight.py) and catch what only the load
can find (a pool sized by --kv-cache-space, --swap-space, --quantization on this CPU)."""

from __future__ import annotations

import re
import sys

from tokenweir.config import ENGINE_FIELD_NAMES

USAGE_ERROR = 2


def flag_of(field: str) -> str:
    return "--" + field.replace("_", "-")


def one_line(exc: BaseException, fields: frozenset[str] = ENGINE_FIELD_NAMES) -> str:
    """The refusal as one line, settings spelled as flags: a preflight ConfigError renders
    itself; any other message that starts with a field name gets that field's flag in front
    (config.py and SamplingParams name the field first)."""
    from tokenweir.engine.preflight import ConfigError, flag_spelling

    if isinstance(exc, ConfigError):
        return exc.render(flag_spelling)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return f"{flag_of('model')}: {text}"
    field = re.match(r"[a-z_]+", text)
    if field and field.group(0) in fields:
        return f"{flag_of(field.group(0))}: {text}"
    return text


def refuse(command: str, exc: BaseException,
           fields: frozenset[str] = ENGINE_FIELD_NAMES) -> int:
    """Print the one-line refusal; returns the exit status (2)."""
    print(f"tokenweir {command}: error: {one_line(exc, fields)}", file=sys.stderr, flush=True)
    return USAGE_ERROR
