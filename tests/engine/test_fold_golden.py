"""The fold of one step's outputs (issue 16) changed nothing the user sees: every scenario of
fold_scenarios.py (n=1, n>1, best_of, stop strings, aborts, a failing sample or request through
the fault hooks; final and delta outputs offline, streamed through the output thread and
inline) gives exactly the outputs recorded before the two folds became one
(fold_golden.json, recorded on commit "tests/engine: record the output fold's answers"). Each
fault scenario also probes that its fault fired (fold_scenarios.with_fault)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fold_scenarios as fs  # noqa: E402

GOLDEN = json.loads(fs.GOLDEN.read_text())


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return fs.tiny_path(tmp_path_factory.mktemp("tiny-llama-fold"))


def _rerun(path: str, key: str):
    """The run behind a golden key, e.g. offline/abort_group/delta=True."""
    side, name, flag = key.split("/")
    on = flag.endswith("True")
    if side == "offline":
        if name in fs.ABORTS:
            base, step, ids = fs.ABORTS[name]
            return fs.run_offline(path, base, on, abort=(step, ids))
        if name in fs.FAULTS:
            return fs.with_fault(name, lambda base: fs.run_offline(path, base, on))
        return fs.run_offline(path, name, on)
    if name in fs.FAULTS:
        return fs.with_fault(name, lambda base: fs.run_served(path, base, on))
    return fs.run_served(path, name, on)


def test_golden_covers_every_kind_of_ending():
    """The probe that the recording is not trivial: it holds every finish reason the fold
    handles, stop strings among them, and error outputs with their messages."""
    text = fs.GOLDEN.read_text()
    for finish in ("length", "stop", "abort", "error"):
        assert f'"finish": "{finish}"' in text, finish
    assert '"stop": "e"' in text and "InjectedFault" in text
    assert len(GOLDEN) == 44


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_outputs_are_the_recorded_ones(tiny_path, key):
    assert json.loads(json.dumps(_rerun(tiny_path, key))) == GOLDEN[key]
