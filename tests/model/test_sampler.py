"""The batched sampler (tokenweir.model.sampler) on random logits: no model needed."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokenweir.core.outputs import TokenLogprobs
from tokenweir.model.sampler import SamplerOutput, sample
from tokenweir.request import SamplingParams

NEG_INF = float("-inf")
EOS = 2


def run(logits, params, nout=None, eos=frozenset({EOS}), default_seed=0, step_id=0):
    if not isinstance(params, list):
        params = [params] * logits.shape[0]
    if nout is None:
        nout = [0] * logits.shape[0]
    out = sample(logits, params, nout, eos, default_seed, step_id)
    assert isinstance(out, SamplerOutput)
    assert len(out.token_ids) == len(out.logprobs) == logits.shape[0]
    return out


def tokens(logits, params, **kw):
    return run(logits, params, **kw).token_ids


def seeded_draws(row: torch.Tensor, n: int, **param_kw) -> list[int]:
    """n draws from one logits row: n rows of it in one batch, one seed each."""
    logits = row[None, :].repeat(n, 1)
    return tokens(logits, [SamplingParams(seed=s, **param_kw) for s in range(n)])


# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def chi_square(draws: list[int], probs: dict[int, float]) -> tuple[float, int]:
    """Statistic and degrees of freedom of draws against `probs` (tokens outside it: a bin of
    their own, which must stay empty)."""
    n = len(draws)
    assert all(t in probs for t in draws), sorted(set(draws) - set(probs))
    stat = sum((draws.count(t) - n * p) ** 2 / (n * p) for t, p in probs.items())
    return stat, len(probs) - 1


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 1000, generator=g)
    logits[3, [700, 40, 900]] = 50.0  # a three-way tie: the lowest id wins
    out = tokens(logits, SamplingParams(temperature=0.0))
    assert out == logits.argmax(dim=-1).tolist()
    assert out[3] == 40


def test_tiny_temperature_is_greedy():
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(2))
    assert tokens(logits, SamplingParams(temperature=1e-7, seed=1)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0, 50.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(64)]
    assert tokens(logits, params) == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token():
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=20.0, top_p=1e-6, seed=i) for i in range(64)]
    assert tokens(logits, params) == logits.argmax(-1).tolist()
    # Without top_p the same rows at that temperature are nowhere near greedy.
    flat = [SamplingParams(temperature=20.0, seed=i) for i in range(64)]
    assert sum(a == b for a, b in zip(tokens(logits, flat), logits.argmax(-1).tolist())) < 10


# ----------------------------------------------------------------------------- filters

PROBS4 = torch.tensor([0.1, 0.4, 0.2, 0.3])  # token 1 > 3 > 2 > 0


def test_top_k_keeps_exactly_the_k_largest():
    row = torch.log(PROBS4)
    draws = seeded_draws(row, 2000, top_k=2)
    stat, dof = chi_square(draws, {1: 4 / 7, 3: 3 / 7})
    assert stat < CHI2_999[dof]


@pytest.mark.parametrize("top_p,kept", [(0.35, {1}), (0.65, {1, 3}), (0.75, {1, 3, 2}),
                                        (0.85, {1, 3, 2}), (0.95, {1, 3, 2, 0})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    row = torch.log(PROBS4)
    draws = seeded_draws(row, 2000, top_p=top_p)
    mass = sum(PROBS4[t].item() for t in kept)
    stat, dof = chi_square(draws, {t: PROBS4[t].item() / mass for t in kept}) if len(kept) > 1 \
        else (0.0, 0)
    assert set(draws) == kept
    if dof:
        assert stat < CHI2_999[dof]


@pytest.mark.parametrize("min_p,kept", [(0.2, {0, 1, 2, 3}), (0.3, {1, 2, 3}),
                                        (0.6, {1, 3}), (0.9, {1})])
def test_min_p_drops_tokens_below_min_p_times_the_top(min_p, kept):
    row = torch.log(PROBS4)
    assert set(seeded_draws(row, 1500, min_p=min_p)) == kept


def test_filters_compose_in_order_top_k_then_top_p_then_min_p():
    # probs .4 .3 .2 .1 on tokens 1 3 2 0; top_k=3 renormalises to .444 .333 .222;
    # top_p=0.7 over those keeps {1, 3} (0.444 < 0.7 <= 0.777); top_p on the raw row would too,
    # so also check a case where the order matters: top_k=2 -> .571 .429, top_p=0.55 keeps {1}.
    row = torch.log(PROBS4)
    assert set(seeded_draws(row, 1000, top_k=3, top_p=0.7)) == {1, 3}
    assert set(seeded_draws(row, 1000, top_k=2, top_p=0.55)) == {1}
    assert set(seeded_draws(row, 1000, top_p=0.55)) == {1, 3}
    # min_p relative to the top token: 0.45 * 0.4 = 0.18 drops token 0 ...
    assert set(seeded_draws(row, 1000, top_k=4, min_p=0.45)) == {1, 3, 2}
    # ... and stacks with top_k and top_p.
    assert set(seeded_draws(row, 1000, top_k=2, min_p=0.45)) == {1, 3}
    assert set(seeded_draws(row, 1000, top_p=0.95, min_p=0.6)) == {1, 3}


def test_top_p_stops_at_the_token_that_reaches_p_exactly():
    row = torch.tensor([0.0, -math.log(2), -math.log(4), -math.log(8), -math.log(16)])
    if (row - row[0]).exp().tolist() != [1.0, 0.5, 0.25, 0.125, 0.0625]:
        pytest.skip("exp is not exact here")
    # Weights 1, .5, .25, .125, .0625 (total 1.9375), running sums 1, 1.5, 1.75, ...: pick
    # top_p so that top_p * total lands exactly on a running sum; that token is the last kept.
    total = 1.9375
    assert set(seeded_draws(row, 500, top_p=1.0 / total)) == {0}
    assert set(seeded_draws(row, 500, top_p=1.5 / total)) == {0, 1}
    assert set(seeded_draws(row, 500, top_p=1.5 / total + 1e-6)) == {0, 1, 2}


def test_top_p_on_a_flat_row_reaches_past_the_candidate_list():
    """1024 candidates are tried first; a flat row needs far more, so it must not be cut."""
    vocab = 8192
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(15)) * 0.1
    p = SamplingParams(top_p=0.9)
    kept = reference_kept(row, p)
    assert len(kept) > 6000
    draws = seeded_draws(row, 600, top_p=0.9)
    assert set(draws) <= kept
    rank = {t: r for r, t in enumerate(row.argsort(descending=True).tolist())}
    assert sum(rank[t] >= 1024 for t in draws) > 400


def test_small_temperature_still_samples():
    row = torch.tensor([1.0, 0.99, -5.0])
    assert set(seeded_draws(row, 400, temperature=0.05)) == {0, 1}


def test_ties_at_the_top_k_border_are_all_kept():
    row = torch.tensor([0.0, 3.0, 1.0, 1.0, 1.0, -2.0])
    assert set(seeded_draws(row, 1000, top_k=2)) == {1, 2, 3, 4}


def reference_kept(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The kept set computed the slow, obvious way in float64."""
    x = (row.double() / p.temperature).tolist()
    order = sorted(range(len(x)), key=lambda t: -x[t])
    vals = [x[t] for t in order]
    keep = len(vals)
    if p.top_k > 0:
        kth = vals[min(p.top_k, len(vals)) - 1]
        keep = sum(v >= kth for v in vals)
    if p.top_p < 1:
        w = [math.exp(v - vals[0]) for v in vals[:keep]]
        total, cum = sum(w), 0.0
        for i, wi in enumerate(w):
            cum += wi
            if cum >= p.top_p * total:
                keep = sum(v >= vals[i] for v in vals[:keep])
                break
    kept = order[:keep]
    if p.min_p > 0:
        kept = [t for t in kept if x[t] >= vals[0] + math.log(p.min_p)]
    return set(kept)


def test_random_rows_stay_inside_the_reference_kept_set():
    """Mixed batch, both candidate paths (top-k candidates and the full-sort fallback): every
    draw lies in the kept set computed independently, and likely tokens all show up."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    vocab, rows, positions = 5000, 32, 24
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]),
                             top_k=rng.choice([0, 0, 3, 10, 600]),
                             top_p=rng.choice([1.0, 0.3, 0.8, 0.97]),
                             min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
                             seed=i) for i in range(rows)]
    kept = [reference_kept(logits[i], p) for i, p in enumerate(params)]
    out = tokens(logits.repeat(positions, 1), params * positions,
                 nout=[pos for pos in range(positions) for _ in range(rows)])
    seen: list[set[int]] = [set() for _ in range(rows)]
    for k, t in enumerate(out):
        i = k % rows
        assert t in kept[i], (i, params[i], t)
        seen[i].add(t)
    covered = 0
    for i, p in enumerate(params):
        ids = sorted(kept[i])
        mass = torch.softmax(logits[i].double()[ids] / p.temperature, -1).tolist()
        likely = {t for t, m in zip(ids, mass) if m >= 0.3}
        assert likely <= seen[i], (i, p)
        covered += bool(likely)
    assert covered > 8


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 50
    row = torch.zeros(vocab)
    row[EOS], row[7], row[9], row[11] = 30.0, 29.0, 28.0, 27.0  # EOS > stop 7 > stop 9 > 11
    logits = row[None, :].repeat(6, 1)
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, 9])
    out = tokens(logits, p, nout=[0, 1, 2, 3, 4, 2])
    assert out == [11, 11, 11, EOS, EOS, 11]
    # Random rows too, and ignore_eos does not lift the mask (vLLM masks regardless).
    for kw in ({}, {"ignore_eos": True}):
        rnd = [SamplingParams(temperature=1.0, top_k=2, min_tokens=5, stop_token_ids=[7, 9],
                              seed=s, **kw) for s in range(200)]
        assert set(tokens(row[None, :].repeat(200, 1), rnd, nout=[4] * 200)) == {11}
        # Once min_tokens is reached, EOS and the stop ids compete again.
        assert set(tokens(row[None, :].repeat(200, 1), rnd, nout=[5] * 200)) == {EOS, 7}


def test_min_tokens_does_not_touch_other_rows():
    row = torch.zeros(20)
    row[EOS] = 10.0
    logits = row[None, :].repeat(2, 1)
    params = [SamplingParams(temperature=0.0, min_tokens=4), SamplingParams(temperature=0.0)]
    # The masked row's argmax is the first of the zeros, token 0.
    assert tokens(logits, params, nout=[0, 0]) == [0, EOS]
    assert tokens(logits, params, nout=[4, 0]) == [EOS, EOS]


def test_min_tokens_mask_that_leaves_nothing_is_dropped():
    row = torch.full((10,), NEG_INF)
    row[EOS] = 1.0
    logits = row[None, :].repeat(2, 1)
    params = [SamplingParams(temperature=0.0, min_tokens=5), SamplingParams(min_tokens=5, seed=1)]
    assert tokens(logits, params) == [EOS, EOS]


# ----------------------------------------------------------------------------- determinism

SEEDED = [
    SamplingParams(temperature=1.3, seed=11),
    SamplingParams(temperature=0.9, top_k=40, seed=12),
    SamplingParams(temperature=1.5, top_p=0.9, seed=13),
    SamplingParams(temperature=2.0, min_p=0.02, seed=14),
    SamplingParams(temperature=1.1, top_k=300, top_p=0.95, min_p=0.01, seed=15),
]


def _others(n: int, vocab: int, seed: int, wide: bool):
    """Rows to surround the seeded ones with; `wide` adds a top_k that makes the whole batch
    take the full-sort path instead of the top-k candidate one."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 3
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0, 2.0]),
                             top_k=rng.choice([0, 5, 1000, 3000 if wide else 20]),
                             top_p=rng.choice([1.0, 0.5, 0.99]),
                             min_p=rng.choice([0.0, 0.1]),
                             seed=rng.choice([None, rng.randrange(1 << 40)]),
                             logprobs=rng.choice([None, 3]))
              for _ in range(n)]
    return logits, params


def test_seeded_rows_ignore_the_rest_of_the_batch():
    vocab = 4096
    mine = torch.randn(len(SEEDED), vocab, generator=torch.Generator().manual_seed(6)) * 2
    nout = [17, 0, 5, 3, 99]
    alone = [tokens(mine[i:i + 1], [p], nout=[n]) for i, (p, n) in
             enumerate(zip(SEEDED, nout))]
    alone = [t[0] for t in alone]
    together = tokens(mine, SEEDED, nout=nout)
    assert together == alone
    for trial in range(4):
        other_logits, other_params = _others(10 + 7 * trial, vocab, seed=100 + trial,
                                             wide=trial % 2 == 1)
        logits = torch.cat([other_logits, mine])
        params = other_params + SEEDED
        counts = list(range(len(other_params))) + nout
        order = list(range(len(params)))
        random.Random(trial).shuffle(order)
        out = tokens(logits[order], [params[j] for j in order], nout=[counts[j] for j in order],
                     default_seed=trial, step_id=1000 + trial)
        got = {j: out[k] for k, j in enumerate(order)}
        assert [got[len(other_params) + i] for i in range(len(SEEDED))] == alone


def test_seeded_rows_repeat_after_recompute_and_differ_across_seeds_and_positions():
    vocab = 1000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(7))

    def sequence(seed, **kw):
        p = SamplingParams(temperature=1.5, seed=seed, **kw)
        return tokens(row[None, :].repeat(40, 1), [p] * 40, nout=list(range(40)))

    assert sequence(1) == sequence(1)
    assert sequence(1, top_k=50) == sequence(1, top_k=50)
    assert sum(a != b for a, b in zip(sequence(1), sequence(2))) > 30
    assert len(set(sequence(1))) > 30  # positions draw independently


def test_unseeded_rows_replay_for_the_same_engine_seed_and_step():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(8))
    p = SamplingParams(temperature=1.5)
    a = tokens(logits, p, default_seed=3, step_id=9)
    assert a == tokens(logits, p, default_seed=3, step_id=9)
    assert sum(x != y for x, y in zip(a, tokens(logits, p, default_seed=3, step_id=10))) > 50
    assert sum(x != y for x, y in zip(a, tokens(logits, p, default_seed=4, step_id=9))) > 50
    # Rows of one step draw independently of each other.
    same = torch.randn(1, 1000, generator=torch.Generator().manual_seed(9)).repeat(64, 1)
    assert len(set(tokens(same, p))) > 50


# ----------------------------------------------------------------------------- distribution


@pytest.mark.parametrize("kind", ["seeds", "positions", "unseeded"])
def test_temperature_1_matches_softmax(kind):
    logits = torch.tensor([1.0, 2.5, 0.0, -1.0, 2.0, 0.5, 1.5, -0.5])
    probs = torch.softmax(logits, -1).tolist()
    n = 6000
    batch = logits[None, :].repeat(n, 1)
    if kind == "seeds":
        draws = tokens(batch, [SamplingParams(seed=s) for s in range(n)])
    elif kind == "positions":
        draws = tokens(batch, SamplingParams(seed=1234), nout=list(range(n)))
    else:
        draws = tokens(batch, SamplingParams(), default_seed=5, step_id=77)
    stat, dof = chi_square(draws, dict(enumerate(probs)))
    assert stat < CHI2_999[dof], stat


def test_temperature_and_top_k_distribution():
    logits = torch.tensor([1.0, 2.5, 0.0, -1.0, 2.0, 0.5, 1.5, -0.5])
    scaled = torch.softmax(logits / 0.6, -1)
    top = scaled.topk(4)
    probs = {t: p / top.values.sum().item() for t, p in zip(top.indices.tolist(),
                                                            top.values.tolist())}
    draws = seeded_draws(logits, 6000, temperature=0.6, top_k=4)
    stat, dof = chi_square(draws, probs)
    assert stat < CHI2_999[dof], stat


def test_wide_vocab_distribution_across_blocks():
    """Mass on tokens far apart (and a vocab that is not a multiple of any block size): the
    whole-vocabulary path must find each of them with the right frequency."""
    vocab = 1003
    row = torch.full((vocab,), -30.0)
    heavy = {3: 1.0, 255: 0.2, 256: 1.5, 600: 0.0, 1002: 0.8}
    for t, v in heavy.items():
        row[t] = v
    weights = {t: math.exp(v) for t, v in heavy.items()}
    rest = (vocab - len(heavy)) * math.exp(-30.0)
    total = sum(weights.values()) + rest
    for kw in ({}, {"top_p": 0.999999}, {"min_p": 1e-9}):
        draws = seeded_draws(row, 5000, **kw)
        stat, dof = chi_square(draws, {t: w / total for t, w in weights.items()})
        assert stat < CHI2_999[dof], (kw, stat)


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.99}, {"top_k": 1500}, {"top_k": 200},
                                {"min_p": 0.01}, {"top_k": 350, "top_p": 0.9}])
def test_many_kept_tokens_distribution(kw):
    """Hundreds to thousands of kept tokens (the dense, scattered and compact draw routes):
    draws binned by rank follow the renormalised softmax of the kept set."""
    vocab = 2048
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(17))
    row = torch.empty(vocab)
    row[perm] = torch.linspace(0.0, -7.0, vocab)  # token perm[r] has rank r
    p = SamplingParams(**kw)
    kept = reference_kept(row, p)
    assert len(kept) >= 200
    rank = {t: r for r, t in enumerate(perm.tolist())}
    ids = sorted(kept)
    mass = torch.softmax(row.double()[ids], -1).tolist()
    edges = [0, 20, 60, 120, 200, 350, 600, 1000, vocab]
    bins: dict[int, float] = {}
    for t, m in zip(ids, mass):
        b = next(i for i in range(len(edges) - 1) if rank[t] < edges[i + 1])
        bins[b] = bins.get(b, 0.0) + m
    bins = {b: m for b, m in bins.items() if m > 0.005}
    draws = seeded_draws(row, 3000, **kw)
    assert set(draws) <= kept
    binned = [next(i for i in range(len(edges) - 1) if rank[t] < edges[i + 1]) for t in draws]
    binned = [b if b in bins else -1 for b in binned]
    rest = 1.0 - sum(bins.values())
    probs = dict(bins, **({-1: rest} if rest > 1e-9 else {}))
    stat, dof = chi_square(binned, probs)
    assert stat < CHI2_999[dof], (kw, stat)


def test_zero_weight_columns_are_never_chosen():
    from tokenweir.model.sampler import _search
    cum = torch.tensor([[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    got = [_search(cum, torch.tensor([t], dtype=torch.float64)).item()
           for t in (0.0, 0.5, 1.0, 1.5, 2.0, 7.0)]
    assert got == [2, 2, 4, 4, 4, 4]


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_rank_and_top_n():
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(6, 300, generator=gen) * 2
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=2.5, logprobs=3, seed=1),
              SamplingParams(temperature=1.0, top_k=20, seed=2),  # no logprobs
              SamplingParams(temperature=1.0, logprobs=0, seed=3),
              SamplingParams(temperature=3.0, logprobs=1, min_tokens=4, seed=4),
              SamplingParams(temperature=5.0, logprobs=20, seed=5)]
    # Row 4 is masked for min_tokens: its logprobs still come from the unmasked logits.
    logits[4, EOS] = 100.0
    out = run(logits, params)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[2] is None
    assert out.token_ids[4] != EOS
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        lp = out.logprobs[i]
        assert isinstance(lp, TokenLogprobs)
        t = out.token_ids[i]
        assert lp.sampled_logprob == pytest.approx(ref[i, t].item(), rel=1e-5, abs=1e-5)
        assert lp.sampled_rank == int((ref[i] > ref[i, t]).sum()) + 1
        top = ref[i].topk(p.logprobs)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.logprobs[0].sampled_rank == 1
    assert out.logprobs[0].top_token_ids[0] == out.token_ids[0]
    assert out.logprobs[3].top_token_ids == [] and out.logprobs[3].top_logprobs == []
    assert out.logprobs[4].top_token_ids == [EOS]
    assert out.logprobs[5].sampled_rank > 1  # temperature 5 rarely picks the top token


def test_logprobs_ignore_temperature_when_every_row_asks():
    logits = torch.randn(5, 200, generator=torch.Generator().manual_seed(16)) * 3
    out = run(logits, [SamplingParams(temperature=2.0, top_k=30, logprobs=2, seed=i)
                       for i in range(5)])
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.sampled_logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
        assert lp.top_logprobs == pytest.approx(ref[i].topk(2).values.tolist(), abs=1e-5)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("kw", [
    {"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 2.0, "top_k": 5},
    {"temperature": 2.0, "top_k": 500}, {"top_p": 0.5}, {"top_p": 0.999}, {"min_p": 0.5},
    {"top_k": 3, "top_p": 0.9, "min_p": 0.1, "temperature": 7.0}])
def test_single_finite_logit_is_always_chosen(kw):
    vocab = 8192
    logits = torch.full((8, vocab), NEG_INF)
    only = [0, 1, 255, 256, 1000, 8191, 5, 4500]
    for i, t in enumerate(only):
        logits[i, t] = -3.0 + i
    params = [SamplingParams(seed=(i if i % 2 else None), logprobs=2, **kw) for i in range(8)]
    out = run(logits, params)
    assert out.token_ids == only
    for lp in out.logprobs:
        assert lp.sampled_logprob == 0.0 and lp.sampled_rank == 1


def test_mixed_batch_greedy_and_random_rows_keep_their_places():
    logits = torch.randn(40, 700, generator=torch.Generator().manual_seed(11))
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else
              SamplingParams(temperature=1.0, top_k=1, seed=i) if i % 3 == 1 else
              SamplingParams(temperature=1.0, top_p=1e-4) for i in range(40)]
    assert tokens(logits, params) == logits.argmax(-1).tolist()


def test_half_precision_and_empty_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(12))
    out = tokens(logits.half(), SamplingParams(temperature=0.0))
    assert out == logits.half().float().argmax(-1).tolist()
    empty = sample(torch.empty(0, 100), [], [], frozenset({EOS}), 0, 0)
    assert empty.token_ids == [] and empty.logprobs == []


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), [SamplingParams()], [0], frozenset(), 0, 0)
    with pytest.raises(ValueError):
        sample(torch.zeros(10), [SamplingParams()], [0], frozenset(), 0, 0)


def test_input_logits_are_not_modified():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(13))
    before = logits.clone()
    params = [SamplingParams(temperature=t, min_tokens=2, top_p=0.8, seed=1, logprobs=1)
              for t in (0.0, 1.0)] * 4
    run(logits, params)
    assert torch.equal(logits, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_rules():
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(14)).cuda()
    params = [SamplingParams(temperature=0.0) if i % 4 == 0 else
              SamplingParams(temperature=1.0, top_k=1, seed=i) if i % 4 == 1 else
              SamplingParams(temperature=1.3, top_p=0.9, seed=i, logprobs=2) if i % 4 == 2 else
              SamplingParams(temperature=0.8, seed=i) for i in range(64)]
    out = run(logits, params)
    argmax = logits.argmax(-1).tolist()
    for i in range(0, 64, 4):
        assert out.token_ids[i] == argmax[i] and out.token_ids[i + 1] == argmax[i + 1]
    # Seeded rows do not depend on their neighbours on the GPU either.
    for i in (2, 3, 6, 7):
        assert tokens(logits[i:i + 1], [params[i]])[0] == out.token_ids[i]


def test_many_plain_rows_are_drawn_in_row_chunks_with_the_same_draws(monkeypatch):
    """_sample_plain takes many rows _PLAIN_ROWS at a time on CPU (no >32 MB buffer); rows are
    independent, so the tokens are those of one pass over every row (min-p and temperature
    mixed in). Probe: the chunked run really split the rows."""
    from tokenweir.model import sampler as S

    torch.manual_seed(0)
    logits = torch.randn(23, 300) * 3
    params = [SamplingParams(temperature=0.5 + (i % 3) / 2, min_p=0.05 * (i % 2))
              for i in range(23)]
    monkeypatch.setattr(S, "_PLAIN_ROWS", 1000)
    whole = tokens(logits, params)
    calls = []
    plain = S._sample_plain

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return plain(x, *args, **kwargs)
    monkeypatch.setattr(S, "_sample_plain", counted)
    monkeypatch.setattr(S, "_PLAIN_ROWS", 5)
    assert tokens(logits, params) == whole
    assert calls == [23, 5, 5, 5, 5, 3]
