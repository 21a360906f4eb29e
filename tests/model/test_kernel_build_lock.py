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
