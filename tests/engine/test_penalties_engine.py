"""Penalties and logit bias through the whole engine (issue 15) on a tiny random-weight Llama:
greedy outputs equal transformers' generate() with the same processors (and a hand-written
OpenAI presence/frequency loop), survive preemption by recompute, and leave the requests
beside them untouched."""

from __future__ import annotations

import random

import pytest
import torch

from tokenweir import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8,
              num_gpu_blocks_override=80, max_num_batched_tokens=64)
EOS = 2
MAX_NEW = 14


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 360) for _ in range(rng.randint(6, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def llm(tiny_llama_path) -> LLM:
    return LLM(tiny_llama_path, **ENGINE)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def _hf_generate(hf, prompt: list[int], eos, **kwargs) -> list[int]:
    hf.generation_config.eos_token_id = eos
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                      dtype=torch.long), do_sample=False, max_new_tokens=MAX_NEW, **kwargs)
    return out[0, len(prompt):].tolist()


def test_repetition_and_bias_match_transformers_generate(llm, hf):
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                            repetition_penalty=1.8, logit_bias={17: 2.5, 40: -3.0})
    got = _tokens(llm, prompts, params)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _hf_generate(hf, prompt, None, repetition_penalty=1.8,
                                      sequence_bias=[[[17], 2.5], [[40], -3.0]])
    plain = _tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                  ignore_eos=True))
    assert plain != got  # probe: the penalty changed what greedy decoding picks


def test_min_tokens_holds_a_biased_eos_back_exactly_as_transformers(llm, hf):
    prompts = _prompts(seed=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=5,
                            repetition_penalty=1.3, logit_bias={EOS: 60.0})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        # Probe that both really acted: EOS is held back for 5 tokens, then wins at once.
        assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) == 6
        assert out.outputs[0].token_ids[-1] == EOS and EOS not in out.outputs[0].token_ids[:-1]
        assert list(out.outputs[0].token_ids) == _hf_generate(
            hf, prompt, EOS, repetition_penalty=1.3, sequence_bias=[[[EOS], 60.0]],
            min_new_tokens=5)


@torch.inference_mode()
def _openai_greedy(hf, prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's formula applied by hand to transformers' logits."""
    ids = list(prompt)
    for _ in range(MAX_NEW):
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        output = ids[len(prompt):]
        for j in set(output):
            logits[j] -= output.count(j) * frequency + presence
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_presence_and_frequency_match_a_hand_written_greedy_loop(llm, hf):
    prompts = _prompts(seed=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                            presence_penalty=0.6, frequency_penalty=0.9)
    got = _tokens(llm, prompts, params)
    assert got == [_openai_greedy(hf, p, 0.6, 0.9) for p in prompts]
    plain = [_openai_greedy(hf, p, 0.0, 0.0) for p in prompts]
    assert plain != got  # probe: the penalties changed the output
    assert any(len(set(t)) < len(t) for t in plain)  # greedy alone repeats tokens here


def test_penalized_requests_leave_their_neighbours_alone(llm):
    prompts = _prompts(6, seed=3)
    plain = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_NEW, ignore_eos=True)
    penal = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                           repetition_penalty=1.5, presence_penalty=1.0, logit_bias={9: 5.0})
    alone = _tokens(llm, prompts, [plain, seeded] * 3)
    mixed = _tokens(llm, prompts, [plain, seeded, penal, penal, plain, penal])
    for i in (0, 1, 4):
        assert mixed[i] == alone[i]
    assert mixed[2] != alone[2] and mixed[5] != alone[5]


def test_penalties_survive_preemption_by_recompute(tiny_llama_path):
    prompts = _prompts(8, seed=4)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=24,
                             ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.5,
                             presence_penalty=0.3, logit_bias={i + 20: 3.0})
              for i in range(len(prompts))]
    common = dict(ENGINE, max_num_batched_tokens=48, max_model_len=64)
    roomy = LLM(tiny_llama_path, **{**common, "num_gpu_blocks_override": 200})
    cramped = LLM(tiny_llama_path, **{**common, "num_gpu_blocks_override": 14},
                  preemption_mode="recompute")
    want, got = _tokens(roomy, prompts, params), _tokens(cramped, prompts, params)
    preemptions = next(m.value for m in cramped.get_metrics()
                       if m.name == "tokenweir:num_preemptions")
    assert preemptions > 0, "the cramped pool never preempted"
    assert got == want


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias key 384 is outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(logit_bias={384: 1.0}),
                     use_tqdm=False)
