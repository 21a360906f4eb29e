"""Parallel sampling (n, best_of) through the real runner on a tiny random-weight Llama: real
KV tensors, real copy-on-write and swap copies. Memory pressure costs time, never tokens; the
prompt is prefilled once; sample i of a seeded request is the lone request seeded seed + i."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

from tokenweir import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
COMMON = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8,
              max_num_batched_tokens=48, long_prefill_token_threshold=32,
              scheduler_reserve_full_isl=False, swap_space=0.002)
N4 = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-parallel")
    make_tiny_model("llama", str(path), seed=3)
    save_tiny_tokenizer(str(path), TEMPLATE)
    return str(path)


class StepLog:
    """Wraps the engine's executor: what every SchedulerOutput asked for."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.core
        self.execute, core.executor.execute = core.executor.execute, self._execute
        self.scheduled_tokens = 0
        self.copies: list[tuple[int, int]] = []

    def _execute(self, out):
        self.scheduled_tokens += out.total_num_scheduled_tokens
        self.copies += out.blocks_to_copy
        return self.execute(out)


def _prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randint(9, 60))]}
            for _ in range(count)]


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "tokenweir:" + name)


def _samples(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def roomy(tiny_llama) -> list[list[list[int]]]:
    llm = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=400, enable_prefix_caching=False)
    outs = llm.generate(_prompts(5), N4, use_tqdm=False)
    assert _metric(llm, "num_preemptions") == 0
    return _samples(outs)


@pytest.mark.parametrize("mode, prefix", list(itertools.product(["recompute", "swap"],
                                                                 [False, True])))
def test_cramped_equals_roomy_for_n4(tiny_llama, roomy, mode, prefix):
    llm = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=30, enable_prefix_caching=prefix,
              preemption_mode=mode)
    log = StepLog(llm)
    outs = llm.generate(_prompts(5), N4, use_tqdm=False)
    assert _metric(llm, "num_preemptions") > 0, "the cramped pool never preempted"
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    if mode == "swap":
        assert _metric(llm, "num_swapped_out") > 0
    assert log.copies, "no sample ever copied a shared block"
    assert _samples(outs) == roomy
    assert all([c.index for c in o.outputs] == [0, 1, 2, 3] for o in outs)
    assert len({tuple(t) for t in roomy[0]}) == 4, "the samples should differ"
    assert _metric(llm, "kv_cache_usage_perc") == 0


def test_prompt_is_prefilled_once_and_samples_share_its_blocks(tiny_llama):
    prompt = _prompts(1, seed=5)[0]
    num_prompt = len(prompt["prompt_token_ids"])
    together = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=400,
                   enable_prefix_caching=False)
    log = StepLog(together)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    [out] = together.generate([prompt], params, use_tqdm=False)
    # the prompt once, its last token again for 3 samples, then 9 decodes per sample
    assert log.scheduled_tokens == num_prompt + 3 + 4 * 9
    assert len(log.copies) == 3  # every holder of the shared block but one copies it
    apart = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=400, enable_prefix_caching=False)
    apart_log = StepLog(apart)
    alone = [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=10, ignore_eos=True)
             for i in range(4)]
    outs = apart.generate([prompt] * 4, alone, use_tqdm=False)
    assert apart_log.scheduled_tokens == 4 * num_prompt + 4 * 9  # probe: 4 prefills
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]


def test_sample_i_is_the_lone_request_seeded_seed_plus_i(tiny_llama):
    llm = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=400)
    prompt = _prompts(1, seed=7)
    [group] = llm.generate(prompt, N4, use_tqdm=False)
    for i, completion in enumerate(group.outputs):
        alone = SamplingParams(temperature=1.0, top_p=0.95, seed=N4.seed + i, max_tokens=20,
                               ignore_eos=True)
        [out] = llm.generate(prompt, alone, use_tqdm=False)
        assert out.outputs[0].token_ids == completion.token_ids


def test_best_of_keeps_the_n_best_by_cumulative_logprob(tiny_llama):
    llm = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=400)
    prompt = _prompts(1, seed=9)
    every = SamplingParams(n=5, temperature=1.0, seed=21, max_tokens=12, logprobs=0,
                           ignore_eos=True)
    [all5] = llm.generate(prompt, every, use_tqdm=False)
    ranked = sorted(all5.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    best = SamplingParams(n=2, best_of=5, temperature=1.0, seed=21, max_tokens=12,
                          ignore_eos=True)
    [out] = llm.generate(prompt, best, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert all(c.logprobs is None for c in out.outputs)  # only ranked with, not asked for


def test_group_streams_deltas_and_aborts_as_one(tiny_llama):
    llm = LLM(tiny_llama, **COMMON, num_gpu_blocks_override=400)
    engine = llm.llm_engine
    request, text = engine.make_request(_prompts(1)[0], N4, request_id="g")
    engine.add_request(request, text)
    seen: dict[int, list[int]] = {i: [] for i in range(4)}
    for _ in range(6):
        for out in engine.step(delta=True):
            assert out.request_id == "g" and not out.finished
            for c in out.outputs:
                seen[c.index] += c.token_ids
    assert all(seen.values()), "every sample streamed tokens"
    [final] = engine.abort_requests(["g"], delta=True)
    assert final.finished and sorted(c.index for c in final.outputs) == [0, 1, 2, 3]
    assert {c.finish_reason for c in final.outputs} == {"abort"}
    assert not engine.outputs.states, "the aborted group's output state is forgotten"
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.usage() == 0
    assert [len(v) for v in seen.values()] == [len(s.output_token_ids)
                                               for s in request.group.samples]
