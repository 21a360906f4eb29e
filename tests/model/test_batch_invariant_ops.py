"""The batch-invariant ops (issue 38), one at a time: a row's result is the same bits whatever
the other rows of the call. Each test also shows the default op moving the same row (so the
invariant one is not trivially equal), where this machine's default op does."""

from __future__ import annotations

import pytest
import torch

from tokenweir.model import attention as A
from tokenweir.model import kernels, layers
from tokenweir.model.layers import Linear, invariant_matmul, set_batch_invariant

pytestmark = pytest.mark.skipif(
    kernels.paged_attention_kernel() is None or kernels.packed_linear_kernel() is None,
    reason="batch-invariant ops need the C++ CPU kernels")

ROW_COUNTS = (1, 2, 3, 5, 7, 13, 64, 300, 700)


def _linear(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> Linear:
    lin = Linear(k, n, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_in_any_number_of_rows(dtype):
    lin = _linear(96, 600, dtype)  # K = 600: more than two k blocks, and a ragged last panel
    row = torch.randn(1, 600, generator=torch.Generator().manual_seed(1)).to(dtype)
    alone = invariant_matmul(row, lin.weight, lin)
    for m in ROW_COUNTS:
        x = torch.randn(m, 600, generator=torch.Generator().manual_seed(m)).to(dtype)
        for at in {0, m // 2, m - 1}:
            x[at] = row[0]
            assert torch.equal(invariant_matmul(x, lin.weight, lin)[at], alone[0]), (m, at)


def test_the_default_float32_matmul_moves_a_row_with_the_row_count():
    """The cause the invariant kernel removes: the packed kernel's k order changes with M
    (unsplit k and k % KU accumulators at few rows), MKL's above PACKED_MAX_ROWS."""
    lin = _linear(96, 600, torch.float32)
    row = torch.randn(1, 600, generator=torch.Generator().manual_seed(1))
    alone = lin(row)[0]
    moved = []
    for m in ROW_COUNTS[1:]:
        x = torch.randn(m, 600, generator=torch.Generator().manual_seed(m))
        x[0] = row[0]
        if not torch.equal(lin(x)[0], alone):
            moved.append(m)
    assert moved, "the default float32 matmul gave one row the same bits at every row count"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_set_batch_invariant_routes_forward_and_bind(dtype):
    lin = _linear(64, 512, dtype)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    set_batch_invariant(lin, True)
    expected = invariant_matmul(x, lin.weight, lin)
    assert torch.equal(lin(x), expected)
    assert torch.equal(lin.bind(x)(x), expected)
    assert torch.equal(lin(x[4:5]), expected[4:5])
    set_batch_invariant(lin, False)
    assert not getattr(lin, "batch_invariant")


def _paged_case(dtype: torch.dtype, ctx: int, chunk: int, heads: int = 8, kv_heads: int = 2):
    """One request whose `chunk` rows at positions ctx.. attend a cache of ctx + chunk keys,
    and the same rows as `chunk` separate decodes (one per position)."""
    gen = torch.Generator().manual_seed(3)
    d, bs = 64, 16
    total = ctx + chunk
    nblk = -(-total // bs) + 1
    cache = torch.randn(2, nblk + 1, bs, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(chunk, heads, d, generator=gen).to(dtype)
    blocks = list(range(1, nblk + 1))
    return cache, q, blocks, total


def _attend(cache, q, meta) -> torch.Tensor:
    plan = meta.plan(cache)
    out = torch.zeros_like(q)
    if plan.fixed_order_reqs is not None:
        plan.kernel(q, cache, plan.tables, plan.query_start_loc, plan.seq_lens,
                    plan.fixed_order_reqs, 0.125, out, fixed_order=True)
    else:  # the default path, without writing K/V (the cache already holds them)
        plan.kernel(q, cache, plan.tables, plan.query_start_loc, plan.seq_lens,
                    torch.arange(len(meta.query_lens_cpu)), 0.125, out)
    return out


# (ctx, chunk, heads, kv_heads): chunks of one and of several 16-row work items, a last item
# of a few rows, keys ending inside a group of 8 / 16 and on a block boundary, GQA groups of
# 4 and of 3 (SmolLM2's 9 / 3: tiles of 3), and a group wider than a tile (12 / 1)
ATTENTION_CASES = [(40, 24, 8, 2), (0, 37, 9, 3), (5, 100, 9, 3), (128, 33, 8, 2),
                   (3, 1, 8, 2), (16, 16, 12, 1), (61, 70, 9, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx,chunk,heads,kv_heads", ATTENTION_CASES)
def test_a_chunk_row_attends_as_the_decode_at_its_position(dtype, ctx, chunk, heads, kv_heads):
    cache, q, blocks, total = _paged_case(dtype, ctx, chunk, heads, kv_heads)
    outs = {}
    for invariant in (False, True):
        as_chunk = A.build_attention_metadata([chunk], [ctx], [blocks], 16, "cpu",
                                              batch_invariant=invariant)
        as_decodes = A.build_attention_metadata([1] * chunk, list(range(ctx, total)),
                                                [blocks] * chunk, 16, "cpu",
                                                batch_invariant=invariant)
        outs[invariant] = (_attend(cache, q, as_chunk), _attend(cache, q, as_decodes))
    chunk_rows, decode_rows = outs[True]
    assert torch.equal(chunk_rows, decode_rows)
    default_chunk, default_decodes = outs[False]
    # the default path computes the same attention, in another order
    torch.testing.assert_close(default_decodes, decode_rows, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(default_chunk, decode_rows, rtol=2e-2, atol=2e-2)
    if kernels.cpu_isa() == "avx512bf16" and dtype == torch.bfloat16 and chunk > 1:
        # the default path's one-pass BF16 dot products take prefill items of > 1 row, its
        # decodes the float32 two-pass path: a row of a longer chunk moves off its decode bits
        # (a one-row chunk is attended as a decode is). The fixed order takes the one-pass path
        # for every row (paged_attention_impl.h), so its rows may equal the default chunk's.
        assert not torch.equal(default_chunk, default_decodes)


def test_batch_invariant_metadata_refuses_a_backend():
    with pytest.raises(ValueError, match="batch-invariant attention"):
        A.build_attention_metadata([1], [3], [[1]], 16, "cpu", backend=object(),
                                   batch_invariant=True)


# oneDNN's bfloat16 GEMM on fixed tiles (layers.INVARIANT_TILE_ROWS, CPUs with native
# bfloat16): SmolLM2's five weight shapes (its 3072 and 49152 rows are where oneDNN's result for
# a row changes with the row count) and odd ones (ragged N, K not a multiple of 32)
TILE_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (100, 72),
               (512, 600)]
TILE_ROW_COUNTS = (1, 2, 7, 63, 64, 65, 130, 300)

native_tiles = pytest.mark.skipif(
    kernels.cpu_isa() != "avx512bf16" or not layers.onednn_bf16_packing(),
    reason="oneDNN's bfloat16 tiles are the invariant path on CPUs with native bfloat16 only")


@native_tiles
@pytest.mark.parametrize("n,k", TILE_SHAPES)
def test_a_row_is_the_same_bits_in_any_tile_of_onednn_rows(n, k):
    """The property the tiled path rests on, checked on this torch / oneDNN build: a row gets
    the same bits from a fixed-size oneDNN call wherever it sits and whatever the other rows
    (random, or the zeros that pad a last tile), over many row counts and positions."""
    lin = _linear(n, k, torch.bfloat16, seed=n + k)
    set_batch_invariant(lin, True)
    gen = torch.Generator().manual_seed(k)
    row = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    alone = lin(row)[0]
    assert lin.__dict__.get(layers._WIDENED_ATTR) is None  # probe: oneDNN's path, not panels
    for m in TILE_ROW_COUNTS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        for at in sorted({0, 1 % m, m // 2, m - 1}):
            x[at] = row[0]
            assert torch.equal(lin(x)[at], alone), (n, k, m, at)
            x[at] = torch.randn(k, generator=gen).to(torch.bfloat16)


@native_tiles
def test_onednn_moves_a_row_with_the_row_count_without_tiles():
    """Why the tiles: called on the rows as they come, oneDNN's bfloat16 GEMM gives a row other
    bits at some row counts (so the test above can fail)."""
    moved = []
    for n, k in TILE_SHAPES:
        lin = _linear(n, k, torch.bfloat16, seed=n + k)
        packed = layers.onednn_pack(lin.weight)
        gen = torch.Generator().manual_seed(k)
        row = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        alone = layers.onednn_linear(row, packed, None)[0]
        for m in TILE_ROW_COUNTS[1:]:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            x[0] = row[0]
            if not torch.equal(layers.onednn_linear(x, packed, None)[0], alone):
                moved.append((n, m))
    assert moved, "oneDNN gave a row the same bits at every row count"


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_a_narrower_isa_keeps_the_widened_float32_panels(isa, monkeypatch):
    """TOKENWEIR_CPU_ISA=avx512 / avx2 (and CPUs without native bfloat16): bfloat16 invariant
    matmuls run the packed float32 kernel on widened panels, invariant as before."""
    monkeypatch.setenv("TOKENWEIR_CPU_ISA", isa)
    if kernels.cpu_isa() != isa:
        pytest.skip(f"this CPU cannot run the {isa} variant")
    lin = _linear(96, 600, torch.bfloat16)
    set_batch_invariant(lin, True)
    row = torch.randn(1, 600, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    alone = lin(row)[0]
    assert lin.__dict__.get(layers._WIDENED_ATTR) is not None  # probe: the widened panels
    x = torch.randn(70, 600, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[69] = row[0]
    assert torch.equal(lin(x)[69], alone)


# Larger oneDNN calls (layers.INVARIANT_BIG_TILES): a size is called only where a run-time probe
# found it gives every row the 16-row bits.
BIG_ROW_COUNTS = (40, 300, 800, 1000, 2100)


def _count_step_calls(monkeypatch) -> list[int]:
    """The rows of each layers.onednn_linear call made from now on by the matmuls themselves,
    appended to the returned list; the tile probe's own calls (onednn_tile_agrees) not counted."""
    sizes: list[int] = []
    probing: list[bool] = []
    real, real_agrees = layers.onednn_linear, layers.onednn_tile_agrees

    def agrees(*args, **kwargs):
        probing.append(True)
        try:
            return real_agrees(*args, **kwargs)
        finally:
            probing.pop()

    def counted(x, p, b):
        if not probing:
            sizes.append(x.shape[0])
        return real(x, p, b)

    monkeypatch.setattr(layers, "onednn_tile_agrees", agrees)
    monkeypatch.setattr(layers, "onednn_linear", counted)
    return sizes


@native_tiles
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536)])
def test_a_row_is_the_same_bits_in_a_big_step_as_alone(n, k, monkeypatch):
    """A row among hundreds or thousands (the calls a prefill step makes) gets its bits alone,
    and every row of the step the bits of 16-row calls; probe: the steps themselves made calls
    of a big size (so the big path, not only 16-row tiles, is checked; the tile probe's own
    calls are not counted)."""
    lin = _linear(n, k, torch.bfloat16, seed=n + k)
    set_batch_invariant(lin, True)
    gen = torch.Generator().manual_seed(k)
    row = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    alone = lin(row)[0]
    real = layers.onednn_linear  # the reference's 16-row calls, not counted
    sizes = _count_step_calls(monkeypatch)
    packed = layers.onednn_pack(lin.weight)
    for m in BIG_ROW_COUNTS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        ats = sorted({0, m // 2, m - 1})
        x[ats] = row[0]
        out = lin(x)
        for at in ats:
            assert torch.equal(out[at], alone), (n, k, m, at)
        tiles = torch.cat((x, x.new_zeros((-m % 16, k)))).split(16)  # every row: its 16-row bits
        assert torch.equal(out, torch.cat([real(t, packed, None) for t in tiles])[:m]), (n, k, m)
    assert any(size > layers.INVARIANT_TILE_ROWS for size in sizes), sorted(set(sizes))


def test_the_tile_plan_uses_only_agreeing_sizes_and_covers_the_rows():
    plan = layers.invariant_tile_plan
    assert plan(1, lambda size: True) == [16]
    assert plan(40, lambda size: True) == [32, 16]
    assert plan(1000, lambda size: True) == [1024]
    assert plan(700, lambda size: True) == [32] * 21 + [16] * 2  # 1024 would pad over 1/4
    assert plan(2100, lambda size: True) == [2048, 32, 16, 16]
    assert plan(2100, lambda size: size != 2048) == [1024, 1024, 32, 16, 16]
    assert plan(1000, lambda size: False) == [16] * 63
    asked: list[int] = []
    plan(20, lambda size: asked.append(size) or True)
    assert asked == [], "a size the rows cannot use was probed"


@native_tiles
def test_a_size_that_disagrees_is_never_called(monkeypatch):
    """The probe's answer is obeyed: with 1024 and 32 marked as disagreeing, a 1000-row matmul
    makes only 16-row calls (and the same bits as with them)."""
    lin = _linear(96, 600, torch.bfloat16)
    set_batch_invariant(lin, True)
    x = torch.randn(1000, 600, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    monkeypatch.setitem(layers._TILE_AGREES, (96, 600, 1024, threads), False)
    monkeypatch.setitem(layers._TILE_AGREES, (96, 600, 32, threads), False)
    sizes = _count_step_calls(monkeypatch)
    out = lin(x)
    assert set(sizes) == {layers.INVARIANT_TILE_ROWS}
    monkeypatch.delitem(layers._TILE_AGREES, (96, 600, 1024, threads))
    monkeypatch.delitem(layers._TILE_AGREES, (96, 600, 32, threads))
    assert torch.equal(lin(x), out)  # the probed sizes, whichever agree: the same bits


# The AMX kernel (kernels.amx_linear_kernel, amx_linear_impl.h): on CPUs with AMX-BF16 the
# invariant bfloat16 matmul below 769 rows is one AMX call, whose bits must be oneDNN's 16-row
# bits (big steps mix it with oneDNN's 1024/2048-row calls).
AMX_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (64, 96)]
AMX_ROW_COUNTS = (1, 2, 15, 16, 17, 33, 63, 64, 65, 130, 300)

amx_kernel = pytest.mark.skipif(
    kernels.amx_linear_kernel() is None or not layers.onednn_bf16_packing(),
    reason="the AMX kernel runs on CPUs with AMX-BF16 (and oneDNN's bfloat16 packing) only")


def _amx_case(n: int, k: int):
    lin = _linear(n, k, torch.bfloat16, seed=n + k)
    return lin, kernels.pack_amx_weight(lin.weight), layers.onednn_pack(lin.weight)


@amx_kernel
@pytest.mark.parametrize("n,k", AMX_SHAPES)
def test_the_amx_kernel_gives_every_row_onednn_16_row_bits(n, k):
    """Its contract's second half, on this torch / oneDNN build: each row the bits a 16-row
    oneDNN call gives it (random rows, and a last 16-row block padded inside the kernel)."""
    _, tiles, packed = _amx_case(n, k)
    amx = kernels.amx_linear_kernel()
    gen = torch.Generator().manual_seed(n)
    for m in (1, 7, 16, 33, 64, 100):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        tiles16 = torch.cat((x, x.new_zeros((-m % 16, k)))).split(16)
        ref = torch.cat([layers.onednn_linear(t, packed, None) for t in tiles16])[:m]
        assert torch.equal(amx(x, tiles, n, False), ref), (n, k, m)


@amx_kernel
@pytest.mark.parametrize("n,k", AMX_SHAPES[:4])
def test_the_amx_kernel_gives_a_row_its_bits_in_any_rows(n, k):
    """Every row's result among any number of rows (whole 32-row blocks, a lone 16-row block,
    the padded last block) = its result alone; float_out = those bits widened."""
    _, tiles, _ = _amx_case(n, k)
    amx = kernels.amx_linear_kernel()
    gen = torch.Generator().manual_seed(k)
    for m in AMX_ROW_COUNTS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        out = amx(x, tiles, n, False)
        alone = torch.cat([amx(x[i:i + 1], tiles, n, False) for i in range(m)])
        assert torch.equal(out, alone), (n, k, m, (out != alone).any(1).nonzero()[:4].tolist())
        assert torch.equal(amx(x, tiles, n, True), out.float()), (n, k, m)


def _count_calls(monkeypatch) -> dict[str, list[int]]:
    """Rows of every oneDNN and AMX call the layers make from now on."""
    calls: dict[str, list[int]] = {"onednn": [], "amx": []}
    real_onednn, real_amx_kernel = layers.onednn_linear, kernels.amx_linear_kernel

    def amx_kernel():  # None where the real one is (TOKENWEIR_AMX_LINEAR=0, ...)
        real = real_amx_kernel()
        return real and (lambda x, *a: calls["amx"].append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(layers, "onednn_linear",
                        lambda x, p, b: calls["onednn"].append(x.shape[0]) or real_onednn(x, p, b))
    monkeypatch.setattr(kernels, "amx_linear_kernel", amx_kernel)
    return calls


@amx_kernel
def test_a_decode_step_is_one_amx_call_with_the_tiles_bits(monkeypatch):
    """A 64-row step of a SmolLM2 weight: one AMX call on its 64 rows, no oneDNN call (the
    tiles made two 32-row calls), and the same bits as with TOKENWEIR_AMX_LINEAR=0's tiles."""
    lin, _, _ = _amx_case(3072, 576)
    set_batch_invariant(lin, True)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    calls = _count_calls(monkeypatch)
    out = lin(x)
    assert calls == {"onednn": [], "amx": [64]}
    assert lin.__dict__.get(layers._AMX_ATTR) is not None  # probe: the AMX tiles were packed
    monkeypatch.setenv("TOKENWEIR_AMX_LINEAR", "0")
    calls["amx"].clear()
    tiles_out = lin(x)
    assert calls["amx"] == [] and calls["onednn"] and max(calls["onednn"]) < 64  # probe: tiles
    assert torch.equal(out, tiles_out)


@amx_kernel
def test_a_big_step_on_the_amx_path_calls_only_agreeing_sizes(monkeypatch):
    """Over 768 rows: oneDNN's 1024-row call where the probe (against the AMX kernel) agrees,
    the rest one AMX call, every row the bits of an all-AMX call; marked disagreeing, 1024 is
    never called."""
    lin, _, _ = _amx_case(960, 576)
    set_batch_invariant(lin, True)
    x = torch.randn(1100, 576, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    lin(x)  # runs the probe
    key = (960, 576, 1024, torch.get_num_threads(), "amx")
    agrees = layers._TILE_AGREES[key]
    calls = _count_calls(monkeypatch)
    mixed = lin(x)
    assert calls == ({"onednn": [1024], "amx": [76]} if agrees else
                     {"onednn": [], "amx": [1100]}), agrees
    monkeypatch.setitem(layers._TILE_AGREES, key, False)
    calls["onednn"].clear(), calls["amx"].clear()
    assert torch.equal(lin(x), mixed)
    assert calls == {"onednn": [], "amx": [1100]}
