"""benchmarks/startup.py on `tokenweir serve` (the tiny stand-in model): the engine core runs in
its own forked process, and its phases (model read, weights, warm-up) and dtype still reach the
row (before, serve's phase columns all printed "-"). Probe that the phases are the core's: the
API process never loads the model, so its own file has no `weights`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_serve_model  # noqa: E402  (tests/tiny_serve_model.py)


def test_serve_row_holds_the_engine_core_processes_phases(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import startup

    api_rows: list[dict] = []
    real_read = startup._read_json
    monkeypatch.setattr(startup, "_read_json", lambda path: api_rows.append(
        real_read(path)) or api_rows[-1] if path.endswith(".engine") else real_read(path))
    row = startup.run_once("serve", tiny_serve_model.path(), str(tmp_path), [],
                           ["TOKENWEIR_WARMUP=1"], [],
                           serve_flags=tiny_serve_model.SERVE_ARGS, dtype="float32")
    assert {"import", "model read", "weights", "warm-up", "ready"} <= set(row), row
    assert row["dtype"] == "float32"
    assert 0 < row["weights"] < row["ready"] and 0 < row["import"] < row["ready"]
    assert len(api_rows) == 1 and "weights" not in api_rows[0]  # probe: the core's, not the API's
