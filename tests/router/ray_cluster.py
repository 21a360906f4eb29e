"""A Ray head on loopback, started as a cluster's head is (`ray start --head`), for the Ray
tests: test_ray_remote.py runs a sweep process against it, test_ray_points.py connects its
driver to it. tests/router/conftest.py starts it once per test process (session fixture
`ray_head`), and tests/conftest.py schedules both files on one xdist worker, so one head
serves both (a head costs ~7-9 s to start).

The head runs with token authentication off (RAY_AUTH_MODE=disabled, on 127.0.0.1 only) and
with this checkout and this folder on its workers' PYTHONPATH (a cluster's workers need
tokenweir installed; test_ray_points ships ray_helpers' function by reference). It is
stopped through its own process group (never `ray stop`, which stops every Ray here)."""

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
from contextlib import contextmanager
from typing import Iterator

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
# ray itself is never imported here: found, not imported (`import ray` costs ~1 CPU-s)
HAVE_RAY = importlib.util.find_spec("ray") is not None
RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
AUTH_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def env() -> dict[str, str]:
    """The environment of the head and of the processes that connect to it."""
    return {**os.environ, **AUTH_ENV,
            "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the head's process group, then up to 30 s until no member still runs. The
    head is a throwaway in its own temp dir (removed after), so nothing a graceful stop would
    save is kept: SIGTERM first never ended the group in the 1-5 s waited for it (measured),
    and those waits were teardown time. Every Ray process of the head (gcs_server, raylet,
    its workers, the agents) is in the group. The leader is reaped here; the others, once
    orphaned, are reaped by PID 1 when it gets to them (~1.4 s in this container), so a
    member that has exited (a zombie) counts as gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader once it has exited
        if not _running_members(proc.pid):
            proc.wait(10)
            return
        time.sleep(0.05)


def _running_members(pgid: int) -> bool:
    """Whether a process of group `pgid` has not exited (zombies have). Without /proc: the
    group exists at all (zombies included)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


@contextmanager
def head() -> Iterator[tuple[subprocess.Popen, str]]:
    """A Ray head on 127.0.0.1 in a process group of its own: (process, address)."""
    temp = tempfile.mkdtemp(prefix="twray.")  # short: Ray's socket paths must stay < 108
    port = _free_port()
    log = open(os.path.join(temp, "head.log"), "w+")
    proc = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address",
                             "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                             "--include-dashboard=false", "--disable-usage-stats",
                             # no autoscaler and no log monitor: a fixed one-node cluster
                             # whose drivers all pass log_to_driver=False (two Python
                             # daemons fewer to start)
                             "--no-monitor", "--include-log-monitor=false",
                             "--temp-dir", os.path.join(temp, "t")], env=env(), cwd=temp,
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
        time.sleep(0.1)
    raise RuntimeError("ray start --head did not start in 180 s")
