"""Batched token sampling for one engine step.

`sample(logits, params, num_output_tokens, eos_token_ids, default_seed, step_id)` picks one token
per row of `logits` ([N, vocab]) following vLLM's semantics:

0. logit_bias, repetition, frequency and presence penalties (model/penalties.py), batched;
   nothing at all is done for them when no row of the step uses them.
1. min_tokens: while a request has produced fewer than `min_tokens` tokens, its EOS ids and
   `stop_token_ids` are set to -inf (whatever `ignore_eos` says, as vLLM does). If that would leave
   a row with no finite logit at all, the mask is dropped for that row rather than sampling junk.
2. Greedy rows (`temperature < 1e-5`, vLLM's epsilon; 0 in practice) take the argmax, ties going to
   the lowest token id, all in one batched argmax.
3. The other rows are divided by their temperature, then filtered by top-k, top-p and min-p in
   that order, and one token is drawn from what is left.

Filtering is done with value thresholds on each row sorted in descending order. Rows with a
top-k or top-p take `topk` candidates (top_k + 1, or 128 for top-p alone), then 8 times as many
for the rows whose kept set might reach past them, and a full sort once a tier would cover a
quarter of the vocabulary; rows with neither are never sorted.

- top-k keeps every token whose value is >= the k-th largest (ties at the border are all kept,
  as in vLLM);
- top-p keeps every token whose value is >= that of the first token at which the cumulative
  probability (over the top-k survivors) reaches `top_p`, so at least one token always survives;
- min-p keeps tokens with probability >= `min_p` times the largest probability.

Because every filter is a threshold on values, the kept set is a function of the row alone: not
of the candidate tier that settled it, nor of the order in which a sort returned tied values.

Drawing is inverse-CDF sampling with one uniform number `u` per row: the kept tokens' weights
`exp(v - max)` are accumulated in token-id order (float64 running sums; over a whole vocabulary,
in two levels: 256-token block sums, then inside the chosen block) and the first token whose
running sum passes `u * total` wins. `u` is a pure function of integers, computed in Python with
SplitMix64 (no torch.Generator, no hidden state, one host-to-device copy per step):

- a request with `seed`: from (seed, num_output_tokens), so the same request gets the same token
  at the same output position whatever else shares the batch, in whatever order, and after a
  preemption and recompute;
- a request without one: from (default_seed, step_id, row index), so a whole engine run with a
  fixed default_seed and the same workload replays identically.

Logprobs (for rows whose `params.logprobs` is not None) are vLLM's default "raw" ones:
`log_softmax` of the logits as given, before bias, penalties, min_tokens masking and
temperature. The sampled token's rank counts the tokens with a strictly larger logprob, plus one.

Nothing here is tied to a device: every tensor is created on the logits' device. On CPU a
seeded row's token is bit-for-bit independent of the batch; on a GPU, parallel scans may round
differently for differently shaped batches, which can move a draw only when `u` falls within
rounding distance of a boundary (on the order of 1e-7 per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenweir import faults
from tokenweir.core.outputs import TokenLogprobs
from tokenweir.guided.masks import GuidedMask, apply_guided_mask
from tokenweir.model.penalties import apply_penalties
from tokenweir.model.transfer import to_device
from tokenweir.request import SamplingParams

__all__ = ["SamplerOutput", "process_logits", "sample", "sample_isolated", "row_uniform"]

# vLLM treats temperatures below this as greedy: dividing by them would overflow.
_SAMPLING_EPS = 1e-5
# How many candidates a top-p row without top-k gets from `topk` at first (more if needed).
_TOP_P_CANDIDATES = 128
# A candidate list wider than vocab // this is scattered back to a dense row instead of re-sorted.
_DENSE_FRACTION = 8

_MASK64 = (1 << 64) - 1
_SEEDED_STREAM = 0x5EED_5EED
_UNSEEDED_STREAM = 0xD1CE_D1CE


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row of the logits
    logprobs: list[Optional[TokenLogprobs]]  # None for rows that did not ask


# --------------------------------------------------------------------------- randomness


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(*parts: int) -> int:
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h


def row_uniform(seed: Optional[int], num_output_tokens: int, default_seed: int, step_id: int,
                row: int) -> float:
    """The uniform number in [0, 1) that drives one row's draw (53 random bits)."""
    if seed is not None:
        key = _mix(_SEEDED_STREAM, seed, num_output_tokens)
    else:
        key = _mix(_UNSEEDED_STREAM, default_seed, step_id, row)
    return (key >> 11) * (1.0 / (1 << 53))


# --------------------------------------------------------------------------- entry point


def sample(logits: torch.Tensor,
           params: Sequence[SamplingParams],
           num_output_tokens: Sequence[int],
           eos_token_ids: frozenset[int],
           default_seed: int,
           step_id: int,
           row_ids: Optional[Sequence[int]] = None,
           token_ids: Optional[Sequence[Sequence[int]]] = None,
           guided: Optional[GuidedMask] = None) -> SamplerOutput:
    """Sample one token per row of `logits` ([N, vocab]); see the module docstring.
    `row_ids` (default 0..N-1) are the rows' indices in the step's batch, which seed the draws
    of rows without a seed of their own. `token_ids[i]` (prompt + output so far) is read only
    for rows with penalties (required then). `guided` (tokenweir/guided) forbids, in its rows,
    every token the row's grammar does not allow, before anything else (logprobs included,
    as vLLM does); the other rows are untouched."""
    _check_shapes(logits, params, num_output_tokens)
    # ---- guided decoding: one batched call, -inf where a grammar forbids a token ----
    logits = apply_guided_mask(logits, guided)
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return SamplerOutput(token_ids=[], logprobs=[])
    raw = logits if logits.dtype == torch.float32 else logits.float()
    x = process_logits(raw, params, num_output_tokens, eos_token_ids, token_ids)
    greedy_rows = [i for i, p in enumerate(params) if p.temperature < _SAMPLING_EPS]
    random_rows = [i for i, p in enumerate(params) if p.temperature >= _SAMPLING_EPS]
    tokens = torch.empty(num_rows, dtype=torch.long, device=raw.device)
    if greedy_rows:
        tokens = _put_greedy(x, greedy_rows, tokens)
    if random_rows:
        seeds = [row_uniform(params[i].seed, num_output_tokens[i], default_seed, step_id,
                             i if row_ids is None else row_ids[i]) for i in random_rows]
        tokens = _put_random(x, params, random_rows, seeds, tokens)
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=_logprobs(raw, params, tokens))


def process_logits(raw: torch.Tensor, params: Sequence[SamplingParams],
                   num_output_tokens: Sequence[int], eos_token_ids: frozenset[int],
                   token_ids: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
    """The logits the draw (or argmax) sees, before temperature: steps 0 and 1 of the module
    docstring. `raw` itself when no row has penalties or a min_tokens mask; never modified."""
    x = apply_penalties(raw, params, token_ids, num_output_tokens)
    masks = _min_tokens_masks(params, num_output_tokens, eos_token_ids, raw.shape[1])
    return _apply_masks(x, masks)  # `x` itself when nothing is masked


def _check_shapes(logits: torch.Tensor, params: Sequence[SamplingParams],
                  num_output_tokens: Sequence[int]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, vocab], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    if len(params) != num_rows or len(num_output_tokens) != num_rows:
        raise ValueError(f"{num_rows} logit rows but {len(params)} params and "
                         f"{len(num_output_tokens)} output counts")


def _min_tokens_masks(params: Sequence[SamplingParams], num_output_tokens: Sequence[int],
                      eos_token_ids: frozenset[int], vocab: int) -> dict[int, list[int]]:
    """Row -> the columns (EOS and stop tokens) masked while it has fewer than min_tokens."""
    masks: dict[int, list[int]] = {}
    for i, (p, n_out) in enumerate(zip(params, num_output_tokens)):
        if n_out < p.min_tokens:
            cols = sorted({t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab})
            if cols:
                masks[i] = cols
    return masks


def _put_greedy(x: torch.Tensor, greedy_rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` with the greedy rows' argmax written in (a new tensor when every row is)."""
    num_rows = x.shape[0]
    if len(greedy_rows) == num_rows:
        return x.argmax(dim=-1)
    idx = _index(greedy_rows, x.device)
    # An argmax over every row is cheaper than copying out the greedy half of them.
    greedy = x.argmax(dim=-1)[idx] if 2 * len(greedy_rows) >= num_rows \
        else x[idx].argmax(dim=-1)
    tokens[idx] = greedy
    return tokens


def _put_random(x: torch.Tensor, params: Sequence[SamplingParams], random_rows: list[int],
                uniforms: list[float], tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` with the random rows' draws written in (a new tensor when every row is)."""
    sub = [params[i] for i in random_rows]
    # One host-to-device copy for every per-row scalar.
    scalars = to_device(
        [[p.temperature for p in sub], [float(p.top_k) for p in sub], [p.top_p for p in sub],
         [p.min_p for p in sub], uniforms], torch.float64, x.device)
    all_rows = len(random_rows) == x.shape[0]
    if not all_rows:
        x = x[_index(random_rows, x.device)]
    picked = _sample_random(x, sub, _finite_temperature(scalars[0], x.dtype), scalars[1].long(),
                            scalars[2], scalars[3], scalars[4])
    if all_rows:
        return picked
    tokens[_index(random_rows, x.device)] = picked
    return tokens


def sample_isolated(logits: torch.Tensor, params: Sequence[SamplingParams],
                    num_output_tokens: Sequence[int], eos_token_ids: frozenset[int],
                    default_seed: int, step_id: int, request_ids: Sequence[str],
                    token_ids: Optional[Sequence[Sequence[int]]] = None,
                    guided: Optional[GuidedMask] = None
                    ) -> tuple[SamplerOutput, dict[int, str]]:
    """`sample`, with a failure confined to the row that caused it.

    When the batched call raises, every row is sampled alone, with the draw it would have had
    in the batch (same row index), so the good rows get exactly the tokens the batch would have
    given them. Returns the output and {row: error message} for the rows that failed alone;
    those rows hold token -1 and no logprobs. (`request_ids` name the rows for fault points.)
    """
    try:
        _fire_sampling(request_ids)
        return sample(logits, params, num_output_tokens, eos_token_ids, default_seed,
                      step_id, token_ids=token_ids, guided=guided), {}
    except Exception:  # noqa: BLE001 - find the row(s) to blame below
        pass
    token_ids: list[int] = []
    logprobs: list[Optional[TokenLogprobs]] = []
    errors: dict[int, str] = {}
    for i in range(len(params)):
        try:
            _fire_sampling(request_ids[i:i + 1])
            one = sample(logits[i:i + 1], params[i:i + 1], num_output_tokens[i:i + 1],
                         eos_token_ids, default_seed, step_id, row_ids=[i],
                         token_ids=None if token_ids is None else token_ids[i:i + 1],
                         guided=_guided_row(guided, i))
        except Exception as exc:  # noqa: BLE001 - this row alone fails
            errors[i] = f"sampling failed: {exc!r}"
            token_ids.append(-1)
            logprobs.append(None)
            continue
        token_ids.append(one.token_ids[0])
        logprobs.append(one.logprobs[0])
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs), errors


def _guided_row(guided: Optional[GuidedMask], row: int) -> Optional[GuidedMask]:
    """The part of `guided` that covers logits row `row`, renumbered as row 0."""
    if guided is None or row not in guided.rows:
        return None
    j = guided.rows.index(row)
    return GuidedMask([0], guided.bitmask[j:j + 1])


def _fire_sampling(request_ids: Sequence[str]) -> None:
    if faults.ARMED:
        for request_id in request_ids:
            faults.fire("sampling", request_id)


# --------------------------------------------------------------------------- helpers


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(rows, torch.long, device)


def _apply_masks(raw: torch.Tensor, masks: dict[int, list[int]]) -> torch.Tensor:
    """A copy of `raw` with the min_tokens masks applied; `raw` itself when there are none.
    (`raw` here is whatever the masks apply to: the penalized logits when there are any.)"""
    if not masks:
        return raw
    x = raw.clone()
    r_idx = [i for i, cols in masks.items() for _ in cols]
    c_idx = [c for cols in masks.values() for c in cols]
    x[_index(r_idx, x.device), _index(c_idx, x.device)] = float("-inf")
    # A mask that leaves nothing finite is dropped (the model can only say "stop").
    m_rows = _index(list(masks), x.device)
    dead = torch.isneginf(x[m_rows].amax(dim=-1))
    if bool(dead.any()):
        dead_rows = m_rows[dead]
        x[dead_rows] = raw[dead_rows]
    return x


def _finite_temperature(temperature: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The temperatures capped at `dtype`'s largest finite value. SamplingParams accepts any
    finite temperature, and one beyond float32's range (1e57) became inf in the logits' dtype:
    a masked token's -inf / inf is NaN, and the draw indexed past the vocabulary (a 500 from
    the server, found by tests/server/test_fuzz.py). Capped, every allowed token's weight is
    exp(~0) = 1 (the limit of an ever larger temperature) and a masked one's stays 0; rows
    within range are unchanged."""
    return temperature.clamp(max=torch.finfo(dtype).max)


def _sample_random(x: torch.Tensor, params: list[SamplingParams], temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of the unscaled `x` after temperature, top-k, top-p and min-p."""
    num_rows, vocab = x.shape
    truncated = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    plain = [i for i, p in enumerate(params) if not (p.top_k > 0 or p.top_p < 1.0)]
    out = torch.empty(num_rows, dtype=torch.long, device=x.device)
    groups = []
    if plain:
        groups.append((plain, _sample_plain,
                       dict(scale=any(params[i].temperature != 1.0 for i in plain),
                            use_min_p=any(params[i].min_p > 0 for i in plain))))
    if truncated:
        width = max((params[i].top_k + 1) if params[i].top_k > 0 else _TOP_P_CANDIDATES
                    for i in truncated)
        groups.append((truncated, _sample_truncated, dict(width=width)))
    for rows, fn, kwargs in groups:
        if len(rows) == num_rows:
            return fn(x, temperature, top_k, top_p, min_p, u, **kwargs)
        idx = _index(rows, x.device)
        out[idx] = fn(x[idx], temperature[idx], top_k[idx], top_p[idx], min_p[idx], u[idx],
                      **kwargs)
    return out


_PLAIN_ROWS = 64  # rows per buffer in _sample_plain on CPU (64 x 49k float32: 12.6 MB)


def _sample_plain(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor, *, scale: bool,
                  use_min_p: bool) -> torch.Tensor:
    """Rows with neither top-k nor top-p: the whole vocabulary is a candidate (less min-p's cut).

    One [rows, vocab] buffer: w = exp((x - max) / t) = p / p_max, so min-p is `w >= min_p`.
    Rows are independent, so many rows go _PLAIN_ROWS at a time (the same draws): a float32
    buffer of 200 rows x 49k tokens is over glibc's 32 MB mmap threshold, a fresh mapping every
    step whose first touch page-faults (200 rows: 14.6 ms, against ~6 without the faults)."""
    if x.shape[0] > _PLAIN_ROWS and x.device.type == "cpu":
        return torch.cat([
            _sample_plain(x[a:a + _PLAIN_ROWS], temperature[a:a + _PLAIN_ROWS],
                          top_k[a:a + _PLAIN_ROWS], top_p[a:a + _PLAIN_ROWS],
                          min_p[a:a + _PLAIN_ROWS], u[a:a + _PLAIN_ROWS], scale=scale,
                          use_min_p=use_min_p)
            for a in range(0, x.shape[0], _PLAIN_ROWS)])
    vmax = _finite_or_zero(x.amax(dim=-1, keepdim=True))
    w = x - vmax  # the one full-size buffer: everything after is in place
    if scale:
        w.div_(temperature.to(w.dtype)[:, None])
    w.exp_()
    if use_min_p:
        w.masked_fill_(w < min_p.to(w.dtype)[:, None], 0.0)
    return _pick_dense(w, u)


def _sample_truncated(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor, *,
                      width: int) -> torch.Tensor:
    """Rows with top-k and/or top-p. Sorting commutes with dividing by a positive temperature,
    so the candidates are taken from the raw row and only they are scaled.

    Candidates come in tiers: `topk(width)`, then 8 times wider for the rows whose kept set
    could reach past it, and so on until a tier would be a quarter of the vocabulary, where a
    full sort takes over. Which tier settles a row never changes its kept set."""
    num_rows, vocab = x.shape
    t = temperature.to(x.dtype)[:, None]
    # Rows with top_p but no top_k need the probability mass of the whole row.
    total_full = torch.ones(num_rows, dtype=torch.float64, device=x.device)
    need_total = (top_k <= 0) & (top_p < 1.0)
    if bool(need_total.any()):
        rows = need_total.nonzero().squeeze(1)
        xr = x[rows]
        vmax = _finite_or_zero(xr.amax(dim=-1, keepdim=True))
        xr.div_(t[rows])
        total_full[rows] = xr.sub_(vmax / t[rows]).exp().sum(dim=-1).to(torch.float64)

    out = torch.empty(num_rows, dtype=torch.long, device=x.device)
    pending: Optional[torch.Tensor] = None  # rows of x still to settle; None: all (no copy)
    while True:
        take = (lambda v: v) if pending is None else (lambda v: v[pending])
        whole_row = 4 * width >= vocab
        xs = take(x)
        vals, ids = xs.sort(dim=-1, descending=True) if whole_row else xs.topk(width, dim=-1)
        vals = vals / take(t)
        n_keep, incomplete = _keep_counts(vals, take(top_k), take(top_p), take(min_p),
                                          take(total_full), whole_row)
        if whole_row or not bool(incomplete.any()):
            picked = _pick_sorted(vals, ids, n_keep, take(u), vocab)
            if pending is None:
                return picked
            out[pending] = picked
            return out
        ok = (~incomplete).nonzero().squeeze(1)
        if ok.numel():
            out[ok if pending is None else pending[ok]] = _pick_sorted(
                vals[ok], ids[ok], n_keep[ok], take(u)[ok], vocab)
        bad = incomplete.nonzero().squeeze(1)
        pending = bad if pending is None else pending[bad]
        width = min(vocab, width * 8)


def _keep_counts(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, total_full: torch.Tensor,
                 whole_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows sorted in descending order: how many leading values survive the filters, and
    whether that could not be decided from these columns alone (never when `whole_row`).

    Every count is a binary search in the sorted row, not a pass over it."""
    num_rows, width = vals.shape
    neg = -vals  # ascending
    neg_inf = torch.full((num_rows, 1), float("-inf"), dtype=vals.dtype, device=vals.device)

    def count_at_least(thr: torch.Tensor) -> torch.Tensor:  # thr: [rows, 1]
        return torch.searchsorted(neg, -thr, right=True).squeeze(1)

    n_finite = torch.searchsorted(neg, -neg_inf, right=False).squeeze(1)
    vmax = vals[:, :1]

    # top-k: keep everything >= the k-th largest value.
    has_k = top_k > 0
    kth = vals.gather(1, (top_k.clamp(1, width) - 1)[:, None])
    thr_k = torch.where(has_k[:, None], kth, neg_inf)
    n_k = torch.minimum(count_at_least(thr_k), n_finite)

    # top-p over the top-k survivors (or the whole row): the first position whose cumulative
    # probability reaches top_p sets the threshold.
    has_p = top_p < 1.0
    thr_p = neg_inf
    first = torch.zeros_like(n_k)
    if bool(has_p.any()):
        cum = (vals - _finite_or_zero(vmax)).exp().cumsum(dim=-1, dtype=torch.float64)
        total = torch.where(has_k, cum.gather(1, (n_k - 1).clamp(min=0)[:, None]).squeeze(1),
                            total_full)
        first = torch.searchsorted(cum, (top_p * total)[:, None], right=False).squeeze(1)
        thr_p = torch.where(has_p[:, None],
                            vals.gather(1, first.clamp(max=width - 1)[:, None]), neg_inf)

    # min-p: probability >= min_p * max probability, i.e. value >= max + log(min_p).
    thr_m = vmax + torch.log(min_p).to(vals.dtype)[:, None]  # log(0) = -inf: no cut

    thr = torch.maximum(torch.maximum(thr_k, thr_p), thr_m)
    n_keep = torch.minimum(count_at_least(thr), n_finite).clamp(min=1)
    if whole_row:
        incomplete = torch.zeros(num_rows, dtype=torch.bool, device=vals.device)
    else:
        incomplete = (has_k & (n_k >= width)) | (has_p & (first >= width))
    return n_keep, incomplete


def _pick_sorted(vals: torch.Tensor, ids: torch.Tensor, n_keep: torch.Tensor, u: torch.Tensor,
                 vocab: int) -> torch.Tensor:
    """Draw among each row's first `n_keep` (value-sorted) candidates, in token-id order.

    A row keeping few tokens re-sorts them by id; one keeping many (a decision that depends
    on the row alone) scatters them back into a dense row."""
    dense = n_keep * _DENSE_FRACTION > vocab
    if bool(dense.any()):
        out = torch.empty(vals.shape[0], dtype=torch.long, device=vals.device)
        for sel, fn in ((dense, _pick_scattered), (~dense, _pick_compact)):
            rows = sel.nonzero().squeeze(1)
            if rows.numel():
                out[rows] = fn(vals[rows], ids[rows], n_keep[rows], u[rows], vocab)
        return out
    return _pick_compact(vals, ids, n_keep, u, vocab)


def _kept_weights(vals: torch.Tensor, ids: torch.Tensor,
                  n_keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = int(n_keep.max())
    vmax = _finite_or_zero(vals[:, :1])
    valid = torch.arange(width, device=vals.device)[None, :] < n_keep[:, None]
    w = (vals[:, :width] - vmax).exp().masked_fill_(~valid, 0.0)
    return w, ids[:, :width], valid


def _pick_compact(vals: torch.Tensor, ids: torch.Tensor, n_keep: torch.Tensor, u: torch.Tensor,
                  vocab: int) -> torch.Tensor:
    w, cand, valid = _kept_weights(vals, ids, n_keep)
    key, order = cand.masked_fill(~valid, vocab).sort(dim=-1)
    pos = _pick(w.gather(1, order).cumsum(dim=-1, dtype=torch.float64), u)
    return key.gather(1, pos[:, None]).squeeze(1)


def _pick_scattered(vals: torch.Tensor, ids: torch.Tensor, n_keep: torch.Tensor,
                    u: torch.Tensor, vocab: int) -> torch.Tensor:
    w, cand, _ = _kept_weights(vals, ids, n_keep)
    dense = torch.zeros(vals.shape[0], vocab, dtype=w.dtype, device=w.device)
    return _pick_dense(dense.scatter_(1, cand, w), u)


_BLOCK = 256


def _pick_dense(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over a dense [rows, vocab] weight tensor in two levels: per-block sums pick a
    block of _BLOCK tokens, a float64 running sum inside it picks the token. Avoids a float64
    copy and scan of the whole tensor."""
    num_rows, vocab = w.shape
    num_blocks = -(-vocab // _BLOCK)
    if num_blocks * _BLOCK != vocab:
        w = torch.nn.functional.pad(w, (0, num_blocks * _BLOCK - vocab))
    blocks = w.view(num_rows, num_blocks, _BLOCK)
    block_cum = blocks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)
    target = u * block_cum[:, -1]
    b = _search(block_cum, target)
    before = torch.where(b > 0, block_cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1),
                         torch.zeros_like(target))
    inner = blocks.gather(1, b[:, None, None].expand(num_rows, 1, _BLOCK)).squeeze(1)
    pos = _search(inner.cumsum(dim=-1, dtype=torch.float64), target - before)
    return b * _BLOCK + pos


def _pick(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _search(cum, u * cum[:, -1])


def _search(cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first column whose running weight exceeds `target`, never past the last column of
    positive weight (so never a zero-weight column, unless the row has no weight at all)."""
    pos = torch.searchsorted(cum, target[:, None], right=True)
    last = torch.searchsorted(cum, cum[:, -1:].contiguous(), right=False)
    return torch.minimum(pos, last).squeeze(1)


def _count(mask: torch.Tensor) -> torch.Tensor:
    """Row-wise number of True values; int32 accumulation avoids a full-size int64 copy."""
    return mask.sum(dim=-1, dtype=torch.int32)


def _finite_or_zero(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(v), v, torch.zeros_like(v))


def _logprobs(raw: torch.Tensor, params: Sequence[SamplingParams],
              tokens: torch.Tensor) -> list[Optional[TokenLogprobs]]:
    out: list[Optional[TokenLogprobs]] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    if len(rows) == len(params):
        lp = torch.log_softmax(raw, dim=-1)
        chosen = tokens[:, None]
    else:
        idx = _index(rows, raw.device)
        lp = torch.log_softmax(raw[idx], dim=-1)
        chosen = tokens[idx][:, None]
    sampled = lp.gather(1, chosen)
    ranks = _count(lp > sampled) + 1
    n_top = min(max(params[i].logprobs for i in rows), raw.shape[1])
    if n_top > 0:
        top_lp, top_ids = lp.topk(n_top, dim=-1)
        top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    else:
        top_lp_l = top_ids_l = [[] for _ in rows]
    for j, (i, s, r) in enumerate(zip(rows, sampled.squeeze(1).tolist(), ranks.tolist())):
        n = params[i].logprobs
        out[i] = TokenLogprobs(sampled_logprob=s, sampled_rank=r,
                               top_token_ids=top_ids_l[j][:n], top_logprobs=top_lp_l[j][:n])
    return out
