"""Bounded memory on the bfloat16 path (issue 14, item 8): oneDNN builds and caches a primitive
per distinct matmul shape, each holding native memory, so a step's row count M (its tokens)
taking every value grew RSS by hundreds of MB. The model pads M up to a bucket
(layers.row_bucket); these tests pin the buckets, the numerics, and the mechanism itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

from tokenweir.model.layers import EXACT_ROWS, bucketed_linear, row_bucket


def test_row_buckets_are_few_and_pad_little():
    buckets = [row_bucket(m) for m in range(1, 8193)]
    assert all(b >= m for m, b in zip(range(1, 8193), buckets))
    assert buckets == sorted(buckets)
    assert buckets[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))  # decode batches: exact
    assert all((b - m) / m <= 0.125 for m, b in zip(range(1, 8193), buckets))
    assert len(set(buckets)) == 88
    assert all(row_bucket(b) == b for b in set(buckets))  # a bucket is its own bucket


def test_bucketed_linear_gives_the_rows_of_the_plain_linear():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32).bfloat16(), torch.randn(48).bfloat16()
    for rows in (1, 16, 17, 37, 100):
        x = torch.randn(rows, 32).bfloat16()
        out = bucketed_linear(x, weight, bias)
        assert out.shape == (rows, 48) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(),
                                   rtol=1e-2, atol=1e-2)
    x32 = torch.randn(37, 32)  # float32 is never padded: bit-identical
    assert torch.equal(bucketed_linear(x32, weight.float()), F.linear(x32, weight.float()))


PROBE = textwrap.dedent("""
    import torch
    from tokenweir.model.layers import row_bucket
    torch.set_num_threads(1)
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    w = torch.randn(1536, 576).to_mkldnn()
    def growth_mb(row_counts):
        before = rss_mb()
        for m in row_counts:
            x = torch.randn(m, 576).to_mkldnn()
            torch._C._nn.mkldnn_linear(x, w)
        return rss_mb() - before
    growth_mb(row_bucket(m) for m in range(1, 200))  # warm-up: oneDNN's first use, 45 shapes
    # Rows 200-399, bucketed first: 8 new shapes. Then unpadded: 192 new shapes (the 8
    # buckets among them were just made). In the other order the bucketed arm would find its
    # shapes made by the fresh one.
    bucketed = growth_mb(row_bucket(m) for m in range(200, 400))
    fresh = growth_mb(range(200, 400))
    print(bucketed, fresh)
""")


def test_distinct_shapes_grow_native_memory_and_buckets_do_not():
    """The mechanism, with oneDNN's float32 linear (the bfloat16 one needs AVX512-BF16, which
    this test cannot count on), in one fresh process: after a warm-up on rows 1-199, rows
    200-399 bucketed add 8 new shapes and a small share of the RSS that the same rows unpadded
    then add with 192 new shapes, tens of MB (the probe that the cause is real here). With
    row_bucket the identity, the bucketed arm makes the 200 shapes and the fresh arm finds them
    made: it fails."""
    if not torch.backends.mkldnn.is_available():
        import pytest
        pytest.skip("torch built without oneDNN")
    warm = {row_bucket(m) for m in range(1, 200)}
    assert len({row_bucket(m) for m in range(200, 400)} - warm) == 8
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=300)
    bucketed, fresh = map(float, out.stdout.strip().splitlines()[-1].split())
    assert fresh > 40, f"192 distinct shapes grew RSS by only {fresh:.1f} MB"
    # Measured (Xeon AVX-512, one process): fresh 144 MB, bucketed 8.9 MB; two processes (as
    # before, AVX2 EPYC): fresh ~110 MB, bucketed ~7.5 MB.
    assert bucketed < fresh / 4, f"bucketed grew RSS by {bucketed:.1f} MB, fresh {fresh:.1f} MB"
