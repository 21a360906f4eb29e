"""Optional C++ CPU kernels, compiled on first use with the machine's C++ compiler.

`decode_kernel()` returns the paged decode attention kernel and `skinny_linear_kernel()` the
few-rows matmul (see cpu_kernels.cpp for their contracts), or None when they cannot be used:
not built yet and no compiler, the build failed, or `TOKENWEIR_CPU_KERNELS=0`. Callers must keep
a pure-torch path for None. A failed build is
reported once (a warning) and not retried in this process.

The build lands in torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions); torch rebuilds it when the source or flags change.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Optional

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cpp")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def kernels_enabled() -> bool:
    return os.environ.get("TOKENWEIR_CPU_KERNELS", "1") != "0"


def decode_kernel() -> Optional[Any]:
    """The compiled module's `paged_decode_attention`, or None (see module docstring)."""
    module = _module()
    return None if module is None else module.paged_decode_attention


def skinny_linear_kernel() -> Optional[Any]:
    """The compiled module's `skinny_linear(x, w) -> x @ w.T`, or None."""
    module = _module()
    return None if module is None else module.skinny_linear


def _module() -> Optional[Any]:
    if not kernels_enabled():
        return None
    if "module" not in _STATE:
        with _LOCK:
            if "module" not in _STATE:
                _STATE["module"] = _build()
    return _STATE["module"]


def _build() -> Optional[Any]:
    try:
        from torch.utils.cpp_extension import load

        return load(name="tokenweir_cpu_kernels", sources=[_SOURCE],
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-ffast-math"],
                    extra_ldflags=["-lmvec"], verbose=False)
    except Exception as exc:  # no compiler, no headers, ...: fall back to the torch path
        warnings.warn(f"tokenweir: C++ CPU kernels unavailable, using the torch path ({exc})",
                      RuntimeWarning, stacklevel=3)
        return None
