"""The engine's features ON CUDA, on tiny random-weight models (CUDA only: skipped, saying so,
where no GPU is visible): cramped == roomy with preemption probed (recompute and swap, the swap
pool pinned), prefix caching, parallel sampling's block copies, guided masks, and the slo
policy's mid-step cut. Each reuses the CPU test's workload and probes, on device="cuda"."""

from __future__ import annotations

import pytest

import test_llm_parallel_sampling as PS
import test_preemption_modes as PM
import test_slo_cut as SC
from tokenweir import LLM, SamplingParams
from tokenweir.core.outputs import SLO_MID_STEP
from tokenweir.request import GuidedDecodingParams

pytestmark = pytest.mark.cuda
CUDA = {"device": "cuda"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-cuda")
    PM.make_tiny_model("llama", str(path), seed=3)
    PM.save_tiny_tokenizer(str(path), PM.CHATML)
    return str(path)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [False, True], ids=["no_prefix", "prefix"])
def test_cuda_cramped_equals_roomy(tiny, mode, prefix):
    prompts, priority = PM._workload()
    common = {**PM.COMMON, **CUDA, "scheduling_policy": "priority"}
    roomy = LLM(tiny, **common, num_gpu_blocks_override=400, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids
                for o in roomy.generate(prompts, PM.PARAMS, priority=priority, use_tqdm=False)]
    assert PM._metric(roomy, "num_preemptions") == 0
    llm = LLM(tiny, **common, num_gpu_blocks_override=33, enable_prefix_caching=prefix,
              preemption_mode=mode)
    runner = llm.llm_engine.core.executor
    assert runner.kv_caches[0].is_cuda
    outs = llm.generate(prompts, PM.PARAMS, priority=priority, use_tqdm=False)
    assert PM._metric(llm, "num_preemptions") > 0, "the cramped pool never preempted"
    if mode == "swap":
        assert PM._metric(llm, "num_swapped_out") > 0 and PM._metric(llm, "num_swapped_in") > 0
        assert runner.host_caches[0].is_pinned() and runner.swapper.staged
    if prefix:
        assert PM._metric(llm, "prefix_cache_hits") > 0
        assert any(o.num_cached_tokens > 0 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cuda_parallel_sampling_block_copies(tiny, mode):
    common = {**PS.COMMON, **CUDA}
    roomy = LLM(tiny, **common, num_gpu_blocks_override=400, enable_prefix_caching=False)
    expected = PS._samples(roomy.generate(PS._prompts(5), PS.N4, use_tqdm=False))
    llm = LLM(tiny, **common, num_gpu_blocks_override=30, enable_prefix_caching=True,
              preemption_mode=mode)
    log = PS.StepLog(llm)
    outs = llm.generate(PS._prompts(5), PS.N4, use_tqdm=False)
    assert PS._metric(llm, "num_preemptions") > 0
    assert log.copies, "no sample ever copied a shared block"
    assert PS._samples(outs) == expected


def test_cuda_slo_mid_step_cut(tiny):
    common = {**SC.TINY, **CUDA}
    baseline = LLM(tiny, **common).generate(SC._prompts(), SC.PARAMS, use_tqdm=False)
    llm = LLM(tiny, **common)
    signal, reports = SC.LateSignal(num_layers=2, from_layer=1), []
    SC._cutting_runner(llm, signal, {1, 3, 4, 8}, reports)
    outs = llm.generate(SC._prompts(), SC.PARAMS, use_tqdm=False)
    stats = llm.llm_engine.scheduler.stats
    assert len(reports) >= 2 and stats.preemptions_by_cause[SLO_MID_STEP] == len(reports)
    assert all(r.layer_index == 1 for r in reports)  # probe: cut after layer 0 ran
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in baseline]


def test_cuda_guided_choice(tiny):
    llm = LLM(tiny, dtype="float32", device="cuda", max_model_len=256, block_size=8)
    choices = ["alpha", "beta", "gamma"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16,
                             guided_decoding=GuidedDecodingParams(choice=choices))
              for s in range(4)]
    before = llm.llm_engine.guided.num_masks
    outs = llm.generate(["pick one:"] * 4, params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    assert llm.llm_engine.guided.num_masks > before  # probe: the masks were applied
