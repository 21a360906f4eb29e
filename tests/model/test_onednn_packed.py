"""CPU bfloat16 matmuls on a weight packed once for oneDNN (layers.ONEDNN_PACK_HINT_ROWS):
the same rows as F.linear at every row count a step has (bucketed or not), with a bias; the
weight is packed once per module and repacked when it changes; opting out keeps F.linear; the
whole paged forward gives the same greedy tokens packed and unpacked. Each test checks which
path ran. Skipped, with the reason, where oneDNN does not pack bfloat16 (AVX2-only CPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_paths import count_amx_rows, random_linear
from tokenweir.model import kernels, layers

pytestmark = pytest.mark.skipif(not layers.onednn_bf16_packing(),
                                reason="oneDNN does not pack bfloat16 weights on this CPU "
                                       "(needs AVX-512; AVX2-only CPUs keep F.linear)")


@pytest.fixture
def packings(monkeypatch):
    """Count the oneDNN weight packings and packed matmuls; packing switched on, the AMX
    kernel's decode rows off (tests/model/test_amx_decode.py has them)."""
    monkeypatch.setattr(layers, "PACK_LINEAR", True)
    monkeypatch.setenv("TOKENWEIR_AMX_LINEAR", "0")
    calls = {"pack": 0, "run": 0}
    pack, run = layers.onednn_pack, layers.onednn_linear

    def counting_pack(*args):
        calls["pack"] += 1
        return pack(*args)

    def counting_run(*args):
        calls["run"] += 1
        return run(*args)
    monkeypatch.setattr(layers, "onednn_pack", counting_pack)
    monkeypatch.setattr(layers, "onednn_linear", counting_run)
    return calls


def _bf16_linear(k: int, n: int, bias: bool, seed: int) -> layers.Linear:
    return random_linear(k, n, bias, seed).to(torch.bfloat16)


@torch.inference_mode()
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_packed_rows_equal_f_linear(packings, bias):
    lin = _bf16_linear(96, 200, bias, seed=3)
    for rows in (1, 2, 7, 16, 17, 64, 100, 300):
        x = torch.randn(rows, 96).bfloat16()
        got = lin(x)
        assert got.shape == (rows, 200) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), F.linear(x, lin.weight, lin.bias).float(),
                                   rtol=1e-2, atol=1e-2, msg=lambda m: f"rows={rows}: {m}")
    assert packings == {"pack": 1, "run": 8}  # probe: packed once, every matmul on the pack


@torch.inference_mode()
def test_a_changed_weight_is_repacked(packings):
    lin = _bf16_linear(32, 48, False, seed=4)
    x = torch.randn(5, 32).bfloat16()
    lin(x)
    lin.weight = torch.nn.Parameter(torch.randn(48, 32).bfloat16(), requires_grad=False)
    torch.testing.assert_close(lin(x).float(), F.linear(x, lin.weight).float(), rtol=1e-2,
                               atol=1e-2)
    assert packings["pack"] == 2  # probe: the new weight was packed, not the old one reused


@torch.inference_mode()
def test_opted_out_or_float32_never_packs(packings, monkeypatch):
    _bf16_linear(32, 48, False, seed=5)(torch.randn(3, 32).bfloat16())
    assert packings["pack"] == 1  # the probe: packing is on in this fixture
    monkeypatch.setattr(layers, "PACK_LINEAR", False)
    _bf16_linear(32, 48, False, seed=5)(torch.randn(3, 32).bfloat16())
    monkeypatch.setattr(layers, "PACK_LINEAR", True)
    random_linear(32, 48, False, seed=5)(torch.randn(100 + layers.PACKED_MAX_ROWS, 32))
    assert packings == {"pack": 1, "run": 1}


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from tiny_models import load_tiny

    return load_tiny(tmp_path_factory, "llama_tied", 12, torch.bfloat16)


@torch.inference_mode()
def test_model_greedy_is_the_same_packed_and_unpacked(tiny_bf16, packings, monkeypatch):
    """The whole paged forward in bfloat16 (decodes, chunks, the tied LM head) on packed
    weights vs F.linear, and on the AMX kernel's decode rows where it runs
    (layers.AMX_DECODE_MAX_ROWS): the same greedy tokens, logits within bfloat16 rounding."""
    from paged_driver import PagedDriver, run_greedy

    model, arch = tiny_bf16.model, tiny_bf16.arch
    prompts = {"a": [5, 9, 33, 7, 100, 4, 8], "b": [3], "c": list(range(10, 40))}
    monkeypatch.setenv("TOKENWEIR_AMX_LINEAR", "1")  # `packings` switched it off
    paths = ("packed", "unpacked") + (("amx",) if kernels.amx_linear_kernel() else ())
    amx_rows = count_amx_rows(monkeypatch)
    runs = {}
    for path in paths:
        monkeypatch.setattr(layers, "PACK_LINEAR", path != "unpacked")
        monkeypatch.setenv("TOKENWEIR_AMX_LINEAR", "1" if path == "amx" else "0")
        layers.drop_packed_weights(model)
        before = (packings["run"], len(amx_rows))
        driver = PagedDriver(model, arch, block_size=4, dtype=torch.bfloat16)
        runs[path] = run_greedy(driver, prompts, 6, chunk=5, stagger=True)
        # probes: which path ran
        assert (packings["run"] > before[0]) == (path == "packed"), path
        assert (len(amx_rows) > before[1]) == (path == "amx"), path
    for path, run in runs.items():
        assert run[0] == runs["unpacked"][0], path
        for (rid, n, got), (rid2, n2, want) in zip(run[1], runs["unpacked"][1]):
            assert (rid, n) == (rid2, n2)
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2)

