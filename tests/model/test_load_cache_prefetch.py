"""The load cache checked on a thread while torch imports (tokenweir/model/prefetch.py): a
warm load takes the thread's checksums instead of computing them (probe: where each checksum
ran) and loads the same model; a file written after the thread checked it is never trusted on
that result: the load checks it again and finds the damage; with TOKENWEIR_PREFETCH=0 nothing
starts."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_load_cache import (_flip_byte, assert_same_model, cache, gguf_path, load,  # noqa: E402,F401
                             parses, the_entry, uncached)

from tokenweir.model import load_cache, prefetch  # noqa: E402


@pytest.fixture
def checksums(monkeypatch) -> list[str]:
    """Probe: the thread that computed each words checksum."""
    names: list[str] = []
    real = load_cache.words_checksum

    def counted(raw):
        names.append(threading.current_thread().name)
        return real(raw)

    monkeypatch.setattr(load_cache, "words_checksum", counted)
    return names


def _prefetched(path: str) -> None:
    thread = prefetch.start(path, "float32", "cpu")  # the dtype `load` builds
    assert thread is not None
    thread.join()


def test_a_warm_load_takes_the_threads_checksums(gguf_path, cache, checksums, monkeypatch):
    load(gguf_path)  # writes the entry
    checksums.clear()
    _prefetched(gguf_path)
    assert checksums and set(checksums) == {"tokenweir-prefetch"}  # probe: the thread checked
    count = len(checksums)
    warm = load(gguf_path)
    assert warm.load_cache == "hit"
    assert len(checksums) == count  # the load computed none of its own
    assert_same_model(uncached(gguf_path, monkeypatch), warm)


def test_a_file_written_after_the_check_is_checked_again(gguf_path, cache, parses, checksums,
                                                         capsys, monkeypatch):
    load(gguf_path)
    _prefetched(gguf_path)
    _flip_byte(the_entry(cache) / "weights.safetensors", 1000)  # after the thread's check
    checksums.clear()
    capsys.readouterr()
    rebuilt = load(gguf_path)
    assert "MainThread" in checksums  # the stale result was not used
    assert rebuilt.load_cache == "rebuilt" and "checksum mismatch" in capsys.readouterr().err
    assert_same_model(uncached(gguf_path, monkeypatch), rebuilt)


def test_off_switch_and_non_gguf(gguf_path, cache, monkeypatch, tmp_path):
    load(gguf_path)
    monkeypatch.setenv("TOKENWEIR_PREFETCH", "0")
    assert prefetch.start(gguf_path) is None
    monkeypatch.setenv("TOKENWEIR_PREFETCH", "1")
    assert prefetch.start(str(tmp_path)) is None  # an HF directory: nothing to check
    thread = prefetch.start(gguf_path)
    assert thread is not None  # probe: the same call starts when on
    thread.join()
    assert load_cache.prechecked_words(str(the_entry(cache) / "weights.safetensors")) is not None


def test_the_prefetch_imports_no_torch():
    import subprocess

    code = ("import sys; from tokenweir.model import prefetch, load_cache; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True)
    assert out.stdout.strip() == "False"
    assert torch.__name__ == "torch"  # (this process has it; the child did not)


@pytest.mark.parametrize("dtype, device, read", [
    ("float32", "cpu", {"packed-a"}), ("bfloat16", "cpu", {"cast-bf16-a"}),
    ("float16", "cpu", {"cast-f16-a"}), ("bfloat16", "cuda", set())])
def test_only_the_files_the_dtype_reads_are_checked(gguf_path, cache, dtype, device, read):
    """A bfloat16 start reads no packed float32 panels and a float32 one no cast copy: the
    thread checks (and the start waits for) only the weights and its own dtype's file."""
    load(gguf_path)
    entry = the_entry(cache)
    derived = ("packed-a", "cast-bf16-a", "cast-f16-a")
    for stem in derived:
        (entry / f"{stem}.safetensors").write_bytes(b"\0" * 4096)
    thread = prefetch.start(gguf_path, dtype, device)
    assert thread is not None
    thread.join()
    checked = {stem for stem in derived
               if load_cache.prechecked_words(str(entry / f"{stem}.safetensors")) is not None}
    assert checked == read
    assert load_cache.prechecked_words(str(entry / "weights.safetensors")) is not None


def test_the_auto_guess_agrees_with_the_loaders_choice():
    """prefetch's torch-free "auto" names the files of the dtype model/loader.py picks here."""
    from tokenweir.model.loader import preferred_dtype

    chosen = str(preferred_dtype("cpu")).removeprefix("torch.")
    assert prefetch.derived_files_for("auto", "cpu") == prefetch.derived_files_for(chosen, "cpu")
    assert prefetch.derived_files_for(chosen, "cpu")  # probe: a CPU dtype reads a derived file
