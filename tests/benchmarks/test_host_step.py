"""benchmarks/host_step.py end to end on its tiny model (a few steps): each batch size's line
with wall, forward and host time, and the cProfile table; the forward clock really timed the
model (probe: forward > 0 and below the wall)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_step_prints_wall_forward_and_host(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_step
    assert host_step.main(["--batches", "1,4", "--steps", "2", "--profile", "--top", "5"]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"(\d+) decodes per step: wall +([\d.]+) ms, forward +([\d.]+) ms, "
                       r"host +([\d.]+) us per request", out)
    assert [int(n) for n, *_ in lines] == [1, 4]
    for _, wall, forward, host in lines:
        assert 0 < float(forward) < float(wall) and float(host) > 0
    assert out.count("host functions by own time") == 2
