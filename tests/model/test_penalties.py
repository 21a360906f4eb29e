"""Penalties and logit bias in the sampler (issue 15): parity with transformers' logits
processors on the same logits, presence/frequency against OpenAI's formula written out by
hand, and the batching contract (rows independent of each other, nothing done when no row
asks, inputs never modified)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from tokenweir.model.penalties import apply_penalties
from tokenweir.model.sampler import process_logits, sample
from tokenweir.request import SamplingParams

VOCAB = 300
EOS = frozenset({2})


def _history(rng: random.Random, prompt_len: int, num_out: int) -> list[int]:
    # Small id range so that tokens repeat (counts > 1) and some are seen in both parts.
    return [rng.randrange(0, 40) for _ in range(prompt_len + num_out)]


def _batch(seed: int, rows: int):
    rng = random.Random(seed)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    lens = [(rng.randint(1, 30), rng.randint(0, 20)) for _ in range(rows)]
    histories = [_history(rng, p, o) for p, o in lens]
    return logits, histories, [o for _, o in lens], rng


def _hf(logits_row: torch.Tensor, history: list[int], processors: list) -> torch.Tensor:
    return LogitsProcessorList(processors)(torch.tensor([history]), logits_row[None].clone())[0]


@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_matches_transformers(seed):
    logits, histories, num_out, rng = _batch(seed, 6)
    penalties = [rng.choice([0.5, 1.0, 1.3, 2.0, 7.5]) for _ in histories]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    got = apply_penalties(logits, params, histories, num_out)
    for i, r in enumerate(penalties):
        want = _hf(logits[i], histories[i], [RepetitionPenaltyLogitsProcessor(r)])
        assert torch.equal(got[i], want), f"row {i} (penalty {r})"
    changed = (got != logits).any(dim=-1).tolist()
    assert changed == [r != 1.0 for r in penalties]  # probe: the penalty really moved logits


@pytest.mark.parametrize("seed", range(3))
def test_logit_bias_matches_transformers_sequence_bias(seed):
    logits, histories, num_out, rng = _batch(seed, 5)
    biases = [{rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 6))}
              for _ in histories]
    params = [SamplingParams(logit_bias=b) for b in biases]
    got = apply_penalties(logits, params, histories, num_out)
    for i, bias in enumerate(biases):
        want = logits[i] if not bias else _hf(logits[i], histories[i], [
            SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])])
        assert torch.equal(got[i], want), f"row {i}"


def test_bias_repetition_and_min_tokens_together_match_transformers():
    """transformers' generate() order is bias, repetition, min-new-tokens; so is ours."""
    logits, histories, num_out, rng = _batch(7, 6)
    logits[:, 2] = 50.0  # EOS would win everywhere unless masked
    params = [SamplingParams(repetition_penalty=1.7, logit_bias={5: 3.0, 2: -1.0, 9: 40.0},
                             min_tokens=10, max_tokens=30) for _ in histories]
    got = process_logits(logits, params, num_out, EOS, histories)
    for i, hist in enumerate(histories):
        prompt_len = len(hist) - num_out[i]
        want = _hf(logits[i], hist, [
            SequenceBiasLogitsProcessor([[[5], 3.0], [[2], -1.0], [[9], 40.0]]),
            RepetitionPenaltyLogitsProcessor(1.7),
            MinNewTokensLengthLogitsProcessor(prompt_len, 10, 2)])
        assert torch.equal(got[i], want), f"row {i}"
    assert any(n < 10 for n in num_out) and any(n >= 10 for n in num_out)  # both branches


def _openai_reference(row: list[float], output: list[int], presence: float,
                      frequency: float) -> list[float]:
    """mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence (OpenAI's
    documented formula), over the tokens sampled so far."""
    out = list(row)
    for j in set(output):
        c = output.count(j)
        out[j] = row[j] - c * frequency - float(c > 0) * presence
    return out


@pytest.mark.parametrize("seed", range(3))
def test_presence_and_frequency_match_openai_formula(seed):
    logits, histories, num_out, rng = _batch(seed, 7)
    pairs = [(rng.uniform(-2, 2), rng.uniform(-2, 2)) for _ in histories]
    pairs[0] = (0.0, 0.0)
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in pairs]
    got = apply_penalties(logits, params, histories, num_out)
    for i, (p, f) in enumerate(pairs):
        output = histories[i][len(histories[i]) - num_out[i]:]
        want = torch.tensor(_openai_reference(logits[i].tolist(), output, p, f))
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)
    # Probe: a token seen only in the prompt is not touched by presence/frequency.
    i = next(i for i in range(len(histories)) if num_out[i] > 0 and pairs[i] != (0.0, 0.0))
    prompt_only = set(histories[i][:len(histories[i]) - num_out[i]]) - \
        set(histories[i][len(histories[i]) - num_out[i]:])
    assert prompt_only
    cols = sorted(prompt_only)
    assert torch.equal(got[i, cols], logits[i, cols])


def test_all_three_penalties_stack_in_vllm_order():
    logits, histories, num_out, _ = _batch(11, 3)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=1.5, logit_bias={3: 1.0})
    got = apply_penalties(logits, [params] * 3, histories, num_out)
    for i, hist in enumerate(histories):
        step = _hf(logits[i], hist, [SequenceBiasLogitsProcessor([[[3], 1.0]]),
                                     RepetitionPenaltyLogitsProcessor(1.5)])
        want = _openai_reference(step.tolist(), hist[len(hist) - num_out[i]:], 0.5, 0.25)
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=0, atol=1e-5)


def test_rows_are_independent_of_the_batch():
    logits, histories, num_out, rng = _batch(3, 8)
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.7)
              if i % 3 else SamplingParams() for i in range(8)]
    batched = apply_penalties(logits, params, histories, num_out)
    for i in range(8):
        alone = apply_penalties(logits[i:i + 1], params[i:i + 1], histories[i:i + 1],
                                num_out[i:i + 1])
        assert torch.equal(batched[i], alone[0])
        if not params[i].uses_penalties:
            assert torch.equal(batched[i], logits[i])


def test_nothing_is_done_when_no_row_asks():
    logits, _, num_out, _ = _batch(0, 4)
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(logit_bias={})] * 2
    assert apply_penalties(logits, params, None, num_out) is logits  # token ids not even read
    assert process_logits(logits, params, num_out, EOS, None) is logits


def test_inputs_are_not_modified():
    logits, histories, num_out, _ = _batch(1, 4)
    before, hist_before = logits.clone(), [list(h) for h in histories]
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0,
                             logit_bias={1: 5.0})] * 4
    out = apply_penalties(logits, params, histories, num_out)
    assert not torch.equal(out, logits)
    assert torch.equal(logits, before) and histories == hist_before


def test_penalties_need_token_ids():
    logits, _, num_out, _ = _batch(0, 2)
    with pytest.raises(ValueError, match="token ids"):
        apply_penalties(logits, [SamplingParams(presence_penalty=1.0)] * 2, None, num_out)


def test_greedy_sampling_sees_the_penalized_logits_and_logprobs_stay_raw():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 3.0
    logits[:, 7] = 2.5
    history = [[4, 4, 1], [4, 1], [1, 1]]  # one output token each
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=1),
              SamplingParams(temperature=0, logit_bias={4: -100.0}, logprobs=1),
              SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=1)]
    out = sample(logits, params, [1, 1, 1], EOS, 0, 0, token_ids=history)
    # row 0: 3/1.5 = 2 < 2.5; row 1: biased away; row 2: token 4 never sampled -> stays 4.
    assert out.token_ids == [7, 7, 4]
    raw_lp = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0].sampled_logprob == pytest.approx(raw_lp[7].item())
    assert out.logprobs[0].sampled_rank == 2


def test_seeded_random_rows_draw_from_the_penalized_distribution():
    logits = torch.zeros(1, 6)
    logits[0, 0] = 10.0
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={0: -100.0}) for s in range(50)]
    out = sample(logits.expand(50, 6).contiguous(), params, [0] * 50, EOS, 0, 0,
                 token_ids=[[1]] * 50)
    assert 0 not in out.token_ids and len(set(out.token_ids)) > 2


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    (dict(presence_penalty="1"), "presence_penalty must be a number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(logit_bias={5: 100.5}), "logit_bias value of token 5 must be in [-100, 100]"),
    (dict(logit_bias={"5": 1.0}), "logit_bias key must be an integer"),
    (dict(logit_bias={-1: 1.0}), "logit_bias key must be in"),
    (dict(logit_bias={True: 1.0}), "logit_bias key must be an integer"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias must be a dict"),
])
def test_sampling_params_refuse_bad_penalties(kwargs, fragment):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert fragment in str(exc.value)


def test_sampling_params_accept_the_bounds_and_check_the_vocabulary():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=0.01,
                       logit_bias={0: -100, 9: 100.0})
    assert p.uses_penalties
    p.check_vocab(10)
    with pytest.raises(ValueError, match="logit_bias key 9 is outside the vocabulary"):
        p.check_vocab(9)
    assert not SamplingParams(repetition_penalty=1, logit_bias={}).uses_penalties


def test_token_history_grows_and_arrays_give_the_same_result_as_lists():
    from tokenweir.model.penalties import TokenHistory
    logits, histories, num_out, _ = _batch(5, 4)
    grown = []
    for hist in histories:
        h = TokenHistory(hist[:1])
        for t in hist[1:]:  # far past the first capacity: the buffer is reallocated
            h.append(t)
        assert h.view().tolist() == hist
        grown.append(h.view())
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.2,
                             frequency_penalty=0.1)] * 4
    assert torch.equal(apply_penalties(logits, params, grown, num_out),
                       apply_penalties(logits, params, histories, num_out))


@pytest.mark.parametrize("r", [1e-300, 1e-40, 1e300])
def test_extreme_repetition_penalties_leave_a_row_the_sampler_can_draw_from(r):
    logits = torch.tensor([[3.0, -2.0, 0.0, 1.0, -float("inf")]])
    hist = [[0, 1, 2, 4]]
    x = apply_penalties(logits, [SamplingParams(repetition_penalty=r)], hist, [2])
    assert not torch.isnan(x).any() and not torch.isposinf(x).any()
    assert torch.isneginf(x[0, 4])  # a masked logit stays masked
    out = sample(logits, [SamplingParams(repetition_penalty=r, seed=1)], [2], EOS, 0, 0,
                 token_ids=hist)
    assert 0 <= out.token_ids[0] < 4


@pytest.mark.parametrize("seed", range(4))
def test_dense_pass_equals_the_sparse_pass_bit_for_bit(seed):
    """CUDA runs the dense pass (no host synchronisation: no unique, no repeat_interleave on
    the device), CPU the sparse one: on the same rows they give identical logits, extreme
    penalties, -inf logits, repeated tokens and rows without outputs included."""
    from tokenweir.model import penalties as P
    rng = random.Random(seed)
    vocab, rows = 97, 6
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 4
    x[0, 3] = float("-inf")
    params, seqs, outs = [], [], []
    for i in range(rows):
        params.append(SamplingParams(
            repetition_penalty=rng.choice([1.0, 1.3, 0.7, 1e-40]),
            frequency_penalty=rng.choice([0.0, 0.5, -1.2]),
            presence_penalty=rng.choice([0.0, 1.0, -0.4])))
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] + [3, 3]
        seqs.append(seq)
        outs.append(rng.randrange(0, len(seq) + 1) if i else 0)
    sparse, dense = x.clone(), x.clone()
    P._penalize_sparse(sparse, params, seqs, outs)
    P._penalize_dense(dense, params, seqs, outs)
    assert not torch.equal(sparse, x), "probe: the penalties changed something"
    assert torch.equal(dense, sparse)
