"""The C++ kernels run on torch's thread count: at::parallel_for is an OpenMP pragma inlined
from torch's headers, so a module built without -fopenmp silently runs every kernel on one
thread (it did until session 7: decode attention and the skinny matmul did not scale)."""

import os

import pytest
import torch

from tokenweir.model import kernels


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
def test_parallel_for_uses_every_torch_thread():
    module = kernels.fused_ops()
    if module is None:
        pytest.skip("C++ kernels unavailable here")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert module.parallel_width(64) == 2
        torch.set_num_threads(1)  # the probe can tell one thread from two
        assert module.parallel_width(64) == 1
    finally:
        torch.set_num_threads(before)
