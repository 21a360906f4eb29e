"""`tokenweir` (console script) and `python -m tokenweir` are the same entry point, and the
server and simulator modules no longer carry a parser or a second main()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import tokenweir.bench.serve
import tokenweir.cli
import tokenweir.server.cli
import tokenweir.sim.calibrate
import tokenweir.sim.cli
import tokenweir.sim.studies

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_the_console_script_is_tokenweir_cli_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["tokenweir"].partition(":")
    assert (module, name) == ("tokenweir.cli", "main")
    assert getattr(tokenweir.cli, name) is tokenweir.cli.parser.main
    main_py = (ROOT / "tokenweir" / "__main__.py").read_text()
    assert "from tokenweir.cli import main" in main_py


def test_python_m_tokenweir_runs_a_simulation(tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "tokenweir", "simulate", "--model-shape",
                           "smollm2-135m", "--num-requests", "12", "--prompt-len", "fixed:64",
                           "--output-len", "fixed:4", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokenweir simulate" in proc.stdout
    assert json.loads(out.read_text())["num_finished"] == 12  # probe: it really simulated


def test_python_m_tokenweir_reports_a_bad_flag():
    proc = subprocess.run([sys.executable, "-m", "tokenweir", "simulate", "--no-such-flag"],
                          capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr


def test_no_module_keeps_a_parser_or_a_second_main():
    assert not hasattr(tokenweir.server.cli, "main")
    assert not hasattr(tokenweir.server.cli, "add_subcommands")
    assert not hasattr(tokenweir.sim.cli, "add_subcommands")
    assert not hasattr(tokenweir.sim.studies, "add_study_parser")
    assert not hasattr(tokenweir.sim.calibrate, "add_subcommand")
    assert not hasattr(tokenweir.bench.serve, "add_args")
    for module in (tokenweir.server.cli, tokenweir.sim.cli, tokenweir.sim.studies,
                   tokenweir.sim.calibrate, tokenweir.bench.serve):
        assert "add_argument(" not in Path(module.__file__).read_text(), module.__name__
