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
from tiny_gguf import write_tiny_gguf  # noqa: E402

from tokenweir.model import load_cache, loader  # noqa: E402

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
    assert _mapped_file_of(o_proj) == weights_file  # probe: the parameter IS the mapped entry
    assert _mapped_file_of(params["model.layers.0.self_attn.qkv_proj.weight"]) != weights_file
    with torch.no_grad():  # the mapping is private: a write to the model stays in the model
        o_proj.add_(1.0)
    again = load(gguf_path)
    assert again.load_cache == "hit"  # the entry's checksum still holds
    assert_same_model(reference, again)


def test_entry_is_a_plain_safetensors_file(gguf_path, cache, monkeypatch):
    from safetensors import safe_open

    load(gguf_path)
    reference = dict(loader._open_gguf(gguf_path)[1])
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
