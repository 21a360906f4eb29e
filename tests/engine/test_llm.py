"""End-to-end tests of the offline API on the real default model (float32, CPU)."""

from __future__ import annotations

import random

import pytest

from tokenweir import SamplingParams

# 16 tokens: decodes enough after the preemptions below that a block handed out while still
# published in the prefix cache (the eviction skipped in BlockPool.get_new_block[s]) changes
# the tokens under both policies; with 12, fcfs passed on it (24 were the base's)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompts(n: int, seed: int = 0, low: int = 20, high: int = 180) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(low, high))]}
            for _ in range(n)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _metric(llm, name: str):
    return next(m.value for m in llm.get_metrics() if m.name == "tokenweir:" + name)


def test_generate_text_and_fields(make_llm):
    llm = make_llm()
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert "Paris" in out.outputs[0].text
    assert out.finished and out.metrics.first_token_time >= out.metrics.arrival_time
    assert out.metrics.num_preemptions == 0


# Prompts of 20-100 tokens (those over 48 are chunked) in a pool of 10 blocks of 16 (9 usable;
# max_model_len 128 needs 8 and a null block): 2-4 preemptions a run, each policy, in ~130
# steps for the three engines. The pool of 17 blocks, prompts up to 180 tokens and 24 output
# tokens took ~180 steps for 3-4.
CRAMPED = dict(max_num_batched_tokens=64, long_prefill_token_threshold=48, max_model_len=128)
CRAMPED_PROMPTS = dict(n=6, seed=1, high=100)


@pytest.fixture(scope="module")
def roomy_tokens(make_llm):
    """The reference both cramped runs compare with: the same prompts in a roomy pool (fcfs;
    greedy float32 tokens do not depend on the schedule: tests/engine/test_batch_invariance.py).
    One run for both policies."""
    roomy = make_llm(num_gpu_blocks_override=200, scheduling_policy="fcfs", **CRAMPED)
    expected = roomy.generate(_prompts(**CRAMPED_PROMPTS), GREEDY, use_tqdm=False)
    assert _metric(roomy, "num_preemptions") == 0
    return _tokens(expected)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_cramped_pool_gives_identical_tokens(make_llm, roomy_tokens, policy):
    """Memory pressure costs time, never correctness."""
    prompts = _prompts(**CRAMPED_PROMPTS)
    priority = [i % 3 for i in range(len(prompts))] if policy == "priority" else None
    cramped = make_llm(num_gpu_blocks_override=10, scheduler_reserve_full_isl=False,
                       scheduling_policy=policy, **CRAMPED)
    got = cramped.generate(prompts, GREEDY, priority=priority, use_tqdm=False)
    assert _metric(cramped, "num_preemptions") > 0, "the cramped pool never preempted"
    assert _metric(cramped, "num_chunked_prefills") > 0, "no prompt was chunked"
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert _tokens(got) == roomy_tokens


def test_chunked_and_unchunked_prefill_agree(make_llm):
    """Prompts of 40-120 tokens in chunks of at most 24 (not a multiple of the 16-token block:
    chunks end inside blocks), beside decodes, against each prompt prefilled whole."""
    prompts = _prompts(4, seed=2, low=40, high=120)
    chunked = make_llm(max_num_batched_tokens=24, max_model_len=512)
    whole = make_llm(max_num_batched_tokens=512, enable_chunked_prefill=False, max_model_len=512)
    a = chunked.generate(prompts, GREEDY, use_tqdm=False)
    b = whole.generate(prompts, GREEDY, use_tqdm=False)
    assert _metric(chunked, "num_chunked_prefills") > 0
    assert _metric(whole, "num_chunked_prefills") == 0
    assert _tokens(a) == _tokens(b)


def test_seeded_sampling_independent_of_batch(make_llm):
    """A seeded request samples the same tokens alone and in a crowd (which outlives it and
    holds the same prompt under another seed: that one differs)."""
    llm = make_llm()
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    crowd = llm.generate(["Hello", "Once upon a time", "The weather today", "Once upon a time"],
                         [SamplingParams(temperature=1.0, max_tokens=10), params,
                          SamplingParams(temperature=0.7, seed=9, max_tokens=5),
                          SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=8,
                                         ignore_eos=True)],
                         use_tqdm=False)
    assert alone.outputs[0].token_ids == crowd[1].outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 8
    assert crowd[3].outputs[0].token_ids != alone.outputs[0].token_ids


def test_stop_rules(make_llm):
    llm = make_llm()
    tok = llm.get_tokenizer()
    prompt = "Count: one, two, three,"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)[0].outputs[0]
    assert len(base.text) > 4 and len(base.token_ids) == 6
    stop_str = base.text[2:5]
    stop_token = base.token_ids[3]
    stopped, by_token = llm.generate(  # one batch: greedy tokens do not depend on it
        [prompt, prompt], [SamplingParams(temperature=0, max_tokens=12, stop=[stop_str]),
                           SamplingParams(temperature=0, max_tokens=12,
                                          stop_token_ids=[stop_token])], use_tqdm=False)
    stopped = stopped.outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_str
    assert stopped.text == base.text[:base.text.index(stop_str)]
    assert by_token.outputs[0].token_ids == base.token_ids[:base.token_ids.index(stop_token) + 1]
    assert by_token.outputs[0].stop_reason == stop_token
    # a question the model answers in a few tokens and an end-of-sequence ("2 + 2 = 4": 8)
    question = [{"role": "user", "content": "What is 2+2? Answer with the number only."}]
    chat = llm.chat(question, SamplingParams(temperature=0, max_tokens=200),
                    use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in tok.eos_token_ids
    at_least = len(chat.token_ids) + 5
    forced = llm.chat(question, SamplingParams(temperature=0, max_tokens=at_least,
                                               min_tokens=at_least),
                      use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) == at_least
    # The sampler's min_tokens mask, not only the stop rule: below min_tokens no EOS is even
    # sampled (vLLM's contract). Without the mask the greedy EOS at the chat's length would be
    # sampled and, the stop rule holding it off, kept in the output.
    assert not tok.eos_token_ids & set(forced.token_ids), forced.token_ids


def test_logprobs(make_llm):
    llm = make_llm()
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry[token_id].rank == 1  # greedy picks the top token
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": [5] * 3000}, SamplingParams(), "3000"),
    ("", SamplingParams(), "empty"),
    ("hi", dict(max_tokens=0), "max_tokens"),
    ("hi", dict(temperature=-1), "temperature"),
    ("hi", dict(top_p=0), "top_p"),
    ("hi", dict(top_p=1.5), "top_p"),
])
def test_bad_input_clear_error_and_engine_survives(make_llm, prompt, params, message):
    llm = make_llm()
    with pytest.raises(ValueError, match=message):
        if isinstance(params, dict):
            params = SamplingParams(**params)
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    scheduler = llm.llm_engine.scheduler
    assert not scheduler.has_unfinished_requests(), "a rejected batch left requests behind"
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_prompt_too_long_names_both_numbers(make_llm):
    llm = make_llm(max_model_len=512)
    with pytest.raises(ValueError, match=r"600.*512"):
        llm.generate({"prompt_token_ids": [7] * 600}, use_tqdm=False)


def test_pool_too_small_is_refused(make_llm):
    with pytest.raises(ValueError, match="too small"):
        make_llm(num_gpu_blocks_override=10, max_model_len=2048)


def test_unknown_model_path():
    from tokenweir import LLM
    with pytest.raises((FileNotFoundError, ValueError), match="no/such/model"):
        LLM(model="/no/such/model")


def test_metrics_move(make_llm):
    llm = make_llm()
    before = {m.name: m for m in llm.get_metrics()}
    llm.generate(["a", "b c"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    after = {m.name: m for m in llm.get_metrics()}
    assert after["tokenweir:generation_tokens"].value - \
        before["tokenweir:generation_tokens"].value == 10
    assert after["tokenweir:prompt_tokens"].value > before["tokenweir:prompt_tokens"].value
    assert after["tokenweir:num_requests_running"].value == 0
    assert after["tokenweir:kv_cache_usage_perc"].value == 0
    assert after["tokenweir:iteration_tokens_total"].count > 0
