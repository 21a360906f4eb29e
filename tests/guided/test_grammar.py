"""Guided decoding without the model: parameter checks, grammars, masks, the vocabulary."""

from __future__ import annotations

import llguidance
import pytest
import torch

from tokenweir.guided.grammar import compile_grammar
from tokenweir.guided.masks import GuidedMask, apply_guided_mask, bitmask_words
from tokenweir.model.sampler import sample
from tokenweir.request import GuidedDecodingParams, SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(json={"type": "foo"}), "guided_decoding.json"),
    (dict(json="{not json"), "guided_decoding.json"),
    (dict(json={"type": "string", "pattern": "(("}), "guided_decoding.json"),
    (dict(json={"$ref": "#/definitions/missing"}), "guided_decoding.json"),
    (dict(regex="(("), "guided_decoding.regex"),
    (dict(regex="[a-"), "guided_decoding.regex"),
    (dict(grammar="start: ((("), "guided_decoding.grammar"),
    (dict(grammar="root ::= (\"a\""), "guided_decoding.grammar"),
])
def test_a_bad_spec_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        compile_grammar(GuidedDecodingParams(**kwargs))
    assert str(exc.value).startswith(field)


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(json=5), "guided_decoding.json"),
    (dict(regex=""), "guided_decoding.regex"),
    (dict(choice=[]), "guided_decoding.choice"),
    (dict(choice=["a", ""]), "guided_decoding.choice[1]"),
    (dict(choice=["a", 3]), "guided_decoding.choice[1]"),
    (dict(json_object="yes"), "guided_decoding.json_object"),
])
def test_guided_params_shape_is_checked_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        GuidedDecodingParams(**kwargs)


def test_ignore_eos_is_refused_with_guided_decoding():
    with pytest.raises(ValueError, match="^ignore_eos"):
        SamplingParams(ignore_eos=True, guided_decoding=GuidedDecodingParams(regex="a+"))
    with pytest.raises(ValueError, match="guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"regex": "a"})


@pytest.mark.parametrize("kwargs", [
    dict(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    dict(json='{"type": "array", "items": {"type": "boolean"}}'),
    dict(json_object=True), dict(regex=r"\d{3}-[a-z]+"), dict(choice=["yes", "no", 'a"b']),
    dict(grammar='root ::= "a" | "b" digits\ndigits ::= [0-9]+'),  # GBNF
    dict(grammar='start: "x"+ "y"'),  # Lark
])
def test_good_specs_compile(kwargs):
    grammar = compile_grammar(GuidedDecodingParams(**kwargs))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def _bitmask(allowed_rows: list[set[int]], vocab: int) -> torch.Tensor:
    words = torch.zeros(len(allowed_rows), bitmask_words(vocab), dtype=torch.int64)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_mask_sets_minus_inf_exactly_where_forbidden_and_leaves_other_rows():
    vocab = 100
    logits = torch.randn(4, vocab)
    before = logits.clone()
    allowed = [{0, 31, 32, 63, 99}, set(range(40, 70))]
    out = apply_guided_mask(logits, GuidedMask([1, 3], _bitmask(allowed, vocab)))
    assert torch.equal(logits, before), "the caller's logits must not be written"
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    for row, ok in zip((1, 3), allowed):
        for t in range(vocab):
            assert (out[row, t] == before[row, t]) if t in ok else out[row, t] == -float("inf")
    assert apply_guided_mask(logits, None) is logits


def test_sampler_draws_only_allowed_tokens():
    vocab = 64
    logits = torch.zeros(3, vocab)
    logits[:, 5] = 10.0  # the favourite, forbidden in rows 0 and 2
    guided = GuidedMask([0, 2], _bitmask([{7, 9}, {11}], vocab))
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    for _ in range(5):
        out = sample(logits, params, [0, 0, 0], frozenset({1}), 0, 0, guided=guided)
        assert out.token_ids[0] in (7, 9) and out.token_ids[2] == 11
        assert out.token_ids[1] == sample(logits[1:2], params[1:2], [0], frozenset({1}), 0,
                                          0, row_ids=[1]).token_ids[0]
        params = [SamplingParams(temperature=1.0, seed=p.seed + 3) for p in params]


def test_a_job_left_by_a_step_that_never_sampled_is_dropped():
    """A cut step starts masks but never takes them: the next step must not get them."""
    from tokenweir.guided.decoder import GuidedDecoder
    from tokenweir.guided.masks import GuidedRow

    decoder = GuidedDecoder(_byte_vocabulary, 257)
    try:
        rows = [GuidedRow(3, "r", GuidedDecodingParams(regex="ab"), [])]
        decoder.start_masks(rows)  # the step is cut here: no take_masks
        decoder.start_masks([])  # next step: nothing guided samples
        assert decoder.take_masks() is None
        decoder.start_masks(rows)
        mask = decoder.take_masks()
        allowed = apply_guided_mask(torch.zeros(4, 257), mask)[3].isfinite().nonzero()
        assert allowed.flatten().tolist() == [ord("a")]
        assert decoder.advance("r", ord("a")) is None
        assert decoder.advance("r", ord("x")) is not None  # the grammar refuses it
    finally:
        decoder.close()


def _byte_vocabulary():
    from tokenweir.guided.vocab import Vocabulary
    return Vocabulary([bytes([b]) for b in range(256)] + [b""], frozenset({256}),
                      frozenset({256}), {256: "<eos>"}, lambda text: list(text.encode()))


def test_masks_are_filled_without_importing_llguidance_torch(monkeypatch):
    """llguidance.torch imports torch._dynamo (its @torch.compile decorator: 2-5 s on the
    first guided request of a process): the decoder fills its masks without that module, with
    the bits each matcher computes itself."""
    import sys

    import numpy as np

    from tokenweir.guided.decoder import GuidedDecoder
    from tokenweir.guided.masks import GuidedRow

    monkeypatch.setitem(sys.modules, "llguidance.torch", None)
    with pytest.raises(ImportError):  # probe: an import of it now fails
        import llguidance.torch  # noqa: F401
    vocab = _byte_vocabulary()
    decoder = GuidedDecoder(lambda: vocab, 257)
    try:
        rows = [GuidedRow(0, "a", GuidedDecodingParams(regex="ab|cd"), []),
                GuidedRow(2, "b", GuidedDecodingParams(choice=["xy", "z"]), [ord("x")])]
        decoder.start_masks(rows)
        mask = decoder.take_masks()
        assert mask.errors == {} and mask.rows == [0, 2]
        allowed = apply_guided_mask(torch.zeros(3, 257), mask).isfinite()
        assert allowed[0].nonzero().flatten().tolist() == [ord("a"), ord("c")]
        assert allowed[2].nonzero().flatten().tolist() == [ord("y")]  # "x" replayed first
        for j, req_id in enumerate(("a", "b")):
            own = np.frombuffer(decoder._entries[req_id].matcher.compute_bitmask(), np.int32)
            assert mask.bitmask[j].tolist() == own.tolist()
    finally:
        decoder.close()


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 257])
def test_device_unpack_equals_the_numpy_unpack(vocab):
    """allowed_tokens_on_device (CUDA's path: packed words travel, unpacked by shifts there)
    gives numpy's unpack bit for bit, sign bit (bit 31 of a word) included."""
    from tokenweir.guided.masks import allowed_tokens, allowed_tokens_on_device, bitmask_words
    gen = torch.Generator().manual_seed(vocab)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, bitmask_words(vocab)), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    words[0] = -1  # every bit set
    want = allowed_tokens(words, vocab)
    got = allowed_tokens_on_device(words, vocab, "cuda" if torch.cuda.is_available() else "cpu")
    assert want[0].all() and not want.all(), "probe: full and mixed rows"
    assert torch.equal(got.cpu(), want)
