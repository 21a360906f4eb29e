"""A start-up without the cyclic garbage collector's passes (`tokenweir generate`, `serve`).

Importing torch and building an engine leaves ~270,000 objects the collector tracks. CPython
runs a generation-0 pass every 700 net allocations and rescans the older generations as they
grow, so a start pays for hundreds of passes that find almost nothing: in a warm
`tokenweir generate` (SmolLM2-135M, 2-vCPU, machine shared) 410 passes took 0.97 s, three
full ones 0.15-0.29 s each, and a full pass after the build found 7,164 unreachable objects
(tuples, cells, functions, type aliases of class bodies; no tensor).

`paused()` turns the collector off for the block; on leaving it, every object alive is moved
to the permanent generation (`gc.freeze`: never scanned again, so later passes no longer walk
torch's module graph) and the collector is turned back on, as it was before the block.

Contract: cyclic garbage made inside the block is not collected (it is frozen with the rest):
the few thousand small objects measured above, once per process. Reference counting frees
everything else as usual. Nesting is allowed: only the outermost block freezes and resumes.
TOKENWEIR_STARTUP_GC=1 leaves the collector alone (for A/B runs).
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

_depth = 0


def enabled() -> bool:
    """Whether start-ups pause the collector (TOKENWEIR_STARTUP_GC=1: they do not)."""
    return os.environ.get("TOKENWEIR_STARTUP_GC", "0") != "1"


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No collector passes inside the block; on leaving, freeze what is alive and resume."""
    global _depth
    if not enabled() or _depth:  # off, or inside an outer block (which resumes)
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        gc.freeze()
        if was_enabled:
            gc.enable()
