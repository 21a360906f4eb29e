"""`tokenweir sweep --ray ADDRESS` against a Ray started separately (`ray start --head` on
loopback, as a cluster's head is started): the sweep run as its own process connects to that
address and writes the serial run's results (CSV digests compared). Probe: the cluster's job
table holds the sweep as a finished job (it ran there, not on a Ray of its own).

The head is tests/router/ray_cluster.py's, started once per test process (the session fixture
`ray_head` of tests/router/conftest.py) and shared with test_ray_points.py, whose driver
connects to it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ray_cluster  # tests/router/ray_cluster.py: the head, shared with test_ray_points.py
from test_ray_points import ROOT, SWEEP, _digest
from tokenweir.cli import main as cli_main

# ray is imported only when the test runs (the job-table reader; the sweep is a process of its
# own): found, not imported, so that collecting this file costs no `import ray` (~1 CPU-s)
pytestmark = [pytest.mark.skipif(not ray_cluster.HAVE_RAY, reason="ray is not installed"),
              pytest.mark.skipif(ray_cluster.RAY is None,
                                 reason="the ray command is not installed")]
SETS = ["--set", "max_num_seqs=4,16", "--set", "max_num_batched_tokens=256,2048"]


# `python -m tokenweir ARGS` as a process of its own, with matplotlib unimportable: the sweep
# then draws no PNG (sim/cli.py:_plot's "None without matplotlib"), which no assertion here
# reads and which cost ~2-3 s (matplotlib's import and the drawing). sys.argv keeps ARGS, so
# the job's entrypoint still names the CSV.
_MAIN_WITHOUT_MATPLOTLIB = ("import sys, runpy; sys.modules['matplotlib'] = None; "
                            "runpy.run_module('tokenweir', run_name='__main__')")


def _sweep(out: str, address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _MAIN_WITHOUT_MATPLOTLIB, *SWEEP, *SETS,
                           "--out", out, "--ray", address], env=ray_cluster.env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _jobs(address: str) -> list[dict]:
    """The cluster's job table, read by a driver this process connects for it (and
    disconnects after); test_ray_points.py's driver, if it ran here, is shut down by then."""
    ray = pytest.importorskip("ray")
    import ray._private.state as state

    assert not ray.is_initialized()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ray_cluster.AUTH_ENV.items():
            patch.setenv(name, value)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            return [{"dead": job["IsDead"], "entrypoint": job.get("Entrypoint", "")}
                    for job in state.jobs()]
        finally:
            ray.shutdown()


def test_a_sweep_on_a_separately_started_ray_writes_the_serial_runs_bytes(ray_head, tmp_path,
                                                                          no_sweep_png):
    _, address = ray_head
    assert cli_main([*SWEEP, *SETS, "--out", str(tmp_path / "serial.csv")]) == 0
    remote = _sweep(str(tmp_path / "remote.csv"), address)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert _digest(tmp_path / "serial.csv") == _digest(tmp_path / "remote.csv")
    assert len(open(tmp_path / "remote.csv").read().splitlines()) == 5  # probe: four points
    assert not (tmp_path / "serial.png").exists()  # probe: neither sweep drew its plot
    assert not (tmp_path / "remote.png").exists()
    ran = [job for job in _jobs(address) if str(tmp_path / "remote.csv") in job["entrypoint"]]
    assert len(ran) == 1 and ran[0]["dead"]  # probe: the sweep was a job of that cluster

