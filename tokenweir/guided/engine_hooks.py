"""What the engine calls: check a request's guided decoding when it is made, and give the
runner its guided decoder."""

from __future__ import annotations

from typing import Any, Optional

from tokenweir.guided.decoder import GuidedDecoder
from tokenweir.guided.grammar import check_guided  # noqa: F401 (its home was here)
from tokenweir.guided.vocab import vocabulary_of


def attach_guided_decoder(runner: Any, tokenizer: Any,
                          vocab_size: int) -> Optional[GuidedDecoder]:
    """Give `runner` (a ModelRunner, or a tensor-parallel executor whose rank-0 runner
    samples) a guided decoder built from `tokenizer`'s vocabulary; None without a tokenizer."""
    if tokenizer is None:
        return None
    decoder = GuidedDecoder(lambda: vocabulary_of(tokenizer, vocab_size), vocab_size)
    getattr(runner, "runner", runner).guided = decoder
    return decoder
