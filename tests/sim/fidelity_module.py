"""benchmarks/sim_fidelity.py loaded as a module for the tests that drive its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]

# A small fitted step profile (30 layers, as SmolLM2) for the slo workload's tests.
SLO_TEST_PROFILE = {"format": "tokenweir-step-profile/1",
                    "coefficients": {"const": 0.012, "prefill_tokens": 0.0011,
                                     "decode_rows": 0.0004, "prefill_attention": 2e-8,
                                     "decode_context": 2e-7},
                    "overhead": {"const": 0.0008}, "kv_bytes_per_token": 46080,
                    "block_size": 16, "max_model_len": 1024, "model": "test",
                    "num_layers": 30}


def loaded_sim_fidelity(alias: str) -> Iterator:
    """Yields benchmarks/sim_fidelity.py imported under `alias` (registered in sys.modules
    while in use: its dataclasses look their module up there), removed afterwards."""
    spec = importlib.util.spec_from_file_location(alias, ROOT / "benchmarks" / "sim_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[alias]


def keep_light_run(fid, directory: Path, model) -> Path:
    """Writes into `directory` one kept real run of `light` (seed 1, quick) as the engine traces
    it (steps with their phases, and the run's records), simulated on `model` by `fid` (the
    sim_fidelity module); returns the trace's path."""
    import json

    from tokenweir.timeline.records import write_jsonl

    w = fid.WORKLOADS["light"]
    records, trace = fid.run_sim(w, model, fid.make_specs(w, 1, quick=True))
    for s in trace.steps:
        s["phases"] = {"schedule": 0.0004, "forward": s["duration"] - 0.0004}
    path = fid.real_path(directory, "light", 1)
    write_jsonl(trace, path)
    fid.records_path(path).write_text(json.dumps(
        {"workload": "light", "seed": 1, "quick": True, "records": records}))
    return path
