"""A stand-in for SmolLM2-135M in the tests that exercise serving mechanics (HTTP, streaming,
aborts, overload, routing, dead replicas), not the model's outputs: a random-weight Llama of
two 64-wide layers that carries SmolLM2-135M's own tokenizer, special tokens, chat template,
vocabulary (49,152) and context length, saved as a Hugging Face directory.

Contract:
- `path()` is the directory (built once per process, removed at exit). Serve it with
  `SERVE_ARGS` so that it answers under SmolLM2's name (`--served-model-name smollm2-135m`).
- Its tokenizer encodes, decodes and renders chats exactly as SmolLM2's
  (tests/server/test_tiny_serve_model.py checks it).
- It never chooses an end-of-sequence token on its own: the output rows of SmolLM2's EOS ids
  are zero (logit 0 against ~49k random logits), so `finish_reason` is "length" unless a stop
  rule fires, as the tests of mechanics expect.
- A step costs ~1/100 of SmolLM2's: a test whose request must stay in flight for a while asks
  for more tokens than it did on the real model.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading

MODEL = "smollm2-135m"
SERVE_ARGS = ("--served-model-name", MODEL)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
SEED = 1234
_LOCK = threading.Lock()
_PATH: list[str] = []


def path() -> str:
    """The tiny model's directory, built on first call in this process."""
    with _LOCK:
        if not _PATH:
            folder = tempfile.mkdtemp(prefix="tokenweir-tiny-smollm2-")
            atexit.register(shutil.rmtree, folder, True)
            build(folder)
            _PATH.append(folder)
        return _PATH[0]


def _smollm2_arch_and_tokenizer():
    from tokenweir.model.loader import open_gguf_cached
    from tokenweir.model.paths import resolve_model_path

    arch, _weights, tokenizer, _status, _dir = open_gguf_cached(resolve_model_path(MODEL))
    return arch, tokenizer


def build(folder: str) -> None:
    """Write config.json, model.safetensors and SmolLM2's tokenizer files into `folder`."""
    arch, tokenizer = _smollm2_arch_and_tokenizer()
    _write_tokenizer(folder, tokenizer)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": arch.vocab_size, "rms_norm_eps": arch.rms_norm_eps,
              "rope_theta": arch.rope_theta, "tie_word_embeddings": False,
              "max_position_embeddings": arch.max_position_embeddings,
              "bos_token_id": arch.bos_token_id, "eos_token_id": list(arch.eos_token_ids),
              "hidden_act": "silu", **SHAPE}
    _write_json(folder, "config.json", config)
    eos = sorted(set(arch.eos_token_ids) | set(tokenizer.eos_token_ids))
    _write_weights(folder, config, eos)


def _write_json(folder: str, name: str, value) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(value, f)


def _write_tokenizer(folder: str, tokenizer) -> None:
    """tokenizer.json (the Rust backend as is) and the fields `Tokenizer.from_hf_dir` reads."""
    backend_json, fields = tokenizer.to_cache()
    if fields["bos_fix"] is not None:
        raise ValueError("SmolLM2's tokenizer now corrects its BOS: write add_bos_token too")
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(backend_json)
    specials = fields["special_tokens"]
    _write_json(folder, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": fields["chat_template"],
        "clean_up_tokenization_spaces": False,
        **{k: specials.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}})
    _write_json(folder, "generation_config.json", {"eos_token_id": fields["eos_token_ids"]})


def _write_weights(folder: str, config: dict, eos_ids: list[int]) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=gen)).contiguous()

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
               "model.norm.weight": 1.0 + rand(hidden, scale=0.2)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(q_out, hidden),
            p + "self_attn.k_proj.weight": rand(kv_out, hidden),
            p + "self_attn.v_proj.weight": rand(kv_out, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_out),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
            p + "post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.2)})
    lm_head = rand(vocab, hidden, scale=1.0)
    lm_head[eos_ids] = 0.0  # logit 0 among ~49k random ones: EOS is never chosen
    tensors["lm_head.weight"] = lm_head
    save_file(tensors, os.path.join(folder, "model.safetensors"))
