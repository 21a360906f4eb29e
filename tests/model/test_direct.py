"""The direct path (model/direct.py) against the module path it stands in for: bit-identical
logits and KV caches over decode batches, small mixed steps (prefill chunks beside decodes) and
a step of 34 rows, float32 and bfloat16, with biases, packed and unpacked weights, on the kernel
variants this CPU runs and under int8 quantization; each run probes which path ran. It declines
where it must (q/k norm, kernels off) and rebinds after a weight changes."""

from __future__ import annotations

import pytest
import torch

from kernel_paths import force_path
from paged_driver import PagedDriver, run_greedy
from tiny_models import load_tiny
from tokenweir.model import direct, layers
from tokenweir.model.layers import DIRECT_ATTR

PROMPTS = {"a": [5, 9, 33, 7, 100, 4, 8, 60, 61, 62], "b": [3, 4, 5], "c": list(range(20, 41))}


@pytest.fixture
def direct_runs(monkeypatch):
    """Count DirectStack.run calls (the probe that the direct path ran)."""
    runs = {"n": 0}
    real = direct.DirectStack.run

    def counted(self, *args, **kwargs):
        runs["n"] += 1
        return real(self, *args, **kwargs)
    monkeypatch.setattr(direct.DirectStack, "run", counted)
    return runs


def _greedy(model, arch, dtype, enabled: bool, monkeypatch):
    """Two greedy runs: chunks of 5 tokens, staggered starts (steps of 1-15 rows, decodes beside
    prefill chunks), then every prompt at once (a first step of 34 rows, bucketed in bfloat16)."""
    monkeypatch.setattr(direct, "ENABLED", enabled)
    runs, rows = [], []
    for chunk, stagger in ((5, True), (None, False)):
        driver = PagedDriver(model, arch, block_size=4, dtype=dtype)
        step = driver.step
        driver.step = lambda schedule, step=step: rows.append(sum(n for _, n in schedule)) or \
            step(schedule)
        tokens, records = run_greedy(driver, PROMPTS, 6, chunk=chunk, stagger=stagger)
        runs.append((tokens, records, driver.kv_caches))
    assert min(rows) == 1 and max(rows) == 34  # probe: small and large row classes both ran
    return runs, len(rows)


def _assert_same(a, b) -> None:
    for (tok_a, rec_a, kv_a), (tok_b, rec_b, kv_b) in zip(a[0], b[0], strict=True):
        assert tok_a == tok_b
        assert len(rec_a) == len(rec_b)
        for (rid, n, la), (_, _, lb) in zip(rec_a, rec_b):
            assert torch.equal(la, lb), (rid, n)
        assert all(torch.equal(x, y) for x, y in zip(kv_a, kv_b))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("path", ["avx2", "avx512bf16", "avx512bf16-unpacked"])
@torch.inference_mode()
def test_direct_equals_module_path(kind, dtype, path, tmp_path_factory, monkeypatch,
                                   direct_runs):
    """-unpacked: TOKENWEIR_PACK_LINEAR=0 (few-rows kernel / F.linear; bfloat16 unpacked)."""
    force_path(path.removesuffix("-unpacked"), monkeypatch)
    if path.endswith("-unpacked"):
        monkeypatch.setattr(layers, "PACK_LINEAR", False)
    loaded = load_tiny(tmp_path_factory, kind, 3, dtype)
    module_run = _greedy(loaded.model, loaded.arch, dtype, False, monkeypatch)
    assert direct_runs["n"] == 0
    direct_run = _greedy(loaded.model, loaded.arch, dtype, True, monkeypatch)
    assert direct_runs["n"] == direct_run[1] > 0  # probe: every step took it
    _assert_same(direct_run, module_run)


@torch.inference_mode()
def test_direct_under_int8(tmp_path_factory, monkeypatch, direct_runs, int8_calls):
    if not layers.onednn_bf16_packing():
        pytest.skip("int8 decode needs oneDNN bfloat16 (AVX-512)")
    force_path(_widest(), monkeypatch)
    loaded = load_tiny(tmp_path_factory, "llama_tied", 13, torch.bfloat16)
    int8_rows = int8_calls
    layers.set_quantization(loaded.model, "int8")
    module_run = _greedy(loaded.model, loaded.arch, torch.bfloat16, False, monkeypatch)
    module_int8 = len(int8_rows)
    direct_run = _greedy(loaded.model, loaded.arch, torch.bfloat16, True, monkeypatch)
    assert direct_runs["n"] > 0 and len(int8_rows) == 2 * module_int8 > 0  # probe: both on int8
    _assert_same(direct_run, module_run)


def _widest() -> str:
    from tokenweir.model import kernels
    return kernels.cpu_isa() or "torch"


@torch.inference_mode()
def test_direct_declines(tmp_path_factory, monkeypatch):
    loaded = load_tiny(tmp_path_factory, "llama", 3, torch.float32)
    model = loaded.model.model
    positions = torch.arange(3)
    if _widest() == "torch":
        pytest.skip("no C++ kernels here: the direct path never applies")
    assert direct.direct_stack(model, torch.zeros(3, 64), positions) is not None
    above = [direct.direct_stack(model, torch.zeros(n, 64), torch.arange(n)) for n in (17, 300)]
    assert above[0] is not None and above[0] is above[1]  # one stack for every count above 16
    monkeypatch.setenv("TOKENWEIR_CPU_KERNELS", "0")
    assert direct.direct_stack(model, torch.zeros(3, 64), positions) is None
    monkeypatch.delenv("TOKENWEIR_CPU_KERNELS")
    qwen3 = load_tiny(tmp_path_factory, "qwen3", 3, torch.float32).model.model
    assert direct.direct_stack(qwen3, torch.zeros(3, 64), positions) is None  # q/k norm


@torch.inference_mode()
def test_direct_rebinds_after_a_weight_changes(tmp_path_factory, monkeypatch,
                                                        direct_runs):
    if _widest() == "torch":
        pytest.skip("no C++ kernels here: the direct path never applies")
    loaded = load_tiny(tmp_path_factory, "llama", 5, torch.float32)
    model = loaded.model.model
    first = direct.direct_stack(model, torch.zeros(1, 64), torch.arange(1))
    assert first is not None and first.valid()
    weight = model.layers[1].mlp.down_proj.weight
    if weight.is_inference():  # untracked (as for packed_weight): a new tensor is seen
        weight.data = weight.data * 1.5
    else:
        with torch.no_grad():
            weight.mul_(1.5)
    assert not first.valid()
    again = direct.direct_stack(model, torch.zeros(1, 64), torch.arange(1))
    assert again is not None and again is not first and again.valid()
    module_run = _greedy(loaded.model, loaded.arch, torch.float32, False, monkeypatch)
    direct_run = _greedy(loaded.model, loaded.arch, torch.float32, True, monkeypatch)
    assert direct_runs["n"] > 0
    _assert_same(direct_run, module_run)
    layers.drop_packed_weights(loaded.model)  # as after loading weights: every stack dropped
    assert DIRECT_ATTR not in model.__dict__
