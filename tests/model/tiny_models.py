"""Tiny random-weight transformers models for parity tests (no hub access)."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 384
# head_dim 64 != hidden / heads on purpose (q/o projections are not square).
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
KINDS = ("llama", "mistral", "qwen2", "qwen3", "llama3_rope", "llama_tied")
# Not in KINDS (no parity sweep): a Llama whose matmuls have K = 512 / 1024, past one k block
# of the packed float32 kernel (256 floats on AVX2), for batch-invariance tests.
WIDE = dict(COMMON, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
            num_key_value_heads=2)


def tiny_config(kind: str):
    """A transformers config for one of KINDS."""
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**COMMON)
    if kind == "llama_wide":
        return tf.LlamaConfig(**WIDE)
    if kind == "llama_tied":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=True)
    if kind == "llama3_rope":
        return tf.LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE))
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, rope_theta=20000.0)
    if kind == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
    if kind == "qwen3":
        return tf.Qwen3Config(**COMMON, tie_word_embeddings=False)
    raise ValueError(kind)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough for peaky attention (so masking/ordering bugs show), non-zero
    biases, norm weights around 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(0.15 * noise)


def make_tiny_model(kind: str, path: str, seed: int = 0):
    """Build, randomize and save_pretrained (safetensors) a tiny model; returns the HF model
    (float32, eval, no EOS stopping in generate)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    randomize_(model, seed)
    model.eval()
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_tiny_tokenizer(path: str, chat_template: str) -> None:
    """Train a small byte-level BPE with `tokenizers` and save tokenizer.json +
    tokenizer_config.json (BOS added, ChatML-ish template)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens",
              "paged attention with a block table", "naïve café — 東京 🤗 emoji"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
           "eos_token": "</s>", "pad_token": "<pad>", "chat_template": chat_template,
           "clean_up_tokenization_spaces": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)


# A Hermes-style template that takes `tools` (as Qwen's and Hermes 2 Pro's do): the tool
# definitions go into a system turn, an assistant's tool calls come back as <tool_call> blocks
# and tool results as `tool` turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system\nYou may call these functions. Reply with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools></s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def load_tiny(tmp_path_factory, kind: str, seed: int, dtype):
    """make_tiny_model(kind, seed) saved under a fresh temporary folder, then loaded by
    tokenweir's loader on CPU in `dtype` (a LoadedModel)."""
    import torch

    from tokenweir.model.loader import load_model

    path = tmp_path_factory.mktemp(f"{kind}_{str(dtype).removeprefix('torch.')}")
    make_tiny_model(kind, str(path), seed=seed)
    return load_model(str(path), dtype, torch.device("cpu"))

