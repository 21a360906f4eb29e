"""Batch-invariant mode's Triton kernels (issue 38), run by Triton's interpreter on CPU at tiny
sizes: the matmul (backends/triton_matmul.py) gives a row the same bits whatever the row count
and its place among the rows; the paged attention in batch-invariant mode (triton_paged.py,
plan_step) gives a prefill chunk's row the bits of a decode at its position. The `cuda` tests
run the compiled kernels at serving sizes, for a session with a GPU.

What the interpreter cannot show: that the default choices move a row (it computes every dot
in numpy, float32, where a tile's shape hardly changes the sums); on a GPU cuBLAS picks kernels
by M, which the cuda test's probe shows."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tokenweir.model import attention as A
from tokenweir.model import backends

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")

SMALL_BLOCKS = (16, 16, 16)  # the interpreter is slow: tiny tiles, several of them per call


@pytest.fixture
def interpreted(one_thread):
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: the kernels run compiled there (the cuda tests)")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py


def _matmul():
    from tokenweir.model.backends.triton_matmul import invariant_matmul
    return invariant_matmul


def _rows_keep_their_bits(dtype, device, k, n, row_counts, blocks) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    row = torch.randn(1, k, generator=gen).to(dtype).to(device)
    matmul = _matmul()
    alone = matmul(row, w, blocks=blocks)
    expected = row.float() @ w.float().T
    torch.testing.assert_close(alone.float(), expected, rtol=2e-2, atol=2e-2 * k ** 0.5)
    for m in row_counts:
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        for at in sorted({0, m // 2, m - 1}):
            x[at] = row[0]
            assert torch.equal(matmul(x, w, blocks=blocks)[at], alone[0]), (m, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_row_is_the_same_bits_in_any_number_of_rows(dtype, interpreted):
    # K = 72: four k blocks of 16, the last one ragged; N = 40: a ragged last column tile
    _rows_keep_their_bits(dtype, "cpu", 72, 40, (2, 5, 17, 33), SMALL_BLOCKS)


def test_matmul_out_dtype_and_shape_checks(interpreted):
    matmul = _matmul()
    x, w = torch.randn(3, 20), torch.randn(7, 20)
    out = matmul(x, w, out_dtype=torch.float32, blocks=SMALL_BLOCKS)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)
    assert matmul(x[:0], w, blocks=SMALL_BLOCKS).shape == (0, 7)
    with pytest.raises(ValueError, match="do not multiply"):
        matmul(x, torch.randn(7, 21), blocks=SMALL_BLOCKS)


def _paged_case(device, ctx: int, chunk: int, heads: int = 4, kv_heads: int = 2, d: int = 64,
                bs: int = 16):
    gen = torch.Generator().manual_seed(3)
    total = ctx + chunk
    nblk = -(-total // bs)
    cache = torch.randn(2, nblk + 2, bs, kv_heads, d, generator=gen).to(device)
    q = torch.randn(chunk, heads, d, generator=gen).to(device)
    return cache, q, list(range(1, nblk + 1)), total


def _attend(backend, cache, q, meta) -> torch.Tensor:
    """The backend's kernel on the step, K/V already in the cache (not rewritten)."""
    from tokenweir.model.backends import triton_paged
    group = q.shape[1] // cache.shape[3]
    meta.backend_plan = triton_paged.plan_step(meta, group, q.device)
    out = torch.zeros_like(q)
    triton_paged.launch(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                        meta.backend_plan, 0.125, out)
    return out


def _chunk_rows_are_decode_rows(device: str, ctx: int, chunk: int) -> None:
    backend = backends.select_backend(device, "triton")
    cache, q, blocks, total = _paged_case(device, ctx, chunk)
    as_chunk = A.build_attention_metadata([chunk], [ctx], [blocks], 16, device,
                                          backend=backend, batch_invariant=True)
    as_decodes = A.build_attention_metadata([1] * chunk, list(range(ctx, total)),
                                            [blocks] * chunk, 16, device, backend=backend,
                                            batch_invariant=True)
    chunk_rows = _attend(backend, cache, q, as_chunk)
    decode_rows = _attend(backend, cache, q, as_decodes)
    # probe: the decode-only step ran the prefill tile shape (without the mode: 16 rows, 1 token)
    assert as_decodes.backend_plan.block_m == as_chunk.backend_plan.block_m
    default = A.build_attention_metadata([1] * chunk, list(range(ctx, total)),
                                         [blocks] * chunk, 16, device, backend=backend)
    torch.testing.assert_close(_attend(backend, cache, q, default), decode_rows,
                               rtol=1e-4, atol=1e-4)
    assert default.backend_plan.block_m != as_decodes.backend_plan.block_m
    assert torch.equal(chunk_rows, decode_rows)


@pytest.mark.parametrize("ctx,chunk", [(13, 20), (0, 40)])
def test_attention_chunk_row_is_the_decode_at_its_position(ctx, chunk, interpreted):
    """20 rows after 13 cached keys (one tile, keys ending mid-block), and 40 rows from key 0
    (two tiles of 32 tokens: rows of the second tile see key chunks the first never did)."""
    _chunk_rows_are_decode_rows("cpu", ctx, chunk)


def test_the_mode_is_refused_on_other_backends():
    with pytest.raises(ValueError, match="batch-invariant attention"):
        A.build_attention_metadata([1], [3], [[1]], 16, "cpu",
                                   backend=backends.select_backend("cpu", "reference"),
                                   batch_invariant=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compiled_matmul_row_is_the_same_bits_on_cuda(dtype):
    """SmolLM2's MLP shape at the row counts a serving step has; the probe: cuBLAS moves a row
    with the row count at one of them at least (else this GPU needed no invariant matmul)."""
    from tokenweir.model.backends.triton_matmul import BLOCKS
    _rows_keep_their_bits(dtype, "cuda", 576, 1536, (2, 7, 64, 300, 2048), BLOCKS)
    # an H200 (torch 2.11, cuBLAS of CUDA 13) kept row 0's bits at every row count for the
    # 576 -> 1536 shape in bfloat16: the probe also tries the down projection (K = 1536) and
    # an 8B-sized square, where split-K for few rows is likelier
    moved = [(k, n, m) for k, n in ((576, 1536), (1536, 576), (4096, 4096))
             for m in (7, 64, 300, 2048) if _cublas_moves_row_zero(dtype, k, n, m)]
    assert moved, "cuBLAS kept row 0's bits at every row count and shape tried"


def _cublas_moves_row_zero(dtype, k: int, n: int, m: int) -> bool:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen).to(dtype).cuda()
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    return not torch.equal((x @ w.T)[0], (x[:1] @ w.T)[0])


def test_kernels_pass_compiled_tritons_dependency_check(monkeypatch):
    """The check compiled Triton runs before its first compile (the kernel's cache key hashes
    every global it names) passes for both kernels: on an H200 the first compile of each
    failed with "Unsupported function referenced: sum_dot", a plain helper the interpreter
    accepts. Needs no GPU: the cache key is computed on the host."""
    import triton
    from triton.runtime.jit import JITFunction

    from tokenweir.model.backends import _triton_kernel as K
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for source in (K.paged_attention_kernel, K.invariant_matmul_kernel):
        with pytest.raises(RuntimeError, match="Unsupported function"):  # the probe: it bites
            triton.jit(source).cache_key
        jitted = K.jit_for_mode(source)
        assert isinstance(jitted, JITFunction)  # compiled mode, not the interpreter's
        assert jitted.cache_key
        assert [p.is_constexpr for p in jitted.params] == [
            p.is_constexpr for p in triton.jit(source).params]
        assert sum(p.is_constexpr for p in jitted.params) >= 5


def test_kernels_lower_to_triton_ir_for_hopper():
    """Both kernels, jitted as the backends jit them, lower to Triton IR for sm_90 on the host
    (no GPU): the front end that refused `tl.arange(0, BLOCK_M)` on an H200 when a copy of
    the kernel had lost its tl.constexpr annotations. In a fresh process with the interpreter
    off: triton cannot switch modes once its language modules are imported (and without torch:
    tests/model/triton_lowering.py)."""
    script = os.path.join(os.path.dirname(__file__), "triton_lowering.py")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, script], env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("tt.func") == 2, done.stdout


@pytest.mark.cuda
def test_compiled_attention_chunk_row_is_the_decode_on_cuda():
    _chunk_rows_are_decode_rows("cuda", 37, 150)
