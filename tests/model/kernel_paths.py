"""Test helper: force one kernel path (torch, or the C++ kernels' AVX2 / AVX-512 variant) and
count what the forward really called, so that a "path X gives the same answer" test can also
assert that path X ran."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenweir.model import kernels

PATHS = ("torch", "avx2", "avx512", "avx512bf16")


class _CountingOps:
    """Proxy of the compiled module that counts calls per op name."""

    def __init__(self, module, calls: Counter) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)

        def counted(*args, **kwargs):
            self._calls[name] += 1
            return fn(*args, **kwargs)
        return counted


def force_path(path: str, monkeypatch) -> Counter:
    """Set the environment for `path` (skipping, with the reason, where this CPU or build
    cannot run it) and return a Counter of kernel calls: 'paged_attention' and each fused op."""
    calls: Counter = Counter()
    if path == "torch":
        monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "0")
        return calls
    monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "1")
    if kernels.paged_attention_kernel() is None or kernels.fused_ops() is None:
        pytest.skip("C++ kernels could not be built here (no compiler?)")
    monkeypatch.setenv("TOKENWEIR_CPU_ISA", path)
    if kernels.cpu_isa() != path:
        pytest.skip(f"this CPU cannot run the {path} variant (widest here: "
                    f"{kernels.cpu_isa() or 'none'}; needs "
                    f"{kernels.ISA_NEEDS[path]})")
    paged, ops = kernels.paged_attention_kernel, kernels.fused_ops

    def counting_paged():
        kernel = paged()
        if kernel is None:
            return None

        def run(*args):
            calls["paged_attention"] += 1
            return kernel(*args)
        run.isa = kernel.isa
        return run
    monkeypatch.setattr(kernels, "paged_attention_kernel", counting_paged)
    monkeypatch.setattr(kernels, "fused_ops", lambda: _CountingOps(ops(), calls))
    return calls


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
