"""to_device (model/transfer.py) and the metadata's packed copy: the values arrive, on every
device; on CUDA through pinned memory with non_blocking (the host never waits on the GPU)."""

from __future__ import annotations

import pytest
import torch

from tokenweir.model.attention import to_device_long
from tokenweir.model.transfer import to_device


def test_values_arrive(device):
    got = to_device([[1.5, 2.0], [3.0, -1.0]], torch.float64, device)
    assert got.device.type == device and got.dtype == torch.float64
    assert got.cpu().tolist() == [[1.5, 2.0], [3.0, -1.0]]
    a, b, c = to_device_long([[1, 2, 3], [], [7]], device)
    assert [a.tolist(), b.tolist(), c.tolist()] == [[1, 2, 3], [], [7]]
    assert a.dtype == torch.long and c.device.type == device


@pytest.mark.cuda
def test_cuda_copies_are_pinned_and_non_blocking(monkeypatch):
    seen = []
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        seen.append((self.is_pinned(), kwargs.get("non_blocking")))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", to)
    to_device([1, 2], torch.long, "cuda")
    to_device_long([[1], [2, 3]], "cuda")
    assert seen == [(True, True), (True, True)]
