"""The load cache's weights in the model's dtype (tokenweir/model/load_cache_cast.py): a
bfloat16 load maps them from the entry instead of converting the float32 copy, with the same
bits and the same greedy tokens as a load without any cache; a file for another dtype, another
entry or other code is never used; a damaged one is found, said and rebuilt. Every "hit" is
checked by a probe that counts the casts written in this process and one that finds the
parameter's bytes in the cast file's mapping."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_load_cache import (_flip_byte, _mapped_file_of, _truncate, assert_same_model,  # noqa: E402
                             cache, gguf_path, load, the_entry, uncached)
from tiny_gguf import write_tiny_gguf  # noqa: E402

from tokenweir.model import load_cache_cast, loader  # noqa: E402

__all__ = ["cache", "gguf_path"]  # fixtures shared with test_load_cache


@pytest.fixture
def casts(monkeypatch) -> list[str]:
    """Probe: every cast file written in this process (the work a hit skips)."""
    calls: list[str] = []
    real = load_cache_cast._write
    monkeypatch.setattr(load_cache_cast, "_write",
                        lambda stem, *a: calls.append(os.path.basename(stem)) or real(stem, *a))
    return calls


def _cast_files(root: Path, prefix: str = "cast-") -> list[str]:
    return sorted(p.name for p in the_entry(root).iterdir() if p.name.startswith(prefix))


def _greedy_ids(model, dtype: str) -> list[int]:
    from tokenweir import LLM, SamplingParams
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(model=model.path, dtype=dtype, seed=0)
    llm = LLM.from_engine(LLMEngine(config, loaded=model))
    out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3, 42, 7]}],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _replace_with_copy(source: str, target: str) -> None:
    """A copy of `source` renamed over `target` (a new inode, as the cache's writers do: a
    write into the mapped file itself would change the loaded models' unwritten pages too)."""
    shutil.copyfile(source, target + ".copy")
    os.replace(target + ".copy", target)


def _layer0(model, name: str) -> torch.Tensor:
    return dict(model.model.named_parameters())[f"model.layers.0.{name}.weight"]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_bfloat16_written_then_mapped_identical_bits_and_tokens(gguf_path, cache, casts,
                                                                monkeypatch):
    reference = uncached(gguf_path, monkeypatch, torch.bfloat16)  # no cache at all
    first = load(gguf_path, torch.bfloat16)
    assert (first.load_cache, first.cast_cache) == ("written", "written") and len(casts) == 1
    hit = load(gguf_path, torch.bfloat16)
    assert (hit.load_cache, hit.cast_cache) == ("hit", "hit")
    assert len(casts) == 1  # probe: nothing cast or written again
    cast_file = str(the_entry(cache) / (casts[0] + ".safetensors"))
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):  # probe: the parameter IS the file
        assert _mapped_file_of(_layer0(hit, name)) == cast_file, name
    assert _mapped_file_of(hit.model.model.embed_tokens.weight) == cast_file
    assert_same_model(reference, first)
    assert_same_model(reference, hit)
    with monkeypatch.context() as m:  # the conversion the file replaces
        m.setenv("TOKENWEIR_CAST_CACHE", "0")
        converted = load(gguf_path, torch.bfloat16)
    assert converted.cast_cache == "" and _mapped_file_of(
        _layer0(converted, "mlp.down_proj")) != cast_file
    assert_same_model(converted, hit)
    assert _greedy_ids(hit, "bfloat16") == _greedy_ids(reference, "bfloat16")


def test_float32_writes_and_reads_no_cast_file(gguf_path, cache, casts):
    model = load(gguf_path, torch.float32)
    assert model.load_cache == "written" and model.cast_cache == ""
    assert casts == [] and _cast_files(cache) == []  # probe: nothing cast


def test_another_dtypes_file_is_never_used(gguf_path, cache, casts, monkeypatch, capsys):
    load(gguf_path, torch.bfloat16)
    entry = the_entry(cache)
    bf16 = load_cache_cast.stem_for(str(entry), torch.bfloat16)
    f16 = load_cache_cast.stem_for(str(entry), torch.float16)
    half = load(gguf_path, torch.float16)  # its own file, beside the bfloat16 one
    assert half.cast_cache == "written" and len(casts) == 2
    assert sorted(_cast_files(cache)) == sorted(os.path.basename(s) + x for s in (bf16, f16)
                                                for x in (".json", ".safetensors"))
    assert_same_model(uncached(gguf_path, monkeypatch, torch.float16), half)
    for suffix in (".json", ".safetensors"):  # a bfloat16 file under float16's name
        _replace_with_copy(bf16 + suffix, f16 + suffix)
    capsys.readouterr()
    again = load(gguf_path, torch.float16)
    err = capsys.readouterr().err
    assert again.cast_cache == "rebuilt" and "not what this cache writes" in err, err
    assert len(casts) == 3  # probe: cast again
    assert_same_model(half, again)


def test_a_file_of_another_entry_is_never_used(gguf_path, cache, casts, tmp_path, capsys):
    other = write_tiny_gguf(str(tmp_path / "other.gguf"), seed=1)  # same shapes, other values
    load(other, torch.bfloat16)
    theirs = load_cache_cast.stem_for(str(the_entry_of(cache, other)), torch.bfloat16)
    load(gguf_path, torch.bfloat16)
    ours = load_cache_cast.stem_for(str(the_entry_of(cache, gguf_path)), torch.bfloat16)
    for suffix in (".json", ".safetensors"):
        _replace_with_copy(theirs + suffix, ours + suffix)
    capsys.readouterr()
    again = load(gguf_path, torch.bfloat16)
    err = capsys.readouterr().err
    assert again.cast_cache == "rebuilt" and "not this one" in err, err
    assert len(casts) == 3
    assert_same_model(load(gguf_path, torch.bfloat16), again)


def the_entry_of(root: Path, path: str) -> Path:
    from tokenweir.model import load_cache

    sha = load_cache.source_digest(path, str(root))
    return Path(load_cache.entry_dir(str(root), sha, load_cache.derivation_tag()))


def test_a_changed_cast_module_changes_the_tag(monkeypatch, tmp_path):
    before = load_cache_cast.cast_tag(torch.bfloat16)
    assert before != load_cache_cast.cast_tag(torch.float16)
    copy = tmp_path / "load_cache_cast.py"
    copy.write_text(Path(load_cache_cast.__file__).read_text() + "\n# changed\n")
    monkeypatch.setattr(load_cache_cast, "__file__", str(copy))
    assert load_cache_cast.cast_tag(torch.bfloat16) != before


def _garble_json(path: Path) -> None:
    path.write_text(path.read_text()[:-5])


@pytest.mark.parametrize("suffix, damage, said", [
    (".safetensors", lambda p: _flip_byte(p, 1000), "checksum mismatch"),
    (".safetensors", _truncate, "truncated"),
    (".json", _garble_json, "side file unreadable"),
])
def test_a_damaged_cast_file_is_detected_said_and_rebuilt(gguf_path, cache, casts, monkeypatch,
                                                         capsys, suffix, damage, said):
    load(gguf_path, torch.bfloat16)
    damage(the_entry(cache) / (casts[0] + suffix))
    capsys.readouterr()
    rebuilt = load(gguf_path, torch.bfloat16)
    err = capsys.readouterr().err
    assert rebuilt.cast_cache == "rebuilt" and len(casts) == 2, err  # probe: cast again
    assert "unusable" in err and said in err and "casting the weights again" in err
    assert rebuilt.load_cache == "hit"  # only the cast file was damaged
    assert_same_model(uncached(gguf_path, monkeypatch, torch.bfloat16), rebuilt)
    assert load(gguf_path, torch.bfloat16).cast_cache == "hit"


def test_an_unwritable_entry_converts_with_a_line(gguf_path, cache, casts, monkeypatch, capsys):
    load(gguf_path, torch.float32)  # the entry, without a cast file

    def refuse(*args):
        raise PermissionError("read-only entry")

    monkeypatch.setattr(load_cache_cast, "_write", refuse)
    model = load(gguf_path, torch.bfloat16)
    assert model.cast_cache == "" and "weights not cached (read-only entry)" in \
        capsys.readouterr().err
    assert_same_model(uncached(gguf_path, monkeypatch, torch.bfloat16), model)
    assert json.loads((the_entry(cache) / "manifest.json").read_text())  # the entry is intact
    assert loader.load_model(gguf_path, torch.float32).load_cache == "hit"
