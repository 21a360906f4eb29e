"""Per-request logit bias and penalties of one sampling step, batched over the rows.

`apply_penalties(x, params, token_ids, num_output_tokens)` applies, in vLLM's order:

1. logit_bias: `x[token] += bias` (OpenAI's `logit_bias`; transformers' SequenceBiasLogitsProcessor
   for one-token sequences);
2. repetition_penalty `r` (vLLM's and transformers' RepetitionPenaltyLogitsProcessor rule): for
   every token seen in the prompt OR the output, a positive logit is divided by `r`, a negative
   one multiplied by it;
3. frequency and presence penalties as OpenAI documents them, over the OUTPUT tokens only:
   `x[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`, `c[j]` being how many
   times token j was sampled so far.

Contract: `x` is not modified. When no row uses any of them, `x` itself is returned and nothing
else is done (one pass over `params`). Otherwise a new tensor is returned, whose rows without
penalties equal `x`'s. The work is batched: one host-to-device copy of the penalty rows'
token ids (flattened), a `unique` over (row, token) keys that yields the seen pairs and the
output counts, and gather / scatter of just those logits with per-row penalty vectors; there
is no per-row tensor operation and no [rows, vocab] temporary besides the output.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

from tokenweir.model.transfer import to_device
from tokenweir.request import SamplingParams

__all__ = ["TokenHistory", "apply_penalties"]

# One row's prompt + output token ids: a list, or an int64 array (TokenHistory.view()).
TokenIds = Union[Sequence[int], np.ndarray]


class TokenHistory:
    """A request's prompt + output token ids in a growing int64 buffer (capacity doubles), so
    that a step hands the sampler an array view instead of converting a Python list of
    hundreds of ints. The runner keeps one only for requests that use penalties."""

    __slots__ = ("_buf", "_len")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._buf = np.empty(max(16, 2 * len(token_ids)), dtype=np.int64)
        self._buf[:len(token_ids)] = token_ids
        self._len = len(token_ids)

    def append(self, token_id: int) -> None:
        if self._len == len(self._buf):
            self._buf = np.concatenate([self._buf, np.empty_like(self._buf)])
        self._buf[self._len] = token_id
        self._len += 1

    def view(self) -> np.ndarray:
        return self._buf[:self._len]


def apply_penalties(x: torch.Tensor, params: Sequence[SamplingParams],
                    token_ids: Optional[Sequence[TokenIds]],
                    num_output_tokens: Sequence[int]) -> torch.Tensor:
    """`x` ([N, vocab]) with each row's logit bias and penalties applied (see the module
    docstring). `token_ids[i]` is row i's prompt followed by its output so far, the last
    `num_output_tokens[i]` of them being the output; only rows with penalties are read."""
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return x
    if token_ids is None:
        raise ValueError("penalties and logit_bias need each row's token ids")
    sub_params = [params[i] for i in rows]
    all_rows = len(rows) == x.shape[0]
    idx = None if all_rows else to_device(rows, torch.long, x.device)
    sub = x.clone() if all_rows else x.index_select(0, idx)
    _add_bias(sub, sub_params)
    if any(_has_penalty(p) for p in sub_params):
        _penalize(sub, sub_params, [token_ids[i] for i in rows],
                  [num_output_tokens[i] for i in rows])
    if all_rows:
        return sub
    return x.index_copy(0, idx, sub)


def _has_penalty(p: SamplingParams) -> bool:
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0)


def _add_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """x[row, token] += bias for every (token, bias) of every row's logit_bias, in place."""
    r_idx = [r for r, p in enumerate(params) for _ in (p.logit_bias or ())]
    if not r_idx:
        return
    c_idx = [t for p in params for t in (p.logit_bias or ())]
    values = [float(b) for p in params for b in (p.logit_bias or {}).values()]
    dev = x.device
    x.index_put_((to_device(r_idx, torch.long, dev), to_device(c_idx, torch.long, dev)),
                 to_device(values, x.dtype, dev), accumulate=True)


def _penalize(x: torch.Tensor, params: Sequence[SamplingParams],
              seqs: Sequence[TokenIds], num_output: Sequence[int]) -> None:
    """Repetition, then frequency and presence penalties, in place on every row of `x`: the
    sparse pass on CPU, the dense one on CUDA (no host synchronisation)."""
    if x.device.type == "cuda":
        _penalize_dense(x, params, seqs, num_output)
    else:
        _penalize_sparse(x, params, seqs, num_output)


def _penalize_dense(x: torch.Tensor, params: Sequence[SamplingParams],
                    seqs: Sequence[TokenIds], num_output: Sequence[int]) -> None:
    """The same penalties with [rows, vocab] masks and counts built by scatters whose sizes
    are known on the host (the sparse pass's `unique` and `repeat_interleave` wait for the
    device to learn their output sizes: a synchronisation inside the step on CUDA). Every
    element is computed by the sparse pass's expressions, so the results are identical."""
    num_rows, vocab = x.shape
    dev = x.device
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    row_of = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)
    first_output = np.repeat(lengths - np.asarray(num_output, dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    is_output = (np.arange(flat.size) - starts) >= first_output
    rows, cols = to_device(row_of, torch.long, dev), to_device(flat, torch.long, dev)
    scalars = to_device([[p.repetition_penalty for p in params],
                         [p.frequency_penalty for p in params],
                         [p.presence_penalty for p in params]], x.dtype, dev)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=dev)
        seen[rows, cols] = True
        r = scalars[0][:, None]
        penalized = torch.where(x > 0, x / r, x * r).nan_to_num_(
            nan=0.0, posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
        x.copy_(torch.where(seen & ~torch.isneginf(x), penalized, x))
    if is_output.any():
        out = to_device(np.flatnonzero(is_output), torch.long, dev)
        counts = torch.zeros(num_rows, vocab, dtype=x.dtype, device=dev)
        counts.index_put_((rows[out], cols[out]), torch.ones((), dtype=x.dtype, device=dev)
                          .expand(out.numel()), accumulate=True)
        hit = counts > 0
        x.sub_(torch.where(hit, counts * scalars[1][:, None] + scalars[2][:, None],
                           torch.zeros((), dtype=x.dtype, device=dev)))


def _penalize_sparse(x: torch.Tensor, params: Sequence[SamplingParams],
                     seqs: Sequence[TokenIds], num_output: Sequence[int]) -> None:
    """Repetition, then frequency and presence penalties, in place on every row of `x`.

    Sparse: only the (row, token) pairs that occur are touched, found with one `unique` over
    `row * vocab + token` keys; no [rows, vocab] temporary is made."""
    num_rows, vocab = x.shape
    dev = x.device
    lengths = to_device([len(s) for s in seqs], torch.long, dev)
    flat = torch.from_numpy(np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]))
    flat = flat.to(dev)
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=dev), lengths)
    # Position of each flat token inside its row; outputs start at len - num_output.
    pos = torch.arange(flat.numel(), device=dev) - (lengths.cumsum(0) - lengths)[row_of]
    first_output = lengths - to_device(list(num_output), torch.long, dev)
    is_output = pos >= first_output[row_of]
    scalars = to_device([[p.repetition_penalty for p in params],
                         [p.frequency_penalty for p in params],
                         [p.presence_penalty for p in params]], x.dtype, dev)
    keys = row_of * vocab + flat
    if any(p.repetition_penalty != 1.0 for p in params):
        rows, cols = _split(torch.unique(keys), vocab)  # seen in the prompt or the output
        v, r = x[rows, cols], scalars[0][rows]
        # An extreme penalty (r under float32's range, 1e-40 say) must not hand the sampler
        # +inf or NaN: +inf becomes the largest float, NaN (0 / 0) zero; -inf stays -inf.
        penalized = torch.where(v > 0, v / r, v * r).nan_to_num_(
            nan=0.0, posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
        x[rows, cols] = torch.where(torch.isneginf(v), v, penalized)
    out_keys, counts = torch.unique(keys[is_output], return_counts=True)
    if out_keys.numel():
        rows, cols = _split(out_keys, vocab)
        x[rows, cols] -= counts.to(x.dtype) * scalars[1][rows] + scalars[2][rows]


def _split(keys: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(keys, vocab, rounding_mode="floor"), keys % vocab
