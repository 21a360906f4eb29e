"""The packed-weight C++ matmul (linear_impl.h) behind Linear and the LM head on CPU float32:
equal to F.linear (to float32 rounding) at every row count 1..64 (every microkernel row count
and remainder), weight row counts that leave a ragged last panel, K with odd tails, on each
instruction-set variant this CPU runs; the weight is packed once and repacked when it changes;
above the row cap, for bfloat16, and when opted out, other paths run. Each test checks which
path ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenweir.model import kernels
from tokenweir.model import layers

from kernel_paths import random_linear, require_kernels, widest_variant

SHAPES = [(576, 960), (37, 7), (5, 33), (64, 16), (1536, 17)]  # (K, N)
SHAPE_IDS = ["qkv", "k-and-n-tails", "tiny-k", "one-panel", "long-k-ragged"]


def _isas() -> list[str]:
    """The variants to test: avx2 always (where the CPU has it), avx512 only where it runs."""
    if kernels.packed_linear_kernel() is None:
        return []
    return ["avx2", "avx512"]


@pytest.fixture(params=["avx2", "avx512"])
def packed_kernel(request, monkeypatch):
    monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "1")
    monkeypatch.setenv("TOKENWEIR_CPU_ISA", request.param)
    require_kernels()
    kernel = kernels.packed_linear_kernel()
    if kernel is None or kernel.isa != request.param:  # None: a forced variant it cannot run
        pytest.skip(f"this CPU cannot run the {request.param} variant (needs "
                    f"{kernels.ISA_NEEDS[request.param]}; {widest_variant(monkeypatch)})")
    assert kernel.panel == {"avx2": 16, "avx512": 32}[request.param]
    return kernel


@pytest.mark.parametrize("k,n", SHAPES, ids=SHAPE_IDS)
def test_kernel_matches_f_linear_at_every_row_count(packed_kernel, k, n):
    torch.manual_seed(k * 7 + n)
    w = torch.randn(n, k)
    packed = kernels.pack_linear_weight(w, packed_kernel.panel)
    assert packed.shape == (-(-n // packed_kernel.panel), k, packed_kernel.panel)
    for rows in range(1, 65):
        x = torch.randn(rows, k)
        got = packed_kernel(x, packed, n)
        assert got.shape == (rows, n)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4 * k ** 0.5,
                                   msg=lambda m: f"rows={rows}: {m}")


# linear_impl.h's kRowChunk (96): a thread runs its panels over one chunk of rows at a time
ROW_CHUNK = 96


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 17)], ids=["qkv", "long-k-ragged"])
def test_chunks_of_rows_keep_every_rows_bits(packed_kernel, k, n):
    """A call on several chunks of rows (and a ragged last one) gives every row the bits a call
    on its chunk alone gives (one chunk runs the loop as it was before chunking), in the
    default order and in fixed order: chunking moved no row's sums."""
    torch.manual_seed(k + n)
    w = torch.randn(n, k)
    packed = kernels.pack_linear_weight(w, packed_kernel.panel)
    x = torch.randn(3 * ROW_CHUNK + 13, k)
    for fixed in (False, True):
        out = packed_kernel(x, packed, n, fixed_order=fixed)
        alone = torch.cat([packed_kernel(c.contiguous(), packed, n, fixed_order=fixed)
                           for c in x.split(ROW_CHUNK)])
        assert torch.equal(out, alone), fixed


def test_kernel_rejects_a_packing_for_another_shape(packed_kernel):
    packed = kernels.pack_linear_weight(torch.randn(40, 64), packed_kernel.panel)
    with pytest.raises(RuntimeError):
        packed_kernel(torch.randn(2, 63), packed, 40)  # K disagrees
    with pytest.raises(RuntimeError):
        packed_kernel(torch.randn(2, 64), packed, 40 + 2 * packed_kernel.panel)  # N disagrees


@pytest.fixture
def packed_calls(monkeypatch):
    """Count the packed kernel's calls and the weight packings; the packed path switched on."""
    monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "1")
    monkeypatch.setattr(layers, "PACK_LINEAR", True)
    require_kernels()
    kernel = kernels.packed_linear_kernel()
    calls: dict[str, list] = {"run": [], "pack": []}

    def counting(x, packed, n):
        calls["run"].append(tuple(x.shape))
        return kernel(x, packed, n)

    counting.panel = kernel.panel
    real_pack = kernels.pack_linear_weight

    def counting_pack(w, panel):
        calls["pack"].append(tuple(w.shape))
        return real_pack(w, panel)

    monkeypatch.setattr(kernels, "packed_linear_kernel", lambda: counting)
    monkeypatch.setattr(kernels, "pack_linear_weight", counting_pack)
    return calls




@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_packs_once_and_serves_every_row_count_up_to_the_cap(packed_calls, bias):
    lin = random_linear(96, 50, bias, seed=3)
    with torch.no_grad():
        for rows in (1, 5, 13, layers.PACKED_MAX_ROWS):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5,
                                       atol=1e-3)
    assert packed_calls["run"] == [(r, 96) for r in (1, 5, 13, layers.PACKED_MAX_ROWS)]
    assert packed_calls["pack"] == [(50, 96)]  # probe: packed once, reused


def test_a_changed_weight_is_repacked(packed_calls):
    lin = random_linear(64, 24, False, seed=4)
    x = torch.randn(3, 64)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(2.0)  # in place: bumps the version
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-3)
        lin.weight.data.copy_(torch.randn(24, 64))  # through .data: no version bump ...
        layers.drop_packed_weights(lin)  # ... so the writer drops the packs (load_weights does)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-3)
    assert len(packed_calls["pack"]) == 3


def test_above_the_cap_bf16_and_opted_out_other_paths_run(packed_calls, monkeypatch):
    lin = random_linear(64, 32, True, seed=5)
    with torch.no_grad():
        wide = torch.randn(layers.PACKED_MAX_ROWS + 1, 64)
        torch.testing.assert_close(lin(wide), F.linear(wide, lin.weight, lin.bias))
        lin_bf16 = random_linear(64, 32, False, seed=6).to(torch.bfloat16)
        lin_bf16(torch.randn(2, 64, dtype=torch.bfloat16))
        monkeypatch.setattr(layers, "PACK_LINEAR", False)
        x = torch.randn(2, 64)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5,
                                   atol=1e-3)
    assert packed_calls["run"] == [] and packed_calls["pack"] == []


def test_lm_head_takes_the_packed_kernel_up_to_its_cap(packed_calls):
    from types import SimpleNamespace

    from tokenweir.model.llama import CausalLM

    torch.manual_seed(0)
    head = SimpleNamespace(lm_head_weight=torch.randn(1000, 64))
    for rows, expect_kernel in ((layers.PACKED_MAX_ROWS_LM_HEAD, True),
                                (layers.PACKED_MAX_ROWS_LM_HEAD + 1, False)):
        packed_calls["run"].clear()
        hidden = torch.randn(rows, 64)
        logits = CausalLM.compute_logits(head, hidden)
        assert logits.dtype == torch.float32
        assert (packed_calls["run"] == [(rows, 64)]) == expect_kernel
        torch.testing.assert_close(logits, hidden @ head.lm_head_weight.t(), rtol=1e-5,
                                   atol=1e-3)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    from tiny_models import load_tiny

    return load_tiny(tmp_path_factory, "llama_tied", 11, torch.float32)


@torch.inference_mode()
def test_model_greedy_is_the_same_packed_and_unpacked(tiny_tied, packed_calls, monkeypatch):
    """The whole paged forward (decodes, chunks, tied LM head) with the packed kernel vs opted
    out: the same greedy tokens, logits within float32 reordering."""
    from paged_driver import PagedDriver, run_greedy

    model, arch = tiny_tied.model, tiny_tied.arch
    prompts = {"a": [5, 9, 33, 7, 100, 4, 8], "b": [3], "c": list(range(10, 40))}
    runs = {}
    for pack in (True, False):
        monkeypatch.setattr(layers, "PACK_LINEAR", pack)
        runs[pack] = run_greedy(PagedDriver(model, arch, block_size=4), prompts, 6, chunk=5,
                                stagger=True)
    assert len(packed_calls["run"]) > 0  # probe: the packed kernel ran in the packed run
    assert runs[True][0] == runs[False][0]
    for (rid, n, got), (rid2, n2, want) in zip(runs[True][1], runs[False][1]):
        assert (rid, n) == (rid2, n2)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@torch.inference_mode()
def test_load_weights_drops_the_packs(tiny_tied, packed_calls):
    model = tiny_tied.model
    layers.drop_packed_weights(model)  # an earlier test may have packed the head already
    hidden = torch.randn(2, tiny_tied.arch.hidden_size)
    model.compute_logits(hidden)
    model.compute_logits(hidden)
    packs = len(packed_calls["pack"])
    assert packs == 1  # packed once, then reused
    new_embed = torch.randn_like(model.model.embed_tokens.weight)
    model.load_weights([("model.embed_tokens.weight", new_embed)])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ new_embed.t(), rtol=1e-5,
                               atol=1e-3)
    assert len(packed_calls["pack"]) == packs + 1  # probe: repacked from the new weight
