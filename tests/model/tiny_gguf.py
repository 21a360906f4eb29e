"""A tiny llama GGUF written with gguf-py: random weights (Q8_0 embedding, Q4_1 and F32
projections, F32 norms, tied LM head) and a byte-level BPE vocabulary trained on the spot, in
the metadata as llama.cpp writes it. For tests of the GGUF loader and its cache that must not
pay for SmolLM2 (98 MB) on every run."""

from __future__ import annotations

import json

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 256, 2, 2, 1, 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_bpe():
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens",
              "a weir meters a river of tokens", "naïve café — 東京 🤗"] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok


def _vocabulary() -> tuple[list[str], list[str], list[int]]:
    tok = _tiny_bpe()
    model = json.loads(tok.to_str())["model"]
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, merges, types


def write_tiny_gguf(path: str, seed: int = 0) -> str:
    """Write the tiny GGUF to `path` (weights drawn from `seed`); returns `path`."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    tokens, merges, types = _vocabulary()
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, ...], kind=Q.F32, scale: float = 0.1) -> None:
        data = (1.0 + scale * rng.standard_normal(shape) if "norm" in name
                else scale * rng.standard_normal(shape)).astype(np.float32)
        if kind == Q.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)

    add("token_embd.weight", (len(tokens), HIDDEN), Q.Q8_0, scale=1.0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_1)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), Q.Q4_1)
    add("output_norm.weight", (HIDDEN,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
