"""`tokenweir sweep --ray ADDRESS` against a Ray started separately (`ray start --head` on
loopback, as a cluster's head is started): the sweep run as its own process connects to that
address and writes the serial run's results (CSV digests compared). Probe: the cluster's job
table holds the sweep as a finished job (it ran there, not on a Ray of its own).

The head runs with token authentication off (RAY_AUTH_MODE=disabled, on 127.0.0.1 only) and
with this checkout on its workers' PYTHONPATH (a cluster's workers need tokenweir installed).
It is stopped through its own process group (never `ray stop`, which stops every Ray here)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from test_ray_points import ROOT, SWEEP, _digest
from tokenweir.cli import main as cli_main

# ray itself is never imported here (the sweep and the job-table reader are processes of their
# own): found, not imported, so that collecting this file costs no `import ray` (~1 CPU-s)
HAVE_RAY = importlib.util.find_spec("ray") is not None
RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
pytestmark = [pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed"),
              pytest.mark.skipif(RAY is None, reason="the ray command is not installed")]
SETS = ["--set", "max_num_seqs=4,16", "--set", "max_num_batched_tokens=256,2048"]


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the head's process group, 1 s to exit, then SIGKILL (a drain can take 30 s;
    the head is a throwaway in its own temp dir, so nothing is lost; measured: the group was
    still alive 5 s after SIGTERM, so the 5 s wait this had bought nothing). The
    leader is reaped as it exits: unreaped, it stays in the group as a zombie, and the group
    would look alive until the wait ran out (90 s of teardown in CI before this)."""
    for sig, wait_s in ((signal.SIGTERM, 1), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader once it has exited
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.wait(10)
                return
            time.sleep(0.5)


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on 127.0.0.1 in a process group of its own; its address."""
    temp = tempfile.mkdtemp(prefix="twray.")  # short: Ray's socket paths must stay < 108
    port = _free_port()
    log = open(os.path.join(temp, "head.log"), "w+")
    proc = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address",
                             "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                             "--include-dashboard=false", "--disable-usage-stats",
                             "--temp-dir", os.path.join(temp, "t")], env=_env(), cwd=temp,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_started(proc, log)
        yield proc, f"127.0.0.1:{port}"
    finally:
        _stop_group(proc)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_started(proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read()
        if "Ray runtime started" in text:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited {proc.returncode}: {text[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError("ray start --head did not start in 180 s")


def _sweep(out: str, address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenweir", *SWEEP, *SETS, "--out", out,
                           "--ray", address], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _jobs(address: str) -> list[dict]:
    """The cluster's job table, read by a driver of its own."""
    script = ("import ray, ray._private.state as state\n"
              f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n"
              "for job in state.jobs():\n"
              "    print(repr((job['IsDead'], job.get('Entrypoint', ''))))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [dict(zip(("dead", "entrypoint"), eval(line)))  # noqa: S307 - our own repr
            for line in proc.stdout.splitlines() if line.startswith("(")]


def test_a_sweep_on_a_separately_started_ray_writes_the_serial_runs_bytes(ray_head, tmp_path):
    _, address = ray_head
    assert cli_main([*SWEEP, *SETS, "--out", str(tmp_path / "serial.csv")]) == 0
    remote = _sweep(str(tmp_path / "remote.csv"), address)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert _digest(tmp_path / "serial.csv") == _digest(tmp_path / "remote.csv")
    assert len(open(tmp_path / "remote.csv").read().splitlines()) == 5  # probe: four points
    ran = [job for job in _jobs(address) if str(tmp_path / "remote.csv") in job["entrypoint"]]
    assert len(ran) == 1 and ran[0]["dead"]  # probe: the sweep was a job of that cluster

