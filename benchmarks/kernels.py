"""Kernel microbenchmark: each kernel of a SmolLM2-135M step vs the torch path and vs its roofline.

Rooflines are measured in the same run: the matmul peak (a large torch matmul, GFLOP/s) per
dtype, and the memory bandwidth (a large copy, GB/s). Every figure is a best-of-N time, the
candidates of one row timed interleaved (A, B, A, B, ...) so that load from other processes hits
them alike; read the ratios, not the absolute numbers, on a shared machine.

    python benchmarks/kernels.py                      # everything, both dtypes
    python benchmarks/kernels.py --only attention --dtype float32 --threads 1

Sections:
* linear: F.linear vs the few-rows C++ kernel and the packed-weight C++ kernel (float32, up to
  64 rows; the weight packed once outside the timing, as the model does) vs MKL's prepacked sgemm (float32) or
  oneDNN's prepacked bf16 (only where this CPU has AVX-512/avx_ne_convert) for the projection
  shapes of one layer and the LM head, at decode batches (1-64 rows) and prefill chunks (512,
  2048 rows). GFLOP/s and share of the matmul peak. Then (float32) one whole model step's
  weights at 1-64 rows: ms per step and GB/s of weight streamed vs the copy bandwidth.
* attention: decode (64 requests, ~300-600 context) and prefill-with-context (a 16-512-row chunk
  over a 512-token prefix), the in-place C++ kernel vs the torch path (gather + SDPA). Decode
  is bandwidth-bound: GB/s of K/V read vs the copy bandwidth; prefill: GFLOP/s vs the peak.
* overhead: one batch-1 decode step of the real model vs the same graph with every width cut
  to 16 (same number of ops and Python calls, ~no arithmetic): the latter is the step's
  Python/dispatch floor; its share of the real step is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Callable, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tokenweir.cpu_info import cpu_flags  # noqa: E402
from tokenweir.model import attention as A  # noqa: E402
from tokenweir.model import kernels  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
LINEAR_SHAPES = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": (HIDDEN, HIDDEN),
                 "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN), "lm_head": (HIDDEN, VOCAB)}


def best_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best seconds of each callable, interleaved; one untimed warm-up each."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def matmul_peak(dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of a 1024 x 1024 x 1024 torch matmul."""
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    t = best_of({"mm": lambda: a @ b}, repeats)["mm"]
    return 2 * 1024 ** 3 / t / 1e9


def copy_bandwidth(repeats: int) -> float:
    """GB/s of a 256 MiB copy (read + write counted)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    t = best_of({"copy": lambda: dst.copy_(src)}, repeats)["copy"]
    return 2 * src.numel() * 4 / t / 1e9


def linear_candidates(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    fns: dict[str, Callable[[], object]] = {"F.linear": lambda: F.linear(x, w)}
    m = x.shape[0]
    if x.dtype == torch.float32:
        skinny = kernels.skinny_linear_kernel()
        if skinny is not None and m <= 64:
            fns["skinny C++"] = lambda: skinny(x, w)
        packed_kernel = kernels.packed_linear_kernel()
        if packed_kernel is not None and m <= 64:
            panels = kernels.pack_linear_weight(w, packed_kernel.panel)  # once, like the model
            fns["packed C++"] = lambda: packed_kernel(x, panels, w.shape[0])
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        fns["mkl prepacked"] = lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, m)
    else:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            fns["onednn prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(
                x, packed, None, "none", [], "")
        except RuntimeError:
            pass  # this CPU has no AVX-512 / avx_ne_convert: oneDNN refuses bf16 prepacking
    return fns


def bench_linear(dtype: torch.dtype, peak: float, repeats: int) -> None:
    print(f"\n## linear, {str(dtype)[6:]} (GFLOP/s, % of the {peak:.0f} GFLOP/s peak)")
    for name, (k, n) in LINEAR_SHAPES.items():
        w = torch.randn(n, k).to(dtype)
        for m in (1, 8, 32, 64, 512, 2048):
            if name == "lm_head" and m > 64:
                continue  # the LM head only ever sees the sampled rows
            x = torch.randn(m, k).to(dtype)
            times = best_of(linear_candidates(x, w), repeats)
            flop = 2 * m * k * n
            cells = "  ".join(f"{c} {flop / t / 1e9:6.1f} ({100 * flop / t / 1e9 / peak:3.0f}%)"
                              for c, t in times.items())
            print(f"{name:8s} {m:5d} x {k:4d} x {n:5d}   {cells}")


def model_step_weights() -> list[torch.Tensor]:
    """Every float32 weight one SmolLM2-135M step multiplies: 30 layers of qkv, o, gate_up,
    down, then the (tied) LM head; 538 MB, far more than the caches."""
    layer = [LINEAR_SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    weights = [torch.randn(n, k) for _ in range(30) for k, n in layer]
    return weights + [torch.randn(VOCAB, HIDDEN)]


def bench_linear_model_step(bandwidth: float, repeats: int) -> None:
    """All of a step's weights multiplied once, at decode batch sizes: ms per step and GB/s of
    weight streamed (vs the copy bandwidth), each float32 candidate interleaved."""
    print(f"\n## linear, one model step (every weight once; GB/s of weight vs the "
          f"{bandwidth:.1f} GB/s copy)")
    weights = model_step_weights()
    total = sum(w.numel() * 4 for w in weights)
    skinny, packed_kernel = kernels.skinny_linear_kernel(), kernels.packed_linear_kernel()
    panels = (None if packed_kernel is None
              else [kernels.pack_linear_weight(w, packed_kernel.panel) for w in weights])
    for m in (1, 2, 4, 8, 16, 32, 64):
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        fns = {"MKL": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
        if skinny is not None:
            fns["skinny C++"] = lambda: [skinny(xs[w.shape[1]], w) for w in weights]
        if panels is not None:
            fns["packed C++"] = lambda: [packed_kernel(xs[w.shape[1]], p, w.shape[0])
                                         for w, p in zip(weights, panels)]
        times = best_of(fns, max(2, repeats // 4))
        cells = "  ".join(f"{c} {t * 1e3:6.1f} ms ({total / t / 1e9:4.1f} GB/s, "
                          f"{100 * total / t / 1e9 / bandwidth:3.0f}%)" for c, t in times.items())
        print(f"M={m:3d}  {cells}")


def _paged_setup(q_lens: list[int], ctx: list[int], dtype: torch.dtype, block_size: int = 16):
    seq = [c + q for c, q in zip(ctx, q_lens)]
    need = [-(-s // block_size) for s in seq]
    num_blocks = sum(need) + 1
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    cache = torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM).to(dtype)
    meta = A.build_attention_metadata(q_lens, ctx, tables, block_size, "cpu")
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM).to(dtype)
    return cache, meta, q, seq


def _attention_paths(q, cache, meta, scale) -> dict[str, Callable[[], object]]:
    """The kernel path and the torch path of the same step (k/v writes excluded)."""
    def run(env: str) -> Callable[[], object]:
        os.environ["TOKENWEIR_CPU_KERNELS"] = env
        meta._plan = None
        limits = dict(A.PREFILL_IN_PLACE_MAX_ROWS)  # the kernel path: in place at any size
        A.PREFILL_IN_PLACE_MAX_ROWS.update({isa: 1 << 30 for isa in limits})
        try:
            plan = A._build_plan(meta, cache)
        finally:
            A.PREFILL_IN_PLACE_MAX_ROWS.update(limits)

        def step() -> torch.Tensor:
            out = torch.empty_like(q)
            A._decode_attention(q, cache, plan, scale, out)
            if plan.in_place_prefill_reqs is not None:
                plan.kernel(q, cache, plan.tables, plan.query_start_loc, plan.seq_lens,
                            plan.in_place_prefill_reqs, scale, out)
            for p in plan.prefills:
                if not p.in_place:
                    out[p.start:p.end] = A._prefill_attention(q[p.start:p.end], None, None,
                                                              cache, p, scale)
            return out
        return step
    fns = {"torch": run("0")}
    os.environ["TOKENWEIR_CPU_KERNELS"] = "1"
    if A.paged_kernel_for(cache) is not None:
        fns[f"C++ {kernels.cpu_isa()}"] = run("1")
    os.environ["TOKENWEIR_CPU_KERNELS"] = "1"
    return fns


def bench_decode_scaling(dtype: torch.dtype, repeats: int) -> None:
    """Does the in-place decode kernel scale with threads? 4 decodes (~2 MB of K/V: stays in
    cache across repeats) and 64 decodes (~40 MB: streamed from memory, as in a real step where
    30 layers' K/V pass through) at 1 thread and at torch's count, beside a 256 MiB copy at
    the same counts: a kernel that scales like the copy is bandwidth-bound, not badly threaded."""
    threads = torch.get_num_threads()
    if threads < 2 or A.paged_kernel_for(torch.empty(2, 1, 16, 1, 64, dtype=dtype)) is None:
        return
    elem = torch.empty((), dtype=dtype).element_size()
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    cases = {"copy 256 MiB": (lambda: dst.copy_(src), 2 * src.numel() * 4)}
    for n in (4, 64):
        ctx = [300 + 300 * i // max(1, n - 1) for i in range(n)]
        cache, meta, q, seq = _paged_setup([1] * n, ctx, dtype)
        plan = A._build_plan(meta, cache)
        out = torch.empty_like(q)
        cases[f"{n} decodes"] = (lambda q=q, c=cache, p=plan, o=out:
                                 A._decode_attention(q, c, p, HEAD_DIM ** -0.5, o),
                                 sum(seq) * 2 * KV_HEADS * HEAD_DIM * elem)
    rates: dict[tuple[str, int], float] = {}
    for count in (1, threads):
        torch.set_num_threads(count)
        best = best_of({k: fn for k, (fn, _) in cases.items()}, repeats)
        rates.update({(k, count): cases[k][1] / t / 1e9 for k, t in best.items()})
    torch.set_num_threads(threads)
    print(f"\n## decode kernel thread scaling, {str(dtype)[6:]} (GB/s at 1 and {threads} threads)")
    for k in cases:
        one, many = rates[(k, 1)], rates[(k, threads)]
        print(f"{k:<14}{one:8.1f} {many:8.1f}   x{many / one:.2f}")


def bench_attention(dtype: torch.dtype, peak: float, bandwidth: float, repeats: int) -> None:
    torch.manual_seed(0)
    elem = torch.empty((), dtype=dtype).element_size()
    print(f"\n## decode attention, {str(dtype)[6:]} (GB/s of K/V read, % of {bandwidth:.0f} GB/s)")
    cases = ((1, 500, 500, False), (16, 300, 600, False), (64, 300, 600, False),
             (64, 300, 600, True))
    for n, lo, hi, shuffled in cases:
        ctx = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
        if shuffled:  # the same contexts in a seeded random order (sorted: the rows above)
            random.Random(0).shuffle(ctx)
        cache, meta, q, seq = _paged_setup([1] * n, ctx, dtype)
        times = best_of(_attention_paths(q, cache, meta, HEAD_DIM ** -0.5), repeats)
        nbytes = sum(seq) * 2 * KV_HEADS * HEAD_DIM * elem
        cells = "  ".join(f"{c} {nbytes / t / 1e9:6.1f} ({100 * nbytes / t / 1e9 / bandwidth:3.0f}%)"
                          for c, t in times.items())
        print(f"{n:3d} decodes, ctx {lo}-{hi}{' shuffled' if shuffled else ' sorted  '}   {cells}")
    bench_decode_scaling(dtype, repeats)
    print(f"\n## prefill over a cached prefix, {str(dtype)[6:]} (GFLOP/s, % of {peak:.0f})")
    for rows in (16, 32, 48, 64, 128, 256, 512):
        cache, meta, q, seq = _paged_setup([rows], [512], dtype)
        times = best_of(_attention_paths(q, cache, meta, HEAD_DIM ** -0.5), repeats)
        flop = 4 * HEADS * HEAD_DIM * sum(512 + r + 1 for r in range(rows))
        cells = "  ".join(f"{c} {flop / t / 1e9:6.1f} ({100 * flop / t / 1e9 / peak:3.0f}%)"
                          for c, t in times.items())
        print(f"{rows:4d}-row chunk over 512 cached   {cells}")
    isa = kernels.cpu_isa()
    if isa:
        print(f"(the engine takes chunks of up to {A.PREFILL_IN_PLACE_MAX_ROWS.get(isa)} rows in "
              f"place on {isa}: attention.PREFILL_IN_PLACE_MAX_ROWS)")


def bench_overhead(dtype: torch.dtype, repeats: int) -> None:
    from tokenweir.model.arch import ArchConfig
    from tokenweir.model.llama import CausalLM

    print(f"\n## Python/dispatch share of a batch-1 decode step, {str(dtype)[6:]}")

    def step_time(width: int, heads: int, kv: int, head_dim: int, inter: int, vocab: int) -> float:
        arch = ArchConfig(architecture="llama", vocab_size=vocab, hidden_size=width,
                          intermediate_size=inter, num_layers=30, num_heads=heads,
                          num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=1e-5,
                          rope_theta=1e5, rope_scaling=None, tie_word_embeddings=True,
                          max_position_embeddings=2048)
        model = CausalLM(arch, dtype=dtype)
        for p in model.parameters():
            p.data.normal_(0, 0.02)
        caches = A.allocate_kv_caches(arch, 40, 16, dtype, "cpu")
        table = list(range(1, 34))

        def step() -> None:
            meta = A.build_attention_metadata([1], [500], [table], 16, "cpu")
            with torch.inference_mode():
                h = model(torch.tensor([5]), torch.tensor([500]), meta, caches)
                model.compute_logits(h)
        counter = _OpCounter()
        with counter:
            step()
        return best_of({"step": step}, repeats)["step"], counter.ops

    real, ops = step_time(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB)
    floor, _ = step_time(16, 2, 1, 16, 16, 64)
    print(f"{ops} aten ops per step (a load-independent count; C++ kernel calls not included)")
    print(f"real step {real * 1e3:.2f} ms; same graph at width 16 {floor * 1e3:.2f} ms "
          f"-> Python/dispatch ~{100 * floor / real:.0f}% of a batch-1 decode step")


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("linear", "attention", "overhead"), default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per candidate (best kept)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = ([torch.float32, torch.bfloat16] if args.dtype == "both"
              else [getattr(torch, args.dtype)])
    flags = cpu_flags()
    isa = "avx512_bf16" if "avx512_bf16" in flags else ("avx2" if "avx2" in flags else "other")
    print(f"# CPU {isa}, kernels variant {kernels.cpu_isa() or 'none'}, "
          f"{torch.get_num_threads()} torch threads")
    bandwidth = copy_bandwidth(args.repeats)
    print(f"copy bandwidth {bandwidth:.1f} GB/s")
    for dtype in dtypes:
        peak = matmul_peak(dtype, args.repeats)
        print(f"\n# {str(dtype)[6:]}: matmul peak {peak:.1f} GFLOP/s")
        if args.only in (None, "linear"):
            bench_linear(dtype, peak, args.repeats)
            if dtype == torch.float32:
                bench_linear_model_step(bandwidth, args.repeats)
        if args.only in (None, "attention"):
            bench_attention(dtype, peak, bandwidth, args.repeats)
        if args.only in (None, "overhead"):
            bench_overhead(dtype, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
