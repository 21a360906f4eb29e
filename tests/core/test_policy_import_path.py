"""`package.module:Class` policies resolve against the working directory too (as uvicorn
resolves `module:app`), so the README's `tokenweir simulate --scheduling-policy
examples.shortest_prompt_first:...` works from the repository root without PYTHONPATH=. .
Each test first probes that a plain import really cannot see the package."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tokenweir
from tokenweir.core.sched.policies import SchedulingPolicy, VictimPolicy, resolve

POLICY_SOURCE = '''
import sys
from tokenweir.core.sched.policies.builtin import FCFSPolicy


class Mine(FCFSPolicy):
    def __init__(self, config, costs):
        super().__init__(config, costs)
        print("user policy {pkg} constructed", file=sys.stderr)
'''


def _write_package(folder: Path, pkg: str, body: str) -> None:
    (folder / pkg).mkdir()
    (folder / pkg / "__init__.py").write_text("")
    (folder / pkg / "mine.py").write_text(body.format(pkg=pkg))


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory holding a user's package that no sys.path entry reaches."""
    pkg = f"userpol_{os.getpid()}_{tmp_path.name}".replace("-", "_")
    _write_package(tmp_path, pkg, POLICY_SOURCE)
    monkeypatch.chdir(tmp_path)
    reachable = ("", ".", str(tmp_path))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in reachable])
    assert importlib.util.find_spec(pkg) is None  # probe: a plain import cannot see it
    yield pkg
    for name in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
        del sys.modules[name]


def test_a_policy_in_the_working_directory_resolves(elsewhere, capsys):
    cls = resolve(f"{elsewhere}.mine:Mine", {}, SchedulingPolicy)
    assert cls.__name__ == "Mine" and issubclass(cls, SchedulingPolicy)
    assert sys.path[-1] == os.getcwd()  # appended behind every installed package
    assert cls.__module__ == f"{elsewhere}.mine"


def test_an_import_error_inside_the_module_is_reported_not_masked(tmp_path, monkeypatch):
    pkg = f"brokenpol_{os.getpid()}"
    _write_package(tmp_path, pkg, "import no_such_dependency_{pkg}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"no_such_dependency_{pkg}"):
        resolve(f"{pkg}.mine:Mine", {}, VictimPolicy)
    for name in [m for m in sys.modules if m.startswith(pkg)]:
        del sys.modules[name]


def test_a_missing_package_names_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="working directory " + str(tmp_path)):
        resolve("nowhere_to_be_found.mod:Cls", {}, SchedulingPolicy)


def test_the_cli_from_another_working_directory(tmp_path):
    """`python -P` puts neither the script's folder nor the working directory on sys.path
    (as the installed `tokenweir` script), so only the fallback can find the package."""
    pkg = "userpol_cli"
    _write_package(tmp_path, pkg, POLICY_SOURCE)
    env = dict(os.environ, PYTHONPATH=str(Path(tokenweir.__file__).parents[1]))
    probe = subprocess.run([sys.executable, "-P", "-c", f"import {pkg}"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr
    run = subprocess.run(
        [sys.executable, "-P", "-m", "tokenweir", "simulate", "--num-requests", "20",
         "--scheduling-policy", f"{pkg}.mine:Mine", "--json", "out.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"user policy {pkg} constructed" in run.stderr
    assert (tmp_path / "out.json").exists()
