"""Optional C++ CPU kernels, compiled on first use with the machine's C++ compiler.

`paged_attention_kernel()` returns the in-place paged attention for decodes and prefill chunks
(float32 and bfloat16, one variant per instruction set picked at run time: `cpu_isa()`),
`skinny_linear_kernel()` the few-rows matmul, `packed_linear_kernel()` the packed-weight
matmul (weights packed once by `pack_linear_weight`) and `fused_ops()` the module with the fused layer
ops (see cpu_kernels.cpp for their contracts), or None when they cannot be used: not built yet
and no compiler, the build failed, or `TOKENWEIR_CPU_KERNELS=0`. Callers must keep a pure-torch
path for None. A failed build is reported once (a warning) and not retried in this process.

The build lands in torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions) under a name carrying a hash of every kernel source (the .cpp and the
headers it includes) and of their directory, so an edited header is never served from a stale
build and two checkouts never share (and rebuild) one build directory.

`TOKENWEIR_CPU_ISA=avx2` forces the AVX2 variant on an AVX-512 machine (tests use it to run
both); `TOKENWEIR_CPU_KERNELS=0` forces the torch path everywhere.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
import threading
import time
import warnings
from typing import Any, Optional

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_DIR, "cpu_kernels.cpp")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def kernels_enabled() -> bool:
    return os.environ.get("TOKENWEIR_CPU_KERNELS", "1") != "0"


def cpu_isa() -> str:
    """The instruction-set variant the in-place attention runs here: "avx512bf16" (AVX-512
    whose bfloat16 prefill scores use the BF16 dot-product instruction), "avx512", "avx2", or ""
    (no kernels, or a CPU with none: the torch path). TOKENWEIR_CPU_ISA=avx512 or avx2 forces a
    narrower one ("" where the CPU cannot run the one asked for)."""
    module = _module()
    return "" if module is None else module.cpu_isa()


# What each variant needs of the CPU (for messages), and its floats per vector register.
ISA_NEEDS = {"avx2": "AVX2 + FMA", "avx512": "AVX-512 F/BW/VL/DQ",
             "avx512bf16": "AVX-512 F/BW/VL/DQ + BF16"}


def vector_floats(isa: str) -> int:
    """Floats per vector register of a variant: head_dim must be a multiple of it."""
    return 8 if isa == "avx2" else 16


def paged_attention_kernel() -> Optional[Any]:
    """`f(q, kv_cache, block_tables, query_start_loc, seq_lens, req_ids, scale, out,
    fixed_order=False)`: the in-place paged attention of the listed requests on this CPU's
    widest variant, or None. `fixed_order`: every query row's result the bits a decode at its
    position gets, whatever its chunk or step (batch-invariant mode; paged_attention_impl.h)."""
    isa = cpu_isa()
    if not isa:
        return None
    run = _module().paged_attention

    def paged_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, req_ids, scale,
                        out, fixed_order: bool = False) -> None:
        run(q, kv_cache, block_tables, query_start_loc, seq_lens, req_ids, scale, out, isa,
            fixed_order)

    paged_attention.isa = isa  # type: ignore[attr-defined]
    return paged_attention


def fused_ops() -> Optional[Any]:
    """The compiled module, for its fused layer ops (`add_rmsnorm`, `silu_mul`,
    `rotary_inplace`; contracts in cpu_kernels.cpp), or None."""
    module = _module()
    return module if module is not None and hasattr(module, "add_rmsnorm") else None


def skinny_linear_kernel() -> Optional[Any]:
    """The compiled module's `skinny_linear(x, w) -> x @ w.T`, or None."""
    module = _module()
    return None if module is None else module.skinny_linear


def packed_linear_kernel() -> Optional[Any]:
    """`f(x, packed, n, fixed_order=False) -> x @ w.T` on a weight packed by
    `pack_linear_weight` (this CPU's widest variant; `f.panel` is its panel width), or None.
    `fixed_order`: every row's sums in one order whatever the row count (batch-invariant)."""
    isa = cpu_isa()
    if not isa:
        return None
    module = _module()
    run, panel = module.packed_linear, module.linear_panel_width(isa)

    def packed_linear(x, packed, n: int, fixed_order: bool = False):
        return run(x, packed, n, isa, fixed_order)

    packed_linear.panel = panel  # type: ignore[attr-defined]
    packed_linear.isa = isa  # type: ignore[attr-defined]
    return packed_linear


def pack_linear_weight(weight, panel: int):
    """w [N, K] float32 -> [ceil(N / panel), K, panel]: panel p holds rows [p*panel, p*panel +
    panel) transposed, rows past N zero (the layout linear_impl.h reads)."""
    import torch

    n, k = weight.shape
    panels = -(-n // panel)
    padded = weight.detach().new_zeros((panels * panel, k))
    padded[:n] = weight.detach()
    return padded.view(panels, panel, k).transpose(1, 2).contiguous()


def amx_linear_kernel() -> Optional[Any]:
    """`f(x, packed, n, float_out=False) -> x @ w.T`: bfloat16 x on AMX tiles (amx_linear_impl.h:
    every row's sums in one order whatever the rows; float_out gives the bfloat16-rounded
    values as float32), w packed by `pack_amx_weight`; or None where it does not run: no
    kernels, a variant other than "avx512bf16" (TOKENWEIR_CPU_ISA can force one), no AMX-BF16
    or the OS refused this process the tiles, or TOKENWEIR_AMX_LINEAR=0."""
    if cpu_isa() != "avx512bf16" or os.environ.get("TOKENWEIR_AMX_LINEAR", "1") == "0":
        return None
    module = _module()
    return module.amx_linear if module.amx_linear_available() else None


def pack_amx_weight(weight):
    """w [N, K] (N % 32 == 0, K % 32 == 0) -> bfloat16 [N / 16, K / 32, 16, 32]: AMX B tiles,
    element [nb, kb, p, 2 j + e] = w[16 nb + j, 32 kb + 2 p + e] (the layout amx_linear reads)."""
    import torch

    n, k = weight.shape
    tiles = weight.detach().to(torch.bfloat16).reshape(n // 16, 16, k // 32, 16, 2)
    return tiles.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32).contiguous()


def unavailable_reason() -> str:
    """Why the compiled module is missing, in words ("" when it is loaded): switched off by
    TOKENWEIR_CPU_KERNELS=0, or the build's error (a missing compiler, headers, ...)."""
    if not kernels_enabled():
        return "TOKENWEIR_CPU_KERNELS=0 switches them off"
    if _module() is not None:
        return ""
    return f"their build failed ({_STATE.get('error', 'no error recorded')})"


def _module() -> Optional[Any]:
    if not kernels_enabled():
        return None
    if "module" not in _STATE:
        with _LOCK:
            if "module" not in _STATE:
                _STATE["module"] = _build()
    return _STATE["module"]


# -fopenmp: at::parallel_for is a `#pragma omp parallel` inlined from torch's headers (its
# OpenMP backend); compiled without the flag, every kernel ran on ONE thread. At run time the
# soname libgomp.so.1 resolves to the copy torch has already loaded (one OpenMP runtime).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-ffast-math", "-Wno-psabi", "-fopenmp"]
LDFLAGS = ["-lmvec", "-fopenmp"]


def _build() -> Optional[Any]:
    """The compiled module: imported straight from its build directory when a finished build
    is there (see _finished_build), else built (or brought up to date) by torch's `load`, with
    one line on stderr before and after when it compiles."""
    name = f"tokenweir_cpu_kernels_{_source_hash()}"
    remembered = _remembered_build_dir(name)
    if remembered and _finished_build(remembered, name):
        with contextlib.suppress(Exception):  # unloadable after all: let `load` rebuild
            return _import_built(remembered, name)
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        build_dir = _get_build_directory(name, verbose=False)
        if _finished_build(build_dir, name):
            with contextlib.suppress(Exception):
                module = _import_built(build_dir, name)
                _remember_build_dir(name, build_dir)
                return module
        _clear_stale_build_lock(name)
        started = time.perf_counter()
        compiles = not os.path.exists(_library(build_dir, name))  # else: ninja checks, quickly
        if compiles:
            _notice(f"compiling the C++ CPU kernels for this CPU into {build_dir} (once per "
                    f"checkout and kernel version; about a minute on 2 idle cores, longer on a "
                    f"busy machine; `make` or `python -m tokenweir.model.kernels` does it ahead)")
        # copies: torch appends its own flags to the lists it is given
        module = load(name=name, sources=[_SOURCE], extra_cflags=list(CFLAGS),
                      extra_ldflags=list(LDFLAGS), verbose=False)
        _mark_finished(build_dir, name)
        _remember_build_dir(name, build_dir)
        if compiles:
            _notice(f"C++ CPU kernels ready ({time.perf_counter() - started:.0f} s)")
        return module
    except Exception as exc:  # no compiler, no headers, ...: fall back to the torch path
        _STATE["error"] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"tokenweir: C++ CPU kernels unavailable, using the torch path ({exc})",
                      RuntimeWarning, stacklevel=3)
        return None


def _notice(message: str) -> None:
    print(f"tokenweir: {message}", file=sys.stderr, flush=True)


# Written beside the library once `load` returned it: the library's size and mtime then. The
# name carries the sources' hash, so a library with a matching marker is a finished build of
# exactly these sources (a build killed mid-link leaves no marker, or one that no longer
# matches the file), and importing it directly skips torch's ninja check (~0.3-0.6 s).
_MARKER = "tokenweir-finished.json"


def _library(build_dir: str, name: str) -> str:
    return os.path.join(build_dir, f"{name}.so")


def _library_stamp(build_dir: str, name: str) -> list[int]:
    st = os.stat(_library(build_dir, name))
    return [st.st_size, st.st_mtime_ns]


def _finished_build(build_dir: str, name: str) -> bool:
    try:
        with open(os.path.join(build_dir, _MARKER), encoding="utf-8") as f:
            return json.load(f) == _library_stamp(build_dir, name)
    except (OSError, ValueError):
        return False


def _mark_finished(build_dir: str, name: str) -> None:
    with contextlib.suppress(OSError):
        staging = os.path.join(build_dir, f"{_MARKER}.{os.getpid()}")
        with open(staging, "w", encoding="utf-8") as f:
            json.dump(_library_stamp(build_dir, name), f)
        os.replace(staging, os.path.join(build_dir, _MARKER))


def _remembered_path(name: str) -> str:
    """Where the build directory of `name` is remembered: importing torch.utils.cpp_extension
    to ask torch where it would be costs ~0.1-0.4 s of every start."""
    from tokenweir.model.load_cache import cache_root

    return os.path.join(cache_root(), "kernels", f"{name}.dir")


def _remembered_build_dir(name: str) -> Optional[str]:
    try:
        with open(_remembered_path(name), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _remember_build_dir(name: str, build_dir: str) -> None:
    path = _remembered_path(name)
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staging = f"{path}.{os.getpid()}"
        with open(staging, "w", encoding="utf-8") as f:
            f.write(build_dir)
        os.replace(staging, path)


def _import_built(build_dir: str, name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, _library(build_dir, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build() -> Optional[Any]:
    """Build (or find) the kernels now: `python -m tokenweir.model.kernels`, `make`."""
    return _module()


# A build takes about a minute; a lock older than this was left by a killed build (torch waits
# on it forever, so every later engine start would hang).
STALE_LOCK_SECONDS = 600.0


def _clear_stale_build_lock(name: str) -> None:
    """Remove the build directory's `lock` file when no build can still own it."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nothing to clear
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"tokenweir: removing a stale kernel-build lock ({lock}, {age:.0f} s old)",
                      RuntimeWarning, stacklevel=3)
        with contextlib.suppress(OSError):
            os.remove(lock)


def _source_hash() -> str:
    """12 hex digits over the .cpp, every header beside it, the build flags and the directory
    they lie in: two checkouts of the same sources get build directories of their own (in a
    shared one, ninja rebuilt the module each time the other checkout loaded it, since the
    source path in build.ninja changed, and a build killed meanwhile blocked both)."""
    digest = hashlib.sha1(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(_DIR.encode())
    for path in [_SOURCE, *sorted(glob.glob(os.path.join(_DIR, "*.h")))]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]
