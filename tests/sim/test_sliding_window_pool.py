"""The simulated pool frees a sliding-window model's blocks that slid out (issue 36; vLLM v1
does, core/sliding_window.py): long decodes under a 128-token window hold a few blocks each,
the same run without the window holds every block it wrote. Both runs finish every request."""

from __future__ import annotations

import dataclasses

from tokenweir.sim.build import build_simulation
from tokenweir.sim.hardware import get_hardware, get_shape
from tokenweir.sim.latency import RooflineLatencyModel
from tokenweir.sim.metrics import summarize
from tokenweir.sim.workload import synthetic


def _run(window):
    shape = dataclasses.replace(get_shape("mistral-7b"), sliding_window=window)
    model = RooflineLatencyModel(shape, get_hardware("h100"))
    specs = synthetic(8, 50.0, seed=1, prompt="fixed:256", output="fixed:512")
    sim = build_simulation({"max_num_seqs": 8, "max_num_batched_tokens": 1024,
                            "num_gpu_blocks_override": 600, "max_model_len": 1024}, specs,
                           model_shape="mistral-7b", latency_model=model, check=True)
    result = sim.run()
    return summarize(result), sim


def test_a_window_frees_the_blocks_that_slid_out():
    windowed, sim = _run(128)
    full, _ = _run(None)
    assert windowed["num_finished"] == full["num_finished"] == 8
    assert sim.engine.kv.sliding_window == 128  # the pool was told the model's window
    # probe: with the window, 8 requests of up to 768 tokens hold about 8 x 9 of the 599
    # blocks; without it, up to 8 x 48 (the pool fits them: nobody is preempted)
    assert windowed["preemptions"] == full["preemptions"] == 0
    assert windowed["kv_usage_max"] < full["kv_usage_max"] / 4
