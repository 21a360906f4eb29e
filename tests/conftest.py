"""Suite-wide settings: engines skip the start-up warm-up (one dummy step of the whole token
budget, ~1-3 s on SmolLM2-135M), since the suite builds hundreds of engines; the warm-up's own
tests turn it back on (tests/engine/test_warm_up.py). Child processes inherit it.

Devices: a test that needs CUDA carries `@pytest.mark.cuda` (skipped, saying why, where none is
visible); a test that should run on every device present takes the `device` fixture. Without
CUDA, Triton kernels run in its interpreter (TRITON_INTERPRET=1, which must be set before triton
is first imported: torch imports it as soon as the inductor loads)."""

import os

import pytest
import torch

os.environ.setdefault("TOKENWEIR_WARMUP", "0")

HAVE_CUDA = torch.cuda.is_available()
if not HAVE_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped where none is visible)")


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: none is visible here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """Each device: cpu always, cuda where visible (skipped, saying so, elsewhere)."""
    return request.param
