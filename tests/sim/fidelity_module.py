"""benchmarks/sim_fidelity.py loaded as a module for the tests that drive its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]


def loaded_sim_fidelity(alias: str) -> Iterator:
    """Yields benchmarks/sim_fidelity.py imported under `alias` (registered in sys.modules
    while in use: its dataclasses look their module up there), removed afterwards."""
    spec = importlib.util.spec_from_file_location(alias, ROOT / "benchmarks" / "sim_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[alias]
