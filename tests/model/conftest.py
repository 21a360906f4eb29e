"""Shared fixtures for the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: results do not depend on it, tiny models run fastest
    that way, and a shared 2-core box is far less noisy (OpenMP barriers stall when the other
    core is busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def int8_calls(monkeypatch):
    """Count torch's int8 weight-only matmuls (rows per call)."""
    calls: list[int] = []
    real = torch._weight_int8pack_mm

    def counted(x, q, scales):
        calls.append(x.shape[0])
        return real(x, q, scales)
    monkeypatch.setattr(torch, "_weight_int8pack_mm", counted)
    return calls
