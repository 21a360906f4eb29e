"""Bfloat16 prefill attention of the in-place kernel at serving shapes (SmolLM2-135M heads).

    python benchmarks/prefill_attention.py [--repeats N] [--threads T] [--isa avx512bf16]

GFLOP/s = 4 * keys attended (summed over query rows) * head_dim * heads / time, best of N.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import torch  # noqa: E402

from kernels import HEAD_DIM, HEADS, _paged_setup  # noqa: E402  (benchmarks/kernels.py)
from tokenweir.model import kernels  # noqa: E402

BS = 16

# (label, query rows per request, cached context per request)
SHAPES = [
    ("64 rows / 1 req", [64], [0]),
    ("256 rows / 1 req", [256], [0]),
    ("2048 rows / 1 req", [2048], [0]),
    ("8 req x 244 rows", [244] * 8, [0] * 8),
    ("16 req x 64 rows", [64] * 16, [0] * 16),
    ("512 rows + 512 ctx", [512], [512]),
    ("4 req x 128 + 300 ctx", [128] * 4, [300] * 4),
]


def setup(q_lens, ctx, dtype):
    """The kernel's arguments for one shape (blocks at random places in the pool: the paged
    setup of benchmarks/kernels.py), and the shape's FLOPs."""
    cache, meta, q, _ = _paged_setup(q_lens, ctx, dtype, BS)
    reqs = torch.arange(len(q_lens), dtype=torch.long)
    flop = 4 * HEADS * HEAD_DIM * sum(c + r + 1 for c, n in zip(ctx, q_lens) for r in range(n))
    return cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, reqs, q, flop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    kernel = kernels.paged_attention_kernel()
    print(f"isa {kernel.isa}, {args.threads} threads, {args.dtype}")
    for label, q_lens, ctx in SHAPES:
        cache, tab, qsl, seq, reqs, q, flop = setup(q_lens, ctx, dtype)
        out = torch.empty_like(q)
        def run():
            kernel(q, cache, tab, qsl, seq, reqs, HEAD_DIM ** -0.5, out)
        run()
        best = float("inf")
        deadline = time.perf_counter() + 3.0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                break
        print(f"{label:24s} {best * 1e3:8.3f} ms  {flop / best / 1e9:7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
