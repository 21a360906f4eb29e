"""glibc malloc settings for a CPU engine (`tune_malloc`, called when an engine starts on CPU).

A CPU forward allocates and frees activations of megabytes in every layer (a 2048-token step of
SmolLM2-135M: 2.4-12.6 MB tensors). glibc serves such sizes by mmap until its dynamic mmap
threshold has grown past them, and returns freed heap tops to the kernel above a 128 KB trim
threshold, so a thread's first big steps page-fault on fresh memory in every layer. That hit
the served engine hardest: its steps run on the engine thread, whose malloc arena the start-up
warm-up (main thread) never touched. Measured (SmolLM2-135M, bfloat16, 2 threads, AMD EPYC
Zen 5, `tokenweir serve` with 200 requests at once, two runs each way, alternating): without,
the first burst steps took 660 581 878 615 812 806 / 657 589 1019 947 780 ms, then ~600;
with, 615 570 540 551 546 549 / 594 568 557 555 556 566 ms; median TTFT 9.39 / 9.49 s -> 7.54 /
8.36 s, output 727 / 750 -> 778 / 758 tok/s. vLLM gets the same from tcmalloc, which it preloads.

MMAP_THRESHOLD_BYTES is glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): allocations below it come
from the arenas; TRIM_THRESHOLD_BYTES keeps up to that much freed memory in the process (RSS
holds a step's peak instead of faulting it in again next step). Not applied when the user set
MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (glibc reads those itself), off glibc, or
with TOKENWEIR_MALLOC_TUNING=0.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 512 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module doc). Returns
    whether they were set."""
    if (os.environ.get("TOKENWEIR_MALLOC_TUNING", "1") == "0"
            or not sys.platform.startswith("linux")
            or any(name in os.environ for name in USER_SETTINGS)):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
