"""Validate at the edge, once (issue 14, #5 and #6): every bad value the offline API is given
is a ValueError (TypeError for an argument of the wrong type) naming the field, raised before
the engine sees it; the engine is left clean. And a small pool starts up."""

from __future__ import annotations

import math

import pytest
import torch

from tokenweir import LLM, SamplingParams
from tokenweir.core.sched.policy import PreemptionCosts

OK = SamplingParams(temperature=0, max_tokens=3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=0), "top_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=10**400), "top_k"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[None]), r"stop\[0\]"),
    (dict(stop=["ok", ""]), r"stop\[1\]"),
    (dict(stop=7), "stop"),
    (dict(stop_token_ids=["a"], min_tokens=2), r"stop_token_ids\[0\]"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids\[0\]"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=1.5), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(n=0), "n"), (dict(n=2, best_of=1), "best_of"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_sampling_params_are_normalised():
    p = SamplingParams(top_k=-1, stop="x", stop_token_ids=(3, 4), temperature=1, seed=2**64 - 1)
    assert (p.top_k, p.stop, p.stop_token_ids) == (0, ["x"], [3, 4])
    with pytest.raises(ValueError) as exc:
        SamplingParams(top_k=10**400)
    assert len(str(exc.value)) < 120, "the message echoes a 401-digit number"


def test_mutated_params_are_checked_again_when_the_request_is_made(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=3)
    params.top_k = "x"
    with pytest.raises(ValueError, match=r"sampling_params\[0\]: top_k"):
        llm.generate("hi", params, use_tqdm=False)


@pytest.mark.parametrize("call, error, message", [
    (lambda llm: llm.generate(None), TypeError, "prompts"),
    (lambda llm: llm.generate(123), TypeError, "prompts"),
    (lambda llm: llm.generate(["ok", 5]), TypeError, r"prompts\[1\]"),
    (lambda llm: llm.generate("hi", sampling_params="x"), TypeError, "sampling_params"),
    (lambda llm: llm.generate(["a", "b"], [OK, {"temperature": 0}]), TypeError,
     r"sampling_params\[1\]"),
    (lambda llm: llm.generate(["a", "b"], [OK]), ValueError, "1 sampling params for 2"),
    (lambda llm: llm.generate(["a"], OK, priority=["high"]), TypeError, r"priority\[0\]"),
    (lambda llm: llm.generate(["ok", ["x", 1]]), ValueError, r"prompts\[1\]"),
    (lambda llm: llm.generate([{"prompt_token_ids": [1.5, 2]}]), ValueError,
     r"prompts\[0\].*prompt_token_ids"),
    (lambda llm: llm.generate([{"text": "hi"}]), ValueError, r"prompts\[0\].*'prompt'"),
    (lambda llm: llm.generate("hi", SamplingParams(stop_token_ids=[10**6])), ValueError,
     r"sampling_params\[0\]: stop_token_ids\[0\] = 1000000 is outside the vocabulary"),
    (lambda llm: llm.chat(None), TypeError, "messages"),
    (lambda llm: llm.chat([{"role": "user"}]), TypeError, "'content'"),
    (lambda llm: llm.chat([[{"role": "user", "content": "hi"}], "oops"]), TypeError,
     r"messages\[1\]"),
])
def test_bad_arguments_name_the_argument_and_leave_the_engine_clean(make_llm, call, error,
                                                                    message):
    llm = make_llm()
    with pytest.raises(error, match=message):
        call(llm)
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.outputs.states
    out = llm.generate(["The capital of France is"], OK, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, field", [
    (dict(kv_cache_space=float("nan")), "kv_cache_space"),
    (dict(swap_space=float("nan")), "swap_space"),
    (dict(swap_space=float("inf")), "swap_space"),
    (dict(block_size=8.0), "block_size"),
    (dict(max_model_len="long"), "max_model_len"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
    (dict(watermark=float("nan")), "watermark"),
    (dict(device="tpu"), "device"),
])
def test_bad_engine_arguments_name_the_field(kwargs, field):
    """Refused before any model is loaded (the model path does not even exist)."""
    with pytest.raises(ValueError, match=field):
        LLM("/no/such/model", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available"):
        LLM("/no/such/model", device="cuda")


@pytest.mark.parametrize("kwargs", [dict(preemption_mode="auto", swap_space=0.05),
                                    dict(preemption_policy="cost")])
def test_small_pool_starts_and_measures_costs(make_llm, kwargs):
    """Issue 14, #6: the start-up probe assumed a pool of 256 tokens' worth of blocks. This
    pool holds 88 (11 usable blocks of 8; the probe prefills what they hold, twice: 216 tokens
    a prefill in the pool of 28 blocks this test used before, for the same check)."""
    small = dict(num_gpu_blocks_override=12, block_size=8, max_model_len=64)
    llm = make_llm(**small, **kwargs)
    costs = llm.llm_engine.scheduler.costs
    assert costs != PreemptionCosts(), "the preemption costs were never measured"
    assert costs.prefill_seconds_per_token > 0 and math.isfinite(costs.swap_seconds_per_block)
    prompts = ["The capital of France is", "One, two, three,"]
    roomy = make_llm(max_model_len=64)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    expected = roomy.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_swap_space_too_small_names_swap_space(make_llm):
    with pytest.raises(ValueError, match=r"swap_space=0.001 GiB holds \d+ host KV block") as exc:
        make_llm(preemption_mode="swap", swap_space=0.001, max_model_len=176, block_size=8,
                 num_gpu_blocks_override=64)
    assert "null block" not in str(exc.value)
