"""Token bitmasks, and applying them to a step's logits (torch only, no grammar library);
with the rows the runner hands to the guided decoder (GuidedRow) and the masks it gets back
(GuidedMask).

A bitmask row has ceil(vocab / 32) int32 words; token t is allowed when bit `t % 32` (least
significant first) of word `t // 32` is set: the layout llguidance and xgrammar both fill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Sequence

import numpy as np
import torch

from tokenweir.request import GuidedDecodingParams


@dataclass(slots=True)
class GuidedRow:
    """One row of the step's logits that will be sampled: its request and what it needs."""

    row: int
    req_id: str
    params: GuidedDecodingParams
    output_token_ids: Sequence[int]  # replayed into a matcher built for this request now


@dataclass(slots=True)
class GuidedMask:
    """The allowed tokens of some rows of one step's logits: `bitmask[j]` covers logits row
    `rows[j]`; rows not listed are not constrained."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, on the CPU
    # Request id -> why its mask could not be computed (its row is left unconstrained here;
    # the runner fails that request instead of sampling for it).
    errors: dict[str, str] = field(default_factory=dict)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool (on the CPU): which tokens each bitmask row allows. numpy's
    unpackbits does it in one pass (several times faster than shifting in torch here)."""
    words = np.ascontiguousarray(bitmask.cpu().numpy()).view(np.uint8)  # little-endian words
    bits = np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def allowed_tokens_on_device(bitmask: torch.Tensor, vocab_size: int,
                             device: torch.device) -> torch.Tensor:
    """allowed_tokens, unpacked on `device`: the packed words (32 times smaller than the
    [rows, vocab] bools) travel through pinned memory without a host synchronisation."""
    device = torch.device(device)
    words = (bitmask.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
             else bitmask.to(device))
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32], least significant first
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def apply_guided_mask(logits: torch.Tensor, mask: GuidedMask | None) -> torch.Tensor:
    """`logits` with -inf wherever `mask` forbids a token: a new tensor when any row is
    constrained (the caller's logits are never written), `logits` itself otherwise. Rows that
    are not in `mask.rows` come back bit-for-bit unchanged."""
    if mask is None or not mask.rows:
        return logits
    num_rows, vocab = logits.shape
    if logits.device.type == "cuda":
        allowed = allowed_tokens_on_device(mask.bitmask, vocab, logits.device)
    else:
        allowed = allowed_tokens(mask.bitmask, vocab)
    out = logits.clone()
    if mask.rows == list(range(num_rows)):
        return out.masked_fill_(~allowed, float("-inf"))
    idx = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out
