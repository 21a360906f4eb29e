"""--batch-invariant (issue 38): a request's tokens and logprobs are the same bits alone, in a
batch of 64, chunked at 16/64/256, behind a cached prefix, preempted by recompute or by swap,
and as sample i of n = 8 (= alone with seed + i); float32 and bfloat16, greedy and seeded.
Every scenario's probe checks that its condition really happened; the last test shows that
without the flag the schedule does move the outputs (so these tests can fail)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tokenweir import LLM
from tokenweir.model import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
import invariance_scenarios as S  # noqa: E402
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.skipif(
    kernels.paged_attention_kernel() is None or kernels.packed_linear_kernel() is None,
    reason="batch-invariant mode needs the C++ CPU kernels")

PARAMS = {"greedy": S.GREEDY, "seeded": S.SEEDED}


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory) -> str:
    """The wide tiny model, run on ONE torch thread: on a busy 2-core machine OpenMP's
    spinning threads made these engines ~10x slower. Rows are never split across threads by
    the invariant kernels (tests/model/test_batch_invariant_ops.py runs them on every thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield S.make_model(str(tmp_path_factory.mktemp("tiny-llama-wide")))
    torch.set_num_threads(threads)


def _check_probe(name: str, probe: dict) -> None:
    """The scenario's condition happened (asserted before its outputs are compared)."""
    if name == "in_batch_of_64":
        assert probe["largest_step"] >= 32, probe
    elif name.startswith("chunked_"):
        chunk = int(name.split("_")[1])
        prefill = -(-S.PROMPT_LEN // chunk)
        assert probe["chunks"][:prefill - 1] == [chunk] * (prefill - 1), probe
        assert sum(probe["chunks"][:prefill]) == S.PROMPT_LEN, probe
    elif name == "behind_cached_prefix":
        assert probe["cached_tokens"] >= 192, probe
    elif name.startswith("preempted_"):
        assert probe["preempted"] > 0, probe
        if name.endswith("swap"):
            assert probe["swapped_blocks"] > 0, probe
    else:
        raise AssertionError(f"no probe for {name}")


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_schedule_gives_the_bits_of_alone(wide_path, dtype, sampling):
    params, cache = PARAMS[sampling], {}
    alone = S.alone(wide_path, dtype, True, params)
    assert alone.probe["chunks"][0] == S.PROMPT_LEN  # alone: one unchunked prefill
    for scenario in S.SCENARIOS:
        got = scenario(wide_path, dtype, True, params)
        _check_probe(scenario.__name__, got.probe)
        ref = S.reference_for(scenario, got, wide_path, dtype, True, params, cache)
        assert got.samples == ref.samples, (scenario.__name__, S._verdict(got, ref))
        if "prompt" not in got.probe:
            assert ref.samples == alone.samples


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sample_i_of_n8_is_alone_with_seed_plus_i(wide_path, dtype):
    together, lone = S.parallel_samples(wide_path, dtype, True)
    assert len(together.samples) == S.N_SAMPLES
    assert len({tuple(t) for t, _ in together.samples}) > 1, "the samples never diverged"
    assert together.samples == [o.samples[0] for o in lone]


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    """A tiny Qwen3 (q/k RMSNorm per head: the torch RMSNorm path, and no direct path)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    make_tiny_model("qwen3", path, seed=3)
    save_tiny_tokenizer(path, S.TEMPLATE)
    yield path
    torch.set_num_threads(threads)


# the scenarios whose rows meet other rows in a norm, a matmul or an attention call
PATH_SCENARIOS = (S.in_batch_of_64, S.chunked(16), S.behind_cached_prefix,
                  S.preempted("recompute"))


def _direct_stacks_seen(monkeypatch) -> list:
    """Every direct_stack answer of the engines built from now on (None: the module path)."""
    from tokenweir.model import llama
    seen, real = [], llama.direct_stack

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]
    monkeypatch.setattr(llama, "direct_stack", spy)
    return seen


def _every_scenario_gives_alone(path: str, dtype: str) -> None:
    cache: dict = {}
    alone = S.alone(path, dtype, True, S.GREEDY)
    for scenario in PATH_SCENARIOS:
        got = scenario(path, dtype, True, S.GREEDY)
        _check_probe(scenario.__name__, got.probe)
        ref = S.reference_for(scenario, got, path, dtype, True, S.GREEDY, cache)
        assert got.samples == ref.samples, (scenario.__name__, S._verdict(got, ref))
        if "prompt" not in got.probe:
            assert ref.samples == alone.samples


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_qk_norms_keep_every_schedule_the_bits_of_alone(qwen3_path, dtype, monkeypatch):
    seen = _direct_stacks_seen(monkeypatch)
    _every_scenario_gives_alone(qwen3_path, dtype)
    model = S._loaded(qwen3_path, dtype).model
    assert all(layer.self_attn.qk_norm for layer in model.model.layers)  # probe: q/k norms
    assert seen and not any(seen)  # probe: the module path (the direct one refuses q/k norms)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_direct_path_every_schedule_gives_the_bits_of_alone(wide_path, dtype,
                                                                          monkeypatch):
    """TOKENWEIR_DIRECT_FORWARD=0: the model's own modules run every step."""
    from tokenweir.model import direct
    monkeypatch.setattr(direct, "ENABLED", False)
    seen = _direct_stacks_seen(monkeypatch)
    _every_scenario_gives_alone(wide_path, dtype)
    assert seen and not any(seen)  # probe: no step took the direct path


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_every_schedule_gives_the_bits_of_alone(wide_path, dtype, monkeypatch):
    """For a session with a GPU: the opted-in Triton kernels (backends/triton_matmul.py, the
    triton attention backend's fixed tiles) under the engine. Never run yet."""
    monkeypatch.setenv("TOKENWEIR_BATCH_INVARIANT_CUDA", "1")
    monkeypatch.setitem(S.ROOMY, "device", "cuda")
    _every_scenario_gives_alone(wide_path, dtype)


def test_without_the_flag_the_schedule_moves_bfloat16_outputs(wide_path):
    """The probe that makes the tests above meaningful: in bfloat16, flag off, at least one
    schedule changes the target's tokens or logprobs. On the AVX2 machine measured, chunking
    and swap did (the attention's chunk-dependent paths), a batch of 64 and a cached prefix did
    not (README, batch-invariant mode); the scenarios are tried cheapest first."""
    cache, moved = {}, []
    for scenario in (S.chunked(16), S.preempted("swap"), S.behind_cached_prefix,
                     S.in_batch_of_64):
        got = scenario(wide_path, "bfloat16", False, S.GREEDY)
        ref = S.reference_for(scenario, got, wide_path, "bfloat16", False, S.GREEDY, cache)
        if got.samples != ref.samples:
            moved.append(scenario.__name__)
            break
    assert moved, "no schedule changed a bfloat16 output without --batch-invariant"


def test_the_flag_is_refused_where_it_cannot_hold(wide_path, monkeypatch):
    with pytest.raises(ValueError, match="batch_invariant: quantization"):
        LLM(wide_path, dtype="bfloat16", device="cpu", batch_invariant=True,
            quantization="int8")
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import check_batch_invariant
    on_cuda = EngineConfig.from_kwargs(model=wide_path, batch_invariant=True)
    monkeypatch.delenv("TOKENWEIR_BATCH_INVARIANT_CUDA", raising=False)
    with pytest.raises(ValueError, match="TOKENWEIR_BATCH_INVARIANT_CUDA=1"):
        check_batch_invariant(on_cuda, torch.device("cuda"))  # refused before any CUDA call
    check_batch_invariant(EngineConfig.from_kwargs(model=wide_path), torch.device("cuda"))
    if importlib.util.find_spec("triton") is not None:  # opted in: the triton backend runs it
        monkeypatch.setenv("TOKENWEIR_BATCH_INVARIANT_CUDA", "1")
        check_batch_invariant(on_cuda, torch.device("cuda"))
        monkeypatch.setenv("TOKENWEIR_ATTENTION_BACKEND", "reference")
        with pytest.raises(ValueError, match="needs the triton attention backend"):
            check_batch_invariant(on_cuda, torch.device("cuda"))
        monkeypatch.delenv("TOKENWEIR_BATCH_INVARIANT_CUDA")
    monkeypatch.setenv("TOKENWEIR_ATTENTION_BACKEND", "reference")
    with pytest.raises(ValueError, match="batch_invariant: it needs the cpu attention backend"):
        LLM(wide_path, dtype="float32", device="cpu", batch_invariant=True)


def test_the_benchmark_quick_mode_runs_both_dtypes_both_ways(wide_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import batch_invariance as bench
    results = bench.main(["--quick", "--model", wide_path, "--token-range", "3", "380",
                          "--max-prompt", "24", "--max-model-len", "512"])
    assert [r["dtype"] for r in results] == ["float32", "bfloat16"]
    for r in results:
        assert 0 <= r["same_tokens"] <= r["requests"] == 8
        for name in bench.MEASURES:
            assert r[name]["off"] > 0 and r[name]["on"] > 0
            assert len(r[name]["runs_off"]) == len(r[name]["runs_on"]) == 1
