"""Test helper: force one kernel path (torch, or the C++ kernels' AVX2 / AVX-512 variant) and
count what the forward really called, so that a "path X gives the same answer" test can also
assert that path X ran (and, on the torch path, that no kernel ran)."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest

from tokenweir.model import kernels

PATHS = ("torch", "avx2", "avx512", "avx512bf16")


class _RecordingModule:
    """Proxy of the compiled module: each call of one of its functions goes through
    `record(name, args)` first."""

    def __init__(self, module, record: Callable[[str, tuple], None]) -> None:
        self._module, self._record = module, record

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)

        def recorded(*args, **kwargs):
            self._record(name, args)
            return fn(*args, **kwargs)
        return recorded


def record_kernel_calls(monkeypatch, record: Callable[[str, tuple], None]) -> None:
    """Route every call into the compiled module through `record(name, args)`, at the one door
    every kernel getter passes (`kernels._module`, which honours TOKENWEIR_CPU_KERNELS). Since
    it sits below the getters, a getter or caller that ignores the switch or skips its own
    checks (contiguity, dtype, rows) is recorded too: "the torch path ran" can fail."""
    real_module = kernels._module

    def recording_module():
        module = real_module()
        return None if module is None else _RecordingModule(module, record)
    monkeypatch.setattr(kernels, "_module", recording_module)


def force_path(path: str, monkeypatch) -> Counter:
    """Set the environment for `path` (skipping, with the reason, where this CPU or build
    cannot run it) and return a Counter of calls into the compiled module per function name
    ('paged_attention', each fused op, ...; also queries such as 'cpu_isa'). On the torch
    path it must stay empty: the counter is connected there too."""
    calls: Counter = Counter()
    if path == "torch":
        monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "0")
    else:
        _require_variant(path, monkeypatch)
    record_kernel_calls(monkeypatch, lambda name, args: calls.update([name]))
    return calls


def _require_variant(path: str, monkeypatch) -> None:
    monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "1")
    require_kernels()
    monkeypatch.setenv("TOKENWEIR_CPU_ISA", path)
    if kernels.cpu_isa() != path:
        pytest.skip(f"this CPU cannot run the {path} variant (needs {kernels.ISA_NEEDS[path]}; "
                    f"{widest_variant(monkeypatch)})")


def require_kernels() -> None:
    """Skip, saying what is really missing, where the compiled module is not loaded."""
    reason = kernels.unavailable_reason()
    if reason:
        pytest.skip(f"no C++ CPU kernels here: {reason}")


def widest_variant(monkeypatch) -> str:
    """'widest variant here: X', X being what this CPU runs with no variant forced (a forced
    TOKENWEIR_CPU_ISA the CPU cannot run makes cpu_isa() answer "", which is not "none")."""
    with monkeypatch.context() as m:
        m.delenv("TOKENWEIR_CPU_ISA", raising=False)
        isa = kernels.cpu_isa()
    return f"widest variant here: {isa}" if isa else \
        "this CPU runs no variant (needs at least AVX2 + FMA)"


def random_linear(in_features: int, out_features: int, bias: bool, seed: int):
    """A tokenweir Linear with seeded normal weights (and bias), for kernel parity tests."""
    import torch

    from tokenweir.model import layers

    torch.manual_seed(seed)
    lin = layers.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.normal_()
        if bias:
            lin.bias.normal_()
    return lin


def count_amx_rows(monkeypatch) -> list[int]:
    """The rows of every AMX kernel call (kernels.amx_linear_kernel) from now on: the probe
    that the AMX path really ran. The kernel's getter still reads TOKENWEIR_AMX_LINEAR."""
    getter, rows = kernels.amx_linear_kernel, []

    def counting_getter():
        kernel = getter()
        if kernel is None:
            return None

        def counting(x, *args):
            rows.append(x.shape[0])
            return kernel(x, *args)
        return counting
    monkeypatch.setattr(kernels, "amx_linear_kernel", counting_getter)
    return rows
