"""Counting the garbage collector's passes (through gc.callbacks), for the tests of when it
runs (tests/engine/test_startup_gc.py, tests/sim/test_gc_resume.py)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def counting_passes() -> Iterator[list[int]]:
    """A list that receives the generation of each collector pass started while the block
    runs; the callback is removed on leaving it."""
    passes: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.callbacks.append(count)
    try:
        yield passes
    finally:
        gc.callbacks.remove(count)
