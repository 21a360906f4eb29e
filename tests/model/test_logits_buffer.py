"""CausalLM.compute_logits above the few-rows kernels writes float32 logits into one buffer
reused across calls on CPU (a fresh >32 MB tensor each step page-faults: see logits_buffer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenweir.model import layers
from tokenweir.model.llama import CausalLM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_many_row_logits_are_right_and_land_in_one_reused_buffer(dtype):
    torch.manual_seed(0)
    head = SimpleNamespace(lm_head_weight=torch.randn(1000, 64).to(dtype))
    rows = layers.PACKED_MAX_ROWS_LM_HEAD + 37  # above every few-rows kernel
    hidden = torch.randn(rows, 64).to(dtype)
    expected = (hidden.float() @ head.lm_head_weight.float().t())
    tol = dict(rtol=1e-5, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.3)
    first = CausalLM.compute_logits(head, hidden)
    assert first.dtype == torch.float32 and first.shape == (rows, 1000)
    torch.testing.assert_close(first, expected, **tol)
    storage = first.data_ptr()
    with torch.inference_mode():  # the engine's mode: the same buffer is writable there too
        second = CausalLM.compute_logits(head, hidden[:-5])
    assert second.data_ptr() == storage  # probe: reused, not a fresh tensor
    torch.testing.assert_close(second, expected[:-5], **tol)
    bigger = torch.randn(rows + 10, 64).to(dtype)
    third = CausalLM.compute_logits(head, bigger)  # grows
    assert third.shape == (rows + 10, 1000)
    torch.testing.assert_close(third, bigger.float() @ head.lm_head_weight.float().t(), **tol)


def test_few_row_logits_stay_fresh_tensors():
    """The few-rows kernels' results (<= PACKED_MAX_ROWS_LM_HEAD rows) are not the buffer."""
    torch.manual_seed(1)
    head = SimpleNamespace(lm_head_weight=torch.randn(1000, 64))
    a = CausalLM.compute_logits(head, torch.randn(2, 64))
    b = CausalLM.compute_logits(head, torch.randn(2, 64))
    assert a.data_ptr() != b.data_ptr() and not hasattr(head, "_logits")
