"""tokenweir/malloc_tuning.py: glibc keeps a step's activations instead of mapping them afresh.
Each probe runs in a subprocess (mallopt settings are per process). The effect is probed with
malloc itself: blocks of 1-12 MB allocated, touched and freed in rounds, counting page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc only")

PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    from tokenweir.malloc_tuning import tune_malloc
    print(tune_malloc() if sys.argv[1] == "tune" else None)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def round_faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for mb in (1, 2, 4, 8, 12, 8, 4, 2, 1):
            p = libc.malloc(mb << 20)
            ctypes.memset(p, 1, mb << 20)
            libc.free(p)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(*(round_faults() for _ in range(3)))
""")


def _probe(mode: str, **env: str) -> tuple[str, list[int]]:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                            "TOKENWEIR_MALLOC_TUNING")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, timeout=120, env={**environ, **env}).stdout.split("\n")
    return out[0], [int(x) for x in out[1].split()]


def test_tuned_malloc_reuses_freed_blocks_the_default_maps_afresh():
    applied, tuned = _probe("tune")
    _, plain = _probe("plain")
    assert applied == "True"
    assert plain[0] > 2 * tuned[0]  # probe: by default new sizes are mapped (and faulted) anew
    assert plain[1] > 0  # ... still in the second round, while the threshold adapts
    assert tuned[1] + tuned[2] <= 64  # tuned: after the first round, no fresh pages at all


def test_opt_outs_leave_malloc_alone():
    assert _probe("tune", TOKENWEIR_MALLOC_TUNING="0")[0] == "False"
    assert _probe("tune", MALLOC_TRIM_THRESHOLD_="131072")[0] == "False"  # the user's own
