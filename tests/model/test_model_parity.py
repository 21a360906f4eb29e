"""Paged forward vs transformers on tiny random-weight models of every supported family.

Tolerance: float32 logits at every sampled position within 1e-4 (max abs) of transformers'
logits for the same full sequence; greedy tokens identical to `generate(do_sample=False)`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_paths import PATHS, force_path
from paged_driver import PagedDriver, run_greedy
from tiny_models import KINDS, LLAMA3_ROPE, VOCAB, make_tiny_model
from tokenweir.model.layers import rope_inv_freq
from tokenweir.model.loader import load_model, unpermute_qk

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
MAX_NEW = 8
PROMPT_LENS = (11, 23, 6, 1)  # block size 4: partial blocks, a 1-token prompt (a "decode")



def _prompts(seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=gen).tolist()
            for i, n in enumerate(PROMPT_LENS)}


@torch.inference_mode()
def _check_against_hf(hf, prompts, out, records) -> None:
    """Every sampled position's logits match transformers; greedy tokens match generate()."""
    for rid, prompt in prompts.items():
        full = torch.tensor([prompt + out[rid]])
        ref = hf(full).logits[0].float()
        for r, length, logits in records:
            if r == rid:
                diff = (logits - ref[length - 1]).abs().max().item()
                assert diff < ATOL, f"{rid} at length {length}: max abs diff {diff}"
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out[rid] == expected[0, len(prompt):].tolist(), rid


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, str(path), seed=KINDS.index(request.param))
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    return request.param, hf, loaded


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["one_chunk", "chunked_interleaved"])
def test_paged_matches_transformers(tiny, mode, path, monkeypatch):
    """On every kernel path (torch; the C++ kernels' AVX2 and AVX-512 variants where this CPU
    runs them), with a probe that the path's kernels really ran."""
    calls = force_path(path, monkeypatch)
    kind, hf, loaded = tiny
    assert loaded.arch.architecture in kind or kind.startswith("llama")
    assert loaded.tokenizer is None  # no tokenizer files saved: weights-only load works
    prompts = _prompts(seed=len(kind))
    driver = PagedDriver(loaded.model, loaded.arch, block_size=4)
    if mode == "one_chunk":
        out, records = run_greedy(driver, prompts, MAX_NEW)
    else:
        out, records = run_greedy(driver, prompts, MAX_NEW, chunk=5, stagger=True)
    assert len(records) == MAX_NEW * len(prompts)
    _check_against_hf(hf, prompts, out, records)
    if path != "torch":
        assert calls["paged_attention"] > 0 and calls["silu_mul"] > 0
        assert calls["add_rmsnorm"] > 0
        assert (calls["rotary_inplace"] > 0) == (kind != "qwen3")  # qk-norm: torch rotary
    else:
        assert not calls, f"the torch path called the C++ kernels: {dict(calls)}"


def test_arch_flags(tiny):
    kind, hf, loaded = tiny
    arch = loaded.arch
    assert arch.qkv_bias == (kind == "qwen2")
    assert arch.qk_norm == (kind == "qwen3")
    assert arch.tie_word_embeddings == (kind == "llama_tied")
    assert (arch.rope_scaling or {}).get("rope_type") == ("llama3" if kind == "llama3_rope"
                                                          else None)
    assert arch.head_dim == 64 and arch.num_heads * arch.head_dim != arch.hidden_size
    assert loaded.max_model_len == 512


# ---- GGUF path on a tiny model ----------------------------------------------------------------
def _permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's conversion permutation (the inverse of what the loader undoes)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _byte_vocab() -> tuple[list[str], list[int], list[str]]:
    from tokenweir.model.tokenizer import byte_to_unicode

    chars = [byte_to_unicode()[b] for b in range(256)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + chars
    tokens += ["Ġt", "he", "Ġthe"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    types += [1] * (VOCAB - len(types))
    return tokens, types, merges


def _write_gguf(hf, path: str, rope_freqs: np.ndarray | None = None) -> None:
    import gguf

    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    tokens, types, merges = _byte_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                        "{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in hf.state_dict().items():
        arr = tensor.float().numpy().copy()
        if name in names:
            w.add_tensor(names[name], arr)
            continue
        _, _, layer, *mod, _ = name.split(".")
        mod = ".".join(mod)
        if mod == "self_attn.q_proj":
            arr = _permute_qk(arr, heads)
        elif mod == "self_attn.k_proj":
            arr = _permute_qk(arr, kv_heads)
        w.add_tensor(f"blk.{layer}.{block[mod]}.weight", arr)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_qk(_permute_qk(w, 3), 3), w)
    assert not np.array_equal(_permute_qk(w, 3), w)


@pytest.mark.parametrize("kind", ["llama", "llama3_rope"])
def test_gguf_tiny_matches_transformers(tmp_path, kind):
    """F32 GGUF written llama.cpp-style (permuted Q/K; llama3 scaling as `rope_freqs`)."""
    hf = make_tiny_model(kind, str(tmp_path / "hf"), seed=7)
    freqs = None
    if kind == "llama3_rope":
        plain = rope_inv_freq(64, LLAMA3_ROPE["rope_theta"], None)
        freqs = (plain / rope_inv_freq(64, LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE)).numpy()
    gguf_path = tmp_path / "tiny.gguf"
    _write_gguf(hf, str(gguf_path), freqs)
    loaded = load_model(str(gguf_path), torch.float32, torch.device("cpu"))
    assert loaded.arch.num_kv_heads == 2 and not loaded.arch.tie_word_embeddings
    assert loaded.name == "tiny.gguf"
    tok = loaded.tokenizer
    ids = [tok.backend.token_to_id(t) for t in ("t", "he", "Ġthe")]
    assert tok.encode("the the") == ids  # merges applied, no BOS (add_bos_token False)
    assert tok.decode(tok.encode("héllo the 東京")) == "héllo the 東京"
    assert tok.encode("<|im_start|>x") == [1, tok.backend.token_to_id("x")]  # control = special
    assert tok.eos_token_ids == {2}
    prompts = _prompts(seed=3)
    driver = PagedDriver(loaded.model, loaded.arch, block_size=4)
    out, records = run_greedy(driver, prompts, MAX_NEW, chunk=5, stagger=True)
    _check_against_hf(hf, prompts, out, records)
