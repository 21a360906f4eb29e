"""benchmarks/sim_fidelity.py: the speed-matched floor's signed-median line prints its own
noise (fid15): a bootstrap standard error per cell and the cells whose median leans."""

from __future__ import annotations

import random
import statistics

import pytest
from fidelity_module import loaded_sim_fidelity  # tests/sim/fidelity_module.py


@pytest.fixture(scope="module")
def fid():
    yield from loaded_sim_fidelity("sim_fidelity_median_noise")


def suites(fid, shift: dict, n: int = 20, sd: float = 0.05) -> list[dict]:
    rng = random.Random(4)
    return [{k: rng.gauss(shift.get(k, 0.0), sd) for k in fid.METRICS} for _ in range(n)]


def test_the_standard_error_is_the_medians_sampling_noise(fid):
    """Twenty suites of errors N(0, 5%): the median's standard error is ~1.25 x 5% /
    sqrt(20) = 1.4 points (its bootstrap within 0.8-2.2); a hundred suites: about half
    that. Seeded: the same on every call."""
    values = [e["ttft_p90_ms"] for e in suites(fid, {})]
    se = fid.median_standard_error(values, "w/ttft_p90_ms")
    assert 0.008 < se < 0.022
    assert se == fid.median_standard_error(values, "w/ttft_p90_ms")
    many = [e["ttft_p90_ms"] for e in suites(fid, {}, n=100)]
    assert fid.median_standard_error(many, "w/ttft_p90_ms") < 0.7 * se
    assert fid.median_standard_error(values[:1], "w") == 0.0


def test_the_floor_prints_the_noise_and_names_the_leaning_cells(fid):
    """format_floors' signed-median line is followed by each cell's standard error and the
    cells 2 standard errors (and 1 point) or more from 0: a floor whose TPOT p90 leans +6%
    names it, a centred one names none, nor one whose every cell sits 0.5 points off with
    no noise at all. Probe: the line before it is the signed median, unchanged."""
    zero = {k: 0.0 for k in fid.METRICS}
    row = {"workload": "w", "rel_error": zero, "speed_matched": {"rel_error": zero}}
    for shift, expected in (({}, "none"), ({"tpot_p90_ms": 0.06}, "tpot_p90_ms +")):
        matched = {"w": suites(fid, shift)}
        text = fid.format_floors([row], {"w": [zero]}, matched).splitlines()
        at = next(i for i, line in enumerate(text) if "its signed median:" in line)
        noise = text[at + 1]
        assert noise.startswith("w          its median's standard error (bootstrap over 20 "
                                "suites): total_s +-")
        assert noise.split("leaning (|median| >= 2 SE and 1 point): ")[1].startswith(expected)
        median = statistics.median(e["tpot_p90_ms"] for e in matched["w"])
        assert f"tpot_p90_ms {100 * median:+.1f}%" in text[at]
    exact = {"w": [{k: 0.005 for k in fid.METRICS}] * 20}
    text = fid.format_floors([row], {"w": [zero]}, exact)
    assert "+-0.0 points; leaning (|median| >= 2 SE and 1 point): none" in text
