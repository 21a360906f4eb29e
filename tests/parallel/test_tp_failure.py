"""A worker that fails mid-step is reported as an error (TPWorkerError, with the worker's own
message), never as a cut, within a bounded time, and leaves no process behind. It has its own
module: the failure ends the process group, so it cannot share the other tests' executor."""

from __future__ import annotations

import os

import pytest
import torch

from tokenweir.model.loader import load_model
from tokenweir.parallel.executor import TPExecutor, TPWorkerError
from tokenweir.parallel.vote import never_cut
from tp_driver import BLOCK_SIZE, NUM_BLOCKS, START_BOUND_S, TIMEOUT_S, bounded, run_workload
from tp_votes import ExplodingVote

pytestmark = pytest.mark.usefixtures("one_thread")


def test_worker_crash_is_an_error_not_a_cut(tiny_llama_path, monkeypatch):
    here = os.path.dirname(os.path.abspath(__file__))  # workers unpickle ExplodingVote
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        here, os.environ.get("PYTHONPATH")])))
    loaded = load_model(tiny_llama_path, torch.float32, torch.device("cpu"))
    ex = bounded(lambda: TPExecutor(loaded.model, loaded.path, 2, NUM_BLOCKS, BLOCK_SIZE,
                                    torch.float32, torch.device("cpu"), frozenset({2}),
                                    timeout_s=TIMEOUT_S), START_BOUND_S)
    try:
        ex.should_cut = never_cut
        ex.set_worker_should_cut(1, ExplodingVote(layer=1))
        with pytest.raises(TPWorkerError, match="exploded") as info:
            bounded(lambda: run_workload(ex))
        assert [s["status"] for s in ex.last_statuses] == ["error"]  # not "cut"
        assert "exploded" in ex.last_statuses[0]["message"]
        assert ex.closed and ex.workers[0].process.poll() is not None
    finally:
        ex.close()
