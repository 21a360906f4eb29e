"""What /proc/cpuinfo says about this CPU, read without torch.

The one place the project reads /proc/cpuinfo: the load cache's prefetch guesses `dtype="auto"`
from it before torch is imported, and the benchmarks print which instruction sets a figure came
from (figures move with AVX2 / AVX-512 / AVX-512 BF16 / AMX). On a machine without the file
(macOS, a container that hides it) the flags are empty and the model name comes from `platform`.
"""
from __future__ import annotations

import functools
import platform

CPUINFO = "/proc/cpuinfo"

# The flags that decide this project's CPU figures, in the order benchmarks print them.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _first_field(name: str) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo, or None."""
    try:
        with open(CPUINFO, encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith(name):
                    key, _, value = line.partition(":")
                    if key.strip() == name:
                        return value.strip()
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    return frozenset((_first_field("flags") or "").split())


def kernel_flags() -> list[str]:
    """The KERNEL_FLAGS this CPU has, in KERNEL_FLAGS' order."""
    flags = cpu_flags()
    return [flag for flag in KERNEL_FLAGS if flag in flags]


def runs_bfloat16_natively() -> bool:
    """AMX tiles or AVX-512 BF16: the test model/loader.py:dtype_choice makes with torch's probes."""
    return bool(cpu_flags() & {"amx_tile", "avx512_bf16"})


def cpu_model() -> str:
    """The CPU's model name ("unknown" where neither /proc/cpuinfo nor platform says)."""
    return _first_field("model name") or platform.processor() or "unknown"
