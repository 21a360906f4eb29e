"""A kernel build killed mid-way leaves torch's `lock` file behind, and torch waits on it
forever: every later engine start would hang. An old lock is removed; a fresh one (a build
that may still be running) is left alone."""

from __future__ import annotations

import os
import time

import pytest

from tokenweir.model import kernels


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory("tokenweir_lock_probe", verbose=False)


def test_a_stale_lock_is_removed(build_dir):
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    old = time.time() - kernels.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="stale kernel-build lock"):
        kernels._clear_stale_build_lock("tokenweir_lock_probe")
    assert not os.path.exists(lock)


def test_a_fresh_lock_is_kept(build_dir):
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    kernels._clear_stale_build_lock("tokenweir_lock_probe")
    assert os.path.exists(lock)  # the probe: the lock really was there to be kept


def test_no_lock_is_nothing_to_do(build_dir):
    kernels._clear_stale_build_lock("tokenweir_lock_probe")
    assert not os.path.exists(os.path.join(build_dir, "lock"))


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path, monkeypatch):
    """The build directory's name carries the sources' directory: a second checkout (a git
    worktree, another venv) must not share it, or ninja rebuilds the module whenever the other
    checkout loads it (build.ninja names the source path), and a build killed then blocks both."""
    import glob
    import shutil

    copy = tmp_path / "kernels"
    copy.mkdir()
    for path in [kernels._SOURCE, *glob.glob(os.path.join(kernels._DIR, "*.h"))]:
        shutil.copy(path, copy)
    here = kernels._source_hash()
    assert kernels._source_hash() == here  # stable for one checkout
    monkeypatch.setattr(kernels, "_DIR", str(copy))
    monkeypatch.setattr(kernels, "_SOURCE", str(copy / os.path.basename(kernels._SOURCE)))
    there = kernels._source_hash()
    assert there != here
    # the probe that the copy's sources were read: an edit there changes its hash again
    (copy / "cpu_kernels.cpp").write_text((copy / "cpu_kernels.cpp").read_text() + "\n// edit\n")
    assert kernels._source_hash() != there


# ---- a finished build is imported directly (no ninja check), only when it is whole -------
def test_finished_build_marker_matches_only_the_library_it_was_written_for(tmp_path):
    name, build = "tokenweir_marker_probe", str(tmp_path)
    library = tmp_path / f"{name}.so"
    library.write_bytes(b"\x7fELF" + b"x" * 100)
    assert not kernels._finished_build(build, name)  # no marker: `load` decides
    kernels._mark_finished(build, name)
    assert kernels._finished_build(build, name)
    library.write_bytes(b"\x7fELF" + b"x" * 50)  # relinked or cut short since: not trusted
    assert not kernels._finished_build(build, name)


def test_a_start_imports_the_remembered_build_without_cpp_extension(tmp_path, monkeypatch):
    """A remembered directory holding no finished build falls back to torch's build directory
    (found through torch.utils.cpp_extension, as `load` would) and is remembered anew: here, in
    this process (`_build` itself, which `_module` calls once). Then, in a fresh interpreter,
    the module comes straight from the remembered directory without importing cpp_extension."""
    import subprocess
    import sys

    if not kernels.kernels_enabled() or kernels.fused_ops() is None:
        pytest.skip("no C++ kernels on this machine")
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TOKENWEIR_CACHE_DIR", str(tmp_path))
    name = f"tokenweir_cpu_kernels_{kernels._source_hash()}"
    remembered = tmp_path / "kernels" / f"{name}.dir"
    remembered.parent.mkdir()
    remembered.write_text(str(tmp_path / "nothing-built-here"))
    assert kernels._build() is not None
    assert remembered.read_text() == _get_build_directory(name, verbose=False)  # anew
    code = ("import sys, torch\n"
            "from tokenweir.model import kernels\n"
            "m = kernels._module()\n"
            "print(m is not None, 'torch.utils.cpp_extension' in sys.modules)\n")
    env = {**os.environ, "TOKENWEIR_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(kernels._DIR)))}
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=600)
    assert fresh.stdout.split() == ["True", "False"], fresh.stderr  # straight import
