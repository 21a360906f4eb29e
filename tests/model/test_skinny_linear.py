"""The C++ few-rows matmul behind Linear and the LM head on CPU float32: equal to F.linear
(to float32 rounding) for every row count the kernel splits into groups of 4/2/1, weight row
counts that leave a tail of the 6/4/3-row tiles, and K with and without a tail of 8; above
the row cap, and with the kernels switched off, the torch path runs. Each test checks which
path ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenweir.model import layers

from kernel_paths import random_linear, record_kernel_calls, require_kernels


@pytest.fixture
def skinny(monkeypatch):
    """The shapes of x each call into the compiled skinny_linear saw. Recorded below the
    getter (kernel_paths.record_kernel_calls), so a call that should have taken the torch
    path but reached the kernel is seen."""
    monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "1")
    monkeypatch.setattr(layers, "PACK_LINEAR", False)  # the unpacked kernel (packed: opt-out)
    require_kernels()
    calls = []

    def record(name, args):
        if name == "skinny_linear":
            calls.append(tuple(args[0].shape))
    record_kernel_calls(monkeypatch, record)
    return calls


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 12])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 13), (37, 7), (8, 1)],
                         ids=["even", "tile-tail", "k-tail", "one-row"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_kernel_matches_f_linear(skinny, rows, k, n, bias):
    lin = random_linear(k, n, bias, seed=rows * 100 + k + n)
    x = torch.randn(rows, k)
    with torch.no_grad():
        got = lin(x)
        want = F.linear(x, lin.weight, lin.bias)
    assert skinny == [(rows, k)]  # probe: the kernel ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_above_the_row_cap_non_contiguous_and_disabled_the_torch_path_runs(skinny,
                                                                            monkeypatch):
    lin = random_linear(64, 32, True, seed=1)
    with torch.no_grad():
        wide = torch.randn(layers.SKINNY_MAX_ROWS + 1, 64)
        torch.testing.assert_close(lin(wide), F.linear(wide, lin.weight, lin.bias))
        strided = torch.randn(64, 2).t()  # 2 rows, non-contiguous: the torch path too
        assert not strided.is_contiguous()
        torch.testing.assert_close(lin(strided), F.linear(strided, lin.weight, lin.bias))
        assert skinny == []
        lin(torch.randn(2, 64))
        assert skinny == [(2, 64)]  # probe: with the kernels on, 2 rows do take the kernel
        skinny.clear()
        monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "0")
        x = torch.randn(2, 64)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert skinny == []


def test_lm_head_rows_take_the_kernel(skinny):
    """compute_logits: up to SKINNY_MAX_ROWS_LM_HEAD rows through the kernel, more through
    torch.matmul; float32 logits either way."""
    from types import SimpleNamespace

    from tokenweir.model.llama import CausalLM

    torch.manual_seed(0)
    head = SimpleNamespace(lm_head_weight=torch.randn(1000, 64))
    for rows, expect_kernel in ((layers.SKINNY_MAX_ROWS_LM_HEAD, True),
                                (layers.SKINNY_MAX_ROWS_LM_HEAD + 1, False)):
        skinny.clear()
        hidden = torch.randn(rows, 64)
        logits = CausalLM.compute_logits(head, hidden)
        assert logits.dtype == torch.float32 and (skinny == [(rows, 64)]) == expect_kernel
        torch.testing.assert_close(logits, hidden @ head.lm_head_weight.t(), rtol=1e-5,
                                   atol=1e-3)
