"""The GGUF load cache (tokenweir/model/load_cache.py): what a load reads back is bit-identical
to what the GGUF gives, an entry of other code or of another file is never read, and a damaged
entry is found, said, and rebuilt. Every "hit" / "not used" claim is checked by a probe that
counts how often the GGUF itself was parsed."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gguf import LAYERS, write_tiny_gguf  # noqa: E402

from tokenweir.model import kernels, layers, llama, load_cache, loader  # noqa: E402

TEXTS = ["hello world, hello tokens", "naïve café — 東京 🤗", "<|im_start|>user\nhi<|im_end|>",
         " the  lazy\tdog\n\n", "zzzz qqq 12345"]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), seed=0)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TOKENWEIR_CACHE_DIR", str(root))
    monkeypatch.delenv("TOKENWEIR_LOAD_CACHE", raising=False)
    return root


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Probe: every time the GGUF itself is parsed (the work a cache hit skips)."""
    calls: list[str] = []
    real = loader.read_gguf_source

    def counted(path: str):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(loader, "read_gguf_source", counted)
    return calls


def load(path: str, dtype=torch.float32):
    return loader.load_model(path, dtype, torch.device("cpu"))


def uncached(path: str, monkeypatch, dtype=torch.float32):
    with monkeypatch.context() as m:
        m.setenv("TOKENWEIR_LOAD_CACHE", "0")
        model = load(path, dtype)
    assert model.load_cache == "disabled"
    return model


def assert_same_model(a, b) -> None:
    assert a.arch == b.arch
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    ta, tb = a.tokenizer, b.tokenizer
    assert [ta.encode(t) for t in TEXTS] == [tb.encode(t) for t in TEXTS]
    ids = list(range(ta.vocab_size))
    assert ta.convert_ids_to_tokens(ids) == tb.convert_ids_to_tokens(ids)
    assert ta.decode(ids, skip_special_tokens=False) == tb.decode(ids, skip_special_tokens=False)
    assert (ta.eos_token_ids, ta.bos_token_id, ta.special_tokens) == \
        (tb.eos_token_ids, tb.bos_token_id, tb.special_tokens)
    chat = [{"role": "user", "content": "hi"}]
    assert ta.apply_chat_template(chat) == tb.apply_chat_template(chat)


def the_entry(root: Path) -> Path:
    entries = [p for p in (root / "gguf").iterdir() if ".tmp-" not in p.name]
    assert len(entries) == 1, entries
    return entries[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_then_hit_and_identical(gguf_path, cache, parses, monkeypatch, dtype):
    reference = uncached(gguf_path, monkeypatch, dtype)
    assert len(parses) == 1
    first = load(gguf_path, dtype)
    assert first.load_cache == "written" and len(parses) == 2
    second = load(gguf_path, dtype)
    assert second.load_cache == "hit" and len(parses) == 2  # probe: the GGUF was not read
    assert_same_model(reference, first)
    assert_same_model(reference, second)


def _mapped_file_of(tensor: torch.Tensor) -> str:
    """The file whose mapping holds `tensor`'s first byte ('' for anonymous memory)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else ""
    return ""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_a_hit_maps_whole_float32_weights_without_a_copy(gguf_path, cache, monkeypatch):
    reference = uncached(gguf_path, monkeypatch)
    load(gguf_path)  # writes the entry
    hit = load(gguf_path)
    weights_file = str(the_entry(cache) / "weights.safetensors")
    params = dict(hit.model.named_parameters())
    o_proj = params["model.layers.0.self_attn.o_proj.weight"]
    for name in ("self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        weight = params[f"model.layers.0.{name}.weight"]  # the fused ones too: stored fused
        assert _mapped_file_of(weight) == weights_file, name  # probe: the parameter IS the entry
    with monkeypatch.context() as m:  # probe of the probe: a copied parameter is not the file
        m.setattr(llama, "_adoptable", lambda tensor, dest: False)
        copied = load(gguf_path)
    assert _mapped_file_of(copied.model.model.layers[0].self_attn.o_proj.weight) != weights_file
    with torch.no_grad():  # the mapping is private: a write to the model stays in the model
        o_proj.add_(1.0)
    again = load(gguf_path)
    assert again.load_cache == "hit"  # the entry's checksum still holds
    assert_same_model(reference, again)


def test_entry_is_a_plain_safetensors_file(gguf_path, cache, monkeypatch):
    from safetensors import safe_open

    load(gguf_path)
    unfused = list(loader._open_gguf(gguf_path)[1])
    reference = dict(llama.fuse_checkpoint(unfused, torch.cat))
    assert "model.layers.0.self_attn.qkv_proj.weight" in reference  # probe: fused ones there
    assert "model.layers.1.mlp.gate_up_proj.weight" in reference
    assert len(reference) == len(unfused) - 3 * LAYERS  # per layer: 3 parts -> 1, 2 -> 1
    with safe_open(str(the_entry(cache) / "weights.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(reference)
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), reference[name]), name


def test_an_entry_of_other_code_is_never_read(gguf_path, cache, parses, monkeypatch):
    load(gguf_path)
    old = the_entry(cache)
    monkeypatch.setattr(load_cache, "CACHE_FORMAT", load_cache.CACHE_FORMAT + 1)
    again = load(gguf_path)
    assert again.load_cache == "written" and len(parses) == 2  # probe: parsed anew
    assert the_entry(cache) != old and not old.exists()  # the stale entry was removed
    assert_same_model(uncached(gguf_path, monkeypatch), again)


def test_a_changed_deriving_module_changes_the_key(monkeypatch, tmp_path):
    before = load_cache.derivation_tag()
    here = Path(load_cache.__file__).parent
    fake = tmp_path / "model"
    shutil.copytree(here, fake, ignore=shutil.ignore_patterns("kernels", "__pycache__"))
    (fake / "tokenizer.py").write_text((fake / "tokenizer.py").read_text() + "\n# edited\n")
    monkeypatch.setattr(load_cache, "__file__", str(fake / "load_cache.py"))
    assert load_cache.derivation_tag() != before


def test_another_file_at_the_same_path_never_hits(gguf_path, cache, parses, tmp_path, monkeypatch):
    path = str(tmp_path / "model.gguf")
    shutil.copy(gguf_path, path)
    first = load(path)
    other = write_tiny_gguf(str(tmp_path / "other.gguf"), seed=1)
    assert os.path.getsize(other) == os.path.getsize(path)  # same size: only content differs
    stat = os.stat(path)
    with open(other, "rb") as src, open(path, "r+b") as dst:  # rewritten in place ...
        dst.write(src.read())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... with the old mtime back
    second = load(path)
    assert second.load_cache == "written" and len(parses) == 2
    reference = uncached(path, monkeypatch)
    assert_same_model(reference, second)
    embed = "model.embed_tokens.weight"
    assert not torch.equal(first.model.state_dict()[embed], second.model.state_dict()[embed])


def _flip_byte(path: Path, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


def _truncate(path: Path) -> None:
    os.truncate(path, os.path.getsize(path) - 100)


def _garble_manifest(path: Path) -> None:
    path.write_text(path.read_text()[:-20])


def _wrong_source_in_manifest(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["source_sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("file, damage, said", [
    ("weights.safetensors", lambda p: _flip_byte(p, 1000), "checksum mismatch"),
    ("weights.safetensors", _truncate, "truncated"),
    ("tokenizer.json", lambda p: _flip_byte(p, 50), "tokenizer.json checksum mismatch"),
    ("manifest.json", _garble_manifest, "manifest unreadable"),
    ("manifest.json", _wrong_source_in_manifest, "source_sha256 does not match"),
])
def test_a_damaged_entry_is_detected_said_and_rebuilt(gguf_path, cache, parses, monkeypatch,
                                                      capsys, file, damage, said):
    load(gguf_path)
    damage(the_entry(cache) / file)
    capsys.readouterr()
    rebuilt = load(gguf_path)
    err = capsys.readouterr().err
    assert rebuilt.load_cache == "rebuilt" and len(parses) == 2, err  # probe: parsed again
    assert "unusable" in err and said in err and "rebuilding" in err
    assert_same_model(uncached(gguf_path, monkeypatch), rebuilt)
    assert load(gguf_path).load_cache == "hit"


def test_disabled_writes_nothing(gguf_path, cache, monkeypatch):
    monkeypatch.setenv("TOKENWEIR_LOAD_CACHE", "0")
    assert load(gguf_path).load_cache == "disabled"
    assert not cache.exists()


def test_an_unusable_cache_directory_falls_back_with_a_line(gguf_path, tmp_path, monkeypatch,
                                                            capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TOKENWEIR_CACHE_DIR", str(blocker))
    monkeypatch.delenv("TOKENWEIR_LOAD_CACHE", raising=False)
    model = load(gguf_path)
    assert model.load_cache == "disabled"
    assert "load cache not used" in capsys.readouterr().err
    assert_same_model(uncached(gguf_path, monkeypatch), model)


def test_the_source_digest_is_remembered_by_stat(gguf_path, cache, monkeypatch):
    calls = []
    real = load_cache.file_sha256
    monkeypatch.setattr(load_cache, "file_sha256", lambda p: calls.append(p) or real(p))
    first = load_cache.source_digest(gguf_path, str(cache))
    assert load_cache.source_digest(gguf_path, str(cache)) == first and len(calls) == 1
    os.utime(gguf_path)  # a touch: rehashed (same content, same digest)
    assert load_cache.source_digest(gguf_path, str(cache)) == first and len(calls) == 2


def test_words_checksum_sees_any_single_flipped_bit():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=1003, dtype=np.uint8)  # a tail that is not a whole word
    base = load_cache.words_checksum(raw)
    for index in rng.choice(raw.size, size=64, replace=False).tolist() + [raw.size - 1]:
        for bit in (0, 7):
            flipped = raw.copy()
            flipped[index] ^= 1 << bit
            assert load_cache.words_checksum(flipped) != base, (index, bit)
    assert load_cache.words_checksum(raw[:-1]) != base


# ---- packed float32 weights in the entry (tokenweir/model/packed_cache.py) ------------------
needs_packed_kernel = pytest.mark.skipif(
    kernels.packed_linear_kernel() is None,
    reason="needs the C++ packed-linear kernel (not built here, or TOKENWEIR_CPU_KERNELS=0)")


@pytest.fixture
def packs(monkeypatch) -> list[tuple[int, ...]]:
    """Probe: every weight packed in this process (the work a packed-cache hit skips)."""
    calls: list[tuple[int, ...]] = []
    real = kernels.pack_linear_weight
    monkeypatch.setattr(kernels, "pack_linear_weight",
                        lambda w, panel: calls.append(tuple(w.shape)) or real(w, panel))
    return calls


def _packed_files(root: Path) -> list[Path]:
    return sorted(p for p in the_entry(root).iterdir() if p.name.startswith("packed-"))


def _greedy_ids(model) -> list[int]:
    """Greedy token ids of the loaded model through the engine (the packed kernel serves
    its few-row matmuls: the decode steps and the LM head)."""
    from tokenweir import LLM, SamplingParams
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(model=model.path, dtype="float32", seed=0)
    llm = LLM.from_engine(LLMEngine(config, loaded=model))
    out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3, 42, 7]}],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


_PACK_NOW = kernels.pack_linear_weight  # not the counting one of `packs`


def _assert_packed_as_now(model) -> None:
    """Every installed packed copy equals packing the model's weight now (no stale panel)."""
    from tokenweir.model import packed_cache

    panel = kernels.packed_linear_kernel().panel
    for name, owner, weight in packed_cache.targets(model.model):
        key, packed = owner.__dict__[layers._PACKED_ATTR]
        assert torch.equal(packed, _PACK_NOW(weight, panel)), name
        assert key == layers._packed_key(weight, panel), name  # what packed_weight checks


@needs_packed_kernel
def test_packed_weights_written_then_mapped_and_identical(gguf_path, cache, packs, monkeypatch):
    reference = uncached(gguf_path, monkeypatch)
    assert reference.packed_cache == "" and packs == []  # no entry: packed lazily, as before
    first = load(gguf_path)
    assert first.packed_cache == "written" and len(packs) > 0
    written = len(packs)
    second = load(gguf_path)
    assert second.packed_cache == "hit" and len(packs) == written  # probe: nothing packed
    files = _packed_files(cache)
    assert [p.suffix for p in files] == [".json", ".safetensors"]
    _, owner, _ = packed_cache_targets(second)[0]
    assert _mapped_file_of(owner.__dict__[layers._PACKED_ATTR][1]) == str(files[1])  # probe
    _assert_packed_as_now(second)
    ids = _greedy_ids(second)
    assert len(packs) == written  # probe: the engine's steps used the mapped panels
    assert ids == _greedy_ids(reference)


def packed_cache_targets(model):
    from tokenweir.model import packed_cache

    return packed_cache.targets(model.model)


@needs_packed_kernel
def test_a_write_to_a_weight_after_a_packed_hit_repacks_it(gguf_path, cache, monkeypatch):
    load(gguf_path)
    hit = load(gguf_path)
    assert hit.packed_cache == "hit"
    o_proj = hit.model.model.layers[0].self_attn.o_proj
    with torch.no_grad():
        o_proj.weight.add_(0.5)
    x = torch.randn(3, o_proj.weight.shape[1])
    assert torch.allclose(o_proj(x), x @ o_proj.weight.T, atol=1e-5)  # not the stale panels


@needs_packed_kernel
def test_packed_weights_of_other_code_are_never_read(gguf_path, cache, packs, monkeypatch):
    from tokenweir.model import packed_cache

    load(gguf_path)
    old = _packed_files(cache)
    real = packed_cache.packing_tag
    monkeypatch.setattr(packed_cache, "packing_tag", lambda isa, panel: "f" + real(isa, panel))
    packs.clear()
    again = load(gguf_path)
    assert again.packed_cache == "written" and len(packs) > 0  # probe: packed anew
    assert not any(p.exists() for p in old) and len(_packed_files(cache)) == 2  # old removed
    _assert_packed_as_now(again)


def test_a_changed_packing_module_changes_the_packed_tag(monkeypatch, tmp_path):
    from tokenweir.model import packed_cache

    before = packed_cache.packing_tag("avx2", 16)
    assert packed_cache.packing_tag("avx512", 16) != before
    assert packed_cache.packing_tag("avx2", 32) != before
    here = Path(packed_cache.__file__).parent
    fake = tmp_path / "model"
    shutil.copytree(here, fake, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (fake / "llama.py").write_text((fake / "llama.py").read_text() + "\n# edited\n")
    monkeypatch.setattr(packed_cache, "__file__", str(fake / "packed_cache.py"))
    assert packed_cache.packing_tag("avx2", 16) != before


def _garble_json(path: Path) -> None:
    path.write_text(path.read_text()[:-5])


@needs_packed_kernel
@pytest.mark.parametrize("suffix, damage, said", [
    (".safetensors", lambda p: _flip_byte(p, 1000), "checksum mismatch"),
    (".safetensors", _truncate, "truncated"),
    (".json", _garble_json, "side file unreadable"),
])
def test_damaged_packed_weights_are_detected_said_and_rebuilt(gguf_path, cache, packs,
                                                              monkeypatch, capsys, suffix,
                                                              damage, said):
    load(gguf_path)
    written = len(packs)
    damage(next(p for p in _packed_files(cache) if p.suffix == suffix))
    capsys.readouterr()
    rebuilt = load(gguf_path)
    err = capsys.readouterr().err
    assert rebuilt.packed_cache == "rebuilt" and len(packs) == 2 * written, err  # packed again
    assert "unusable" in err and said in err and "packing them again" in err
    assert rebuilt.load_cache == "hit"  # only the packed file was damaged
    _assert_packed_as_now(rebuilt)
    assert load(gguf_path).packed_cache == "hit"


@needs_packed_kernel
@pytest.mark.parametrize("how", ["bfloat16", "pack_linear_off", "not_asked"])
def test_packed_weights_only_where_they_apply(gguf_path, cache, packs, monkeypatch, how):
    if how == "pack_linear_off":
        monkeypatch.setattr(layers, "PACK_LINEAR", False)
    model = loader.load_model(gguf_path, torch.bfloat16 if how == "bfloat16" else torch.float32,
                              torch.device("cpu"), pack=how != "not_asked")
    assert model.load_cache == "written" and model.packed_cache == ""
    assert _packed_files(cache) == [] and packs == []  # probe: nothing packed or written


def test_fuse_checkpoint_fuses_complete_groups_and_passes_the_rest():
    from tokenweir.model.llama import fuse_checkpoint

    items = [("model.embed_tokens.weight", "E"),
             ("model.layers.0.self_attn.k_proj.weight", "k0"),
             ("model.layers.0.self_attn.q_proj.weight", "q0"),
             ("model.layers.0.mlp.up_proj.weight", "u0"),
             ("model.layers.0.self_attn.v_proj.weight", "v0"),
             ("model.layers.0.mlp.gate_proj.weight", "g0"),
             ("model.layers.1.self_attn.q_proj.bias", "qb1")]  # its k/v biases never come
    assert list(fuse_checkpoint(items, "+".join)) == [
        ("model.embed_tokens.weight", "E"),
        ("model.layers.0.self_attn.qkv_proj.weight", "q0+k0+v0"),  # shard order, not arrival
        ("model.layers.0.mlp.gate_up_proj.weight", "g0+u0"),
        ("model.layers.1.self_attn.q_proj.bias", "qb1")]  # incomplete: unfused, at the end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_weights_takes_fused_and_unfused_alike(gguf_path, monkeypatch, dtype):
    unfused = list(loader._open_gguf(gguf_path)[1])
    arch = loader._open_gguf(gguf_path)[0]
    a = loader._build(arch, iter(unfused), dtype, torch.device("cpu"))
    b = loader._build(arch, llama.fuse_checkpoint(unfused, torch.cat), dtype, torch.device("cpu"))
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[n], sb[n]) for n in sa)
    partial = [(n, t) for n, t in llama.fuse_checkpoint(unfused, torch.cat)
               if n != "model.layers.1.mlp.gate_up_proj.weight"]
    with pytest.raises(ValueError, match="gate_up_proj"):  # probe: a missing whole is missed
        loader._build(arch, iter(partial), dtype, torch.device("cpu"))


@needs_packed_kernel
def test_no_cpu_warm_up_when_the_packed_weights_are_mapped(gguf_path, cache, packs,
                                                           monkeypatch):
    """TOKENWEIR_WARMUP unset: an engine whose packed weights come from the load cache runs
    no warm-up (it bought nothing there: llm_engine.py, WARM_UP_CPU_TOKENS), one that packs
    them lazily still does, and TOKENWEIR_WARMUP=1 forces it; the same greedy tokens."""
    from tokenweir.runner.model_runner import ModelRunner

    calls, warm_up = [], ModelRunner.warm_up
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, *a: calls.append(a)
                        or warm_up(self, *a))
    monkeypatch.delenv("TOKENWEIR_WARMUP", raising=False)
    reference = uncached(gguf_path, monkeypatch)
    assert reference.packed_cache == ""
    lazy_ids = _greedy_ids(reference)
    assert len(calls) == 1  # probe: weights packed lazily, so it warms up
    load(gguf_path)  # writes the entry
    mapped = load(gguf_path)
    assert mapped.packed_cache == "hit"
    assert _greedy_ids(mapped) == lazy_ids and len(calls) == 1  # no warm-up
    monkeypatch.setenv("TOKENWEIR_WARMUP", "1")
    assert _greedy_ids(mapped) == lazy_ids and len(calls) == 2  # forced
