"""A cheaper `import torch` for `tokenweir generate` and `serve` (torch-free: installed before
torch is imported).

While torch imports, `torch.library` registers ~115 operator implementations, and each
registration names its caller with `torch._library.utils.get_source(stacklevel)`:
`inspect.getframeinfo` on the caller's frame, which reads the caller's source file and walks
`sys.modules` (resolving every module's path) only to return "FILE:LINE". That was 0.07-0.12
CPU-s of a warm start (2-vCPU AVX2 EPYC, machine shared; 115 calls timed inside `import
torch`).

`install()` puts a finder at the head of `sys.meta_path` that, right after
`torch._library.utils` has executed, replaces its `get_source` with `_get_source`, which
returns the same string from the frame itself (`co_filename:f_lineno`, what getframeinfo
reports for a frame of a Python source file); then the finder removes itself.

Contract: the string is unchanged (tests/cli/test_torch_import.py compares the two on torch's
own call sites); nothing else in torch is touched; if torch is already imported, or the module
has no `get_source(stacklevel)`, nothing is replaced. TOKENWEIR_FAST_TORCH_IMPORT=0 turns it
off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import sys

TARGET = "torch._library.utils"


def enabled() -> bool:
    return os.environ.get("TOKENWEIR_FAST_TORCH_IMPORT", "1") != "0"


def _get_source(stacklevel: int) -> str:
    """torch._library.utils.get_source without reading the source: "FILE:LINE" of the frame
    `stacklevel` levels above this call."""
    frame = sys._getframe(stacklevel)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _replace(module) -> None:
    real = getattr(module, "get_source", None)
    if real is not None and list(inspect.signature(real).parameters) == ["stacklevel"]:
        module.get_source = _get_source


class _Finder(importlib.abc.MetaPathFinder):
    """Finds TARGET as the path finder does, and wraps its loader's exec_module."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _replace(module)

        spec.loader.exec_module = exec_module
        return spec


_finder = _Finder()


def install() -> bool:
    """Arm the replacement for the coming `import torch` (False: off, or torch imported)."""
    if not enabled() or TARGET in sys.modules or _finder in sys.meta_path:
        return False
    sys.meta_path.insert(0, _finder)
    return True


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
