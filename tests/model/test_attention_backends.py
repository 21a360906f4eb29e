"""The attention backends (tokenweir/model/backends) against the dense reference of
test_attention.py, on the same random paged caches: the per-request SDPA reference, and the
Triton kernel run by Triton's interpreter on CPU (tiny shapes: the interpreter is slow)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from test_attention import CASES, _run_case
from tokenweir.model import backends
from tokenweir.model.backends import triton_paged

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(4, 2, 64), (3, 3, 64), (6, 1, 64), (9, 3, 64), (4, 2, 40)]
SHAPE_IDS = [f"h{h}kv{k}d{d}" for h, k, d in SHAPES]


@pytest.fixture
def interpreted_triton(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton; the `gpu` extra)")
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: the kernel runs compiled there (test_triton_compiled_on_cuda)")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py
    backend = backends.select_backend("cpu", "triton")
    assert type(backend).__name__ == "TritonBackend"
    return backend


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES, ids=SHAPE_IDS)
def test_reference_backend_matches_dense(case, heads, kv_heads, head_dim):
    _run_case(*CASES[case], heads, kv_heads, torch.float32, head_dim=head_dim,
              backend=backends.select_backend("cpu", "reference"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES[:1] + SHAPES[3:], ids=SHAPE_IDS[:1] + SHAPE_IDS[3:])
def test_triton_backend_matches_dense(case, heads, kv_heads, head_dim, interpreted_triton):
    _run_case(*CASES[case], heads, kv_heads, torch.float32, head_dim=head_dim,
              backend=interpreted_triton)


@pytest.mark.parametrize("block_size", [1, 16, 48])
def test_triton_backend_any_block_size(block_size, interpreted_triton):
    """Keys are looked up block by block: block sizes below, equal to and not a power of two
    of the kernel's key tile."""
    _run_case(*CASES["mixed"], 4, 2, torch.float32, backend=interpreted_triton,
              block_size=block_size)


def test_triton_backend_bfloat16(interpreted_triton):
    _run_case(*CASES["mixed"], 4, 2, torch.bfloat16, atol=3e-2, backend=interpreted_triton)


def test_triton_long_prefill_spans_tiles(interpreted_triton):
    """A chunk longer than one tile's BLOCK_Q tokens, after a cached prefix, beside decodes."""
    group = 2
    _, block_q = triton_paged.launch_sizes(group, decode_only=False)
    _run_case([1, 1, 2 * block_q + 3], [7, 0, 5], 4, 2, torch.float32,
              backend=interpreted_triton)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES) + ["long_chunk"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES + [(15, 5, 64), (32, 8, 128)],
                         ids=SHAPE_IDS + ["h15kv5d64", "h32kv8d128"])
def test_triton_compiled_on_cuda(case, heads, kv_heads, head_dim, dtype):
    """The compiled kernel on the GPU against the dense reference: float32 with IEEE dots,
    bfloat16 with bfloat16 dots (which the interpreter cannot check)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    backend = backends.select_backend("cuda", "triton")
    query_lens, ctx = CASES[case] if case in CASES else ([1, 1, 150], [7, 0, 33])
    _run_case(query_lens, ctx, heads, kv_heads, dtype, head_dim=head_dim, backend=backend,
              device="cuda", atol=2e-4 if dtype == torch.float32 else 3e-2)


def test_tile_table_and_launch_sizes():
    assert triton_paged.tile_table([1, 1, 5, 2], 2) == ([0, 1, 2, 2, 2, 3], [0, 0, 0, 2, 4, 0])
    assert triton_paged.launch_sizes(3, decode_only=True) == (16, 1)
    assert triton_paged.launch_sizes(32, decode_only=True) == (32, 1)
    assert triton_paged.launch_sizes(3, decode_only=False) == (64, 21)


def test_select_backend(monkeypatch):
    monkeypatch.delenv(backends.ENV, raising=False)
    assert backends.select_backend("cpu") is None  # the cpu path: attention.py's own
    monkeypatch.setenv(backends.ENV, "reference")
    assert backends.select_backend("cpu").name == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):  # CPU needs the interpreter
        backends.select_backend("cpu", "triton")
    with pytest.raises(ValueError, match="unknown attention backend"):
        backends.select_backend("cpu", "flash")
