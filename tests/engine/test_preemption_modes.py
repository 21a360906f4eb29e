"""Preemption modes x victim policies x prefix caching on a tiny random-weight Llama, through
the real runner (real KV tensors, real swap copies): memory pressure costs time, never tokens."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

from tokenweir import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
COMMON = dict(dtype="float32", device="cpu", max_model_len=256, block_size=8,
              max_num_batched_tokens=48, long_prefill_token_threshold=32,
              scheduler_reserve_full_isl=False, swap_space=0.002)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", str(path), seed=3)
    save_tiny_tokenizer(str(path), CHATML)
    return str(path)


def _workload(n: int = 10, seed: int = 0) -> tuple[list[dict], list[int]]:
    """Two shared-prefix groups (40 and 56 tokens) with varied suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 380) for _ in range(k)] for k in (40, 56)]
    prompts = [{"prompt_token_ids": prefixes[i % 2] + [rng.randrange(3, 380)
                                                       for _ in range(rng.randint(5, 40))]}
               for i in range(n)]
    return prompts, [i % 3 for i in range(n)]


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "tokenweir:" + name)


@pytest.fixture(scope="module")
def roomy_tokens(tiny_llama) -> list[list[int]]:
    prompts, priority = _workload()
    llm = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=400, enable_prefix_caching=False,
              scheduling_policy="priority")
    outs = llm.generate(prompts, PARAMS, priority=priority, use_tqdm=False)
    assert _metric(llm, "num_preemptions") == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode, victims, prefix", list(itertools.product(
    ["recompute", "swap", "auto"], ["fcfs", "priority", "cost"], [False, True])))
def test_cramped_equals_roomy(tiny_llama, roomy_tokens, mode, victims, prefix):
    prompts, priority = _workload()
    llm = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=33, enable_prefix_caching=prefix,
              scheduling_policy="priority", preemption_mode=mode, preemption_policy=victims)
    outs = llm.generate(prompts, PARAMS, priority=priority, use_tqdm=False)
    assert _metric(llm, "num_preemptions") > 0, "the cramped pool never preempted"
    if mode == "swap":
        assert _metric(llm, "num_swapped_out") > 0 and _metric(llm, "num_swapped_in") > 0
    if prefix:
        assert _metric(llm, "prefix_cache_hits") > 0, "shared prefixes never hit the cache"
        assert any(o.num_cached_tokens > 0 for o in outs)
    else:
        assert _metric(llm, "prefix_cache_hits") == 0
    assert [o.outputs[0].token_ids for o in outs] == roomy_tokens
    assert _metric(llm, "kv_cache_usage_perc") == 0


def test_swap_space_beyond_host_memory_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="swap_space"):
        LLM(tiny_llama, **{**COMMON, "swap_space": 10_000}, preemption_mode="swap")


@pytest.mark.parametrize("bad", [dict(swap_space=-1), dict(kv_cache_space=-2),
                                 dict(max_num_batched_tokens=-5), dict(preemption_mode="drop"),
                                 dict(preemption_policy="random"), dict(max_preemptions=0)])
def test_bad_configuration_is_refused(tiny_llama, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LLM(tiny_llama, **{**COMMON, **bad})
