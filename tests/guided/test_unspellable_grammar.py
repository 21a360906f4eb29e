"""A grammar that needs a byte no token of the model spells (SmolLM2 has no token for 0xF1, the
first UTF-8 byte of U+40000 to U+7FFFF): the request fails as the client's error (HTTP 400),
the step and the other requests go on. Before, the tokenize function llguidance reads dropped
that byte, the mask allowed a wrong token, and the request failed as a server error (500)."""

from __future__ import annotations

import pytest

from tokenweir.engine.engine_core import error_http_status
from tokenweir.guided.decoder import _Wrapper
from tokenweir.guided.vocab import vocabulary_of
from tokenweir.request import INVALID_REQUEST, GuidedDecodingParams, SamplingParams

UNSPELLED = "\U0005378e"  # UTF-8 f1 93 9e 8e


@pytest.fixture(scope="module")
def vocab(smollm2):
    return vocabulary_of(smollm2.tokenizer, smollm2.arch.vocab_size)


def test_the_premise_no_token_spells_0xf1(vocab):
    assert UNSPELLED.encode()[0] == 0xF1
    assert not any(0xF1 in b for b in vocab.token_bytes)
    assert any(b == b"\x93" for b in vocab.token_bytes)  # the bytes after it are spelled


@pytest.mark.parametrize("text, spelled", [
    ("hello, world", "hello, world"), ("ë日本語", "ë日本語"), (UNSPELLED, ""),
    ("ab" + UNSPELLED + "cd", "ab"), ("ë" + UNSPELLED + "ó}", "ë")])
def test_tokenize_spells_exactly_the_longest_spelled_prefix(smollm2, vocab, text, spelled):
    wrapper = _Wrapper(vocab, [f"<|special_{i}|>" for i in range(vocab.size)])
    for given in (text, text.encode()):
        ids = wrapper(given)
        assert b"".join(vocab.token_bytes[i] for i in ids) == spelled.encode()
    # where the tokenizer's own split is exact it is kept (llguidance's canonical tokens)
    assert wrapper(spelled) == smollm2.tokenizer.encode(spelled, add_special_tokens=False)


@pytest.mark.parametrize("regex, first_tokens", [
    ("ë" + UNSPELLED + "ó}", [26547]),  # 'ë' is produced, then the dead end
    (UNSPELLED, [])])  # the dead end at the first mask
def test_a_grammar_no_token_can_continue_fails_as_the_clients_error(llm, regex, first_tokens):
    guided = SamplingParams(max_tokens=4, temperature=1.0, seed=0,
                            guided_decoding=GuidedDecodingParams(regex=regex))
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    bad, ok = llm.generate(["hi", "hi"], [guided, plain], use_tqdm=False)
    out = bad.outputs[0]
    assert out.token_ids == first_tokens  # probe: the grammar ran this far, then no token fit
    assert out.finish_reason == "error"
    assert bad.error.startswith(INVALID_REQUEST), bad.error
    assert "no token of this model can continue the grammar" in bad.error
    assert error_http_status(bad.error) == 400
    # the step went on for the request beside it
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 4
