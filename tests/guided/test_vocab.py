"""The vocabulary llguidance is built from must spell exactly what our tokenizer decodes."""

from __future__ import annotations

import pytest

from tokenweir.guided.vocab import vocabulary_of


@pytest.fixture(scope="module")
def vocab(smollm2):
    return vocabulary_of(smollm2.tokenizer, smollm2.arch.vocab_size)


@pytest.mark.parametrize("text", [
    'Hello, world! {"a": [1, 2.5e-3, null]}', "  leading spaces\n\ttabs",
    "naïve café — 東京 🙂", "x" * 50])
def test_token_bytes_concatenate_to_the_text(smollm2, vocab, text):
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode("utf-8")


def test_special_and_stop_tokens(smollm2, vocab):
    assert vocab.size == 49152
    assert {0, 1, 2} <= vocab.special_ids and vocab.stop_ids == {2}
    assert vocab.special_names[2] == "<|im_end|>" and vocab.token_bytes[2] == b""
    assert len(vocab.special_ids) == 17  # the GGUF's control tokens, nothing else
