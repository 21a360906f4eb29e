"""`tokenweir sweep --ray` / `study --ray`: each point a Ray task, results identical to the
serial run (CSV digests compared), a failing point reported without losing the others, and
without Ray the flag says how to install it."""

from __future__ import annotations

import csv
import hashlib
import os
import sys

import pytest

import ray_cluster  # tests/router/ray_cluster.py
from tokenweir.cli import main as cli_main
from tokenweir.sim.plots import parallel_map
from tokenweir.sim.ray_points import INSTALL_HINT, FailedPoint, check_reachable, import_ray

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
# A pool of 512 blocks holds every request of each point at once (16 x 23 blocks at most):
# the h100's own pool (~209k blocks) cost ~0.9 s to build per point and decided nothing here.
SWEEP = ["sweep", "--model-shape", "smollm2-135m", "--hardware", "h100", "--num-requests",
         "40", "--request-rate", "50", "--prompt-len", "uniform:50:300", "--output-len",
         "uniform:5:60", "--max-model-len", "1024", "--jobs", "1",
         "--num-gpu-blocks-override", "512"]


WALL_CLOCK = {"wall_seconds"}  # how long a point took to simulate: the only column of time


def _decided(path) -> list[list[str]]:
    """The CSV's rows (header first) without its wall-clock column: every result the runs
    decided."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    keep = [i for i, name in enumerate(rows[0]) if name not in WALL_CLOCK]
    assert len(keep) == len(rows[0]) - len(WALL_CLOCK)  # probe: the column was there
    return [[row[i] for i in keep] for row in rows]


def _digest(path) -> str:
    text = "\n".join(",".join(row) for row in _decided(path))
    return hashlib.sha256(text.encode()).hexdigest()


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ValueError, match="pip install 'tokenweir\\[ray\\]'"):
        import_ray()
    status = cli_main([*SWEEP, "--set", "max_num_seqs=4,8", "--out", str(tmp_path / "s.csv"),
                       "--ray"])
    assert status == 2 and INSTALL_HINT in capsys.readouterr().err
    assert not (tmp_path / "s.csv").exists()


def test_an_address_where_nothing_listens_is_refused_at_once(tmp_path, capsys):
    import socket
    import time

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    status = cli_main([*SWEEP, "--set", "max_num_seqs=4,8", "--out", str(tmp_path / "s.csv"),
                       "--ray", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert status == 2 and f"--ray 127.0.0.1:{port}: no Ray cluster answers there" in err
    assert time.monotonic() - started < 60 and not (tmp_path / "s.csv").exists()
    with socket.socket() as listening:  # probe: a listening address passes the check
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_reachable(f"127.0.0.1:{listening.getsockname()[1]}")
    check_reachable("local")
    check_reachable("auto")


@pytest.fixture(scope="module")
def local_ray(request):
    """This process's Ray driver, initialised before the tests run (so `--ray` and
    parallel_map use it as they find it): connected to the session's Ray head (conftest.py,
    shared with test_ray_remote.py; its workers import tokenweir and the helpers beside this
    file), or, without the `ray` command, a local Ray of 2 CPUs started here."""
    ray = pytest.importorskip("ray")
    # the workers import tokenweir (this checkout) and the helpers beside this file
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])
    with pytest.MonkeyPatch.context() as patch:
        if ray_cluster.RAY is not None:
            for name, value in ray_cluster.AUTH_ENV.items():
                patch.setenv(name, value)
            _, address = request.getfixturevalue("ray_head")
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        else:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     logging_level="ERROR")
        yield ray
        ray.shutdown()


def test_a_sweep_on_ray_writes_the_serial_runs_bytes(local_ray, tmp_path, no_sweep_png):
    sets = ["--set", "max_num_seqs=4,16", "--set", "max_num_batched_tokens=256,2048"]
    assert cli_main([*SWEEP, *sets, "--out", str(tmp_path / "serial.csv")]) == 0
    assert cli_main([*SWEEP, *sets, "--out", str(tmp_path / "ray.csv"), "--ray"]) == 0
    assert _digest(tmp_path / "serial.csv") == _digest(tmp_path / "ray.csv")
    rows = _decided(tmp_path / "ray.csv")
    assert len(rows) == 5  # probe: four points ran (a header and a row each)
    assert len({tuple(row[2:]) for row in rows[1:]}) == 4  # and their results differ


def test_a_failing_point_is_reported_and_the_others_kept(local_ray, tmp_path, capsys,
                                                         no_sweep_png):
    out = tmp_path / "s.csv"
    status = cli_main([*SWEEP, "--set", "max_num_batched_tokens=0,512,2048", "--out",
                       str(out), "--ray"])
    assert status == 1
    err = capsys.readouterr().err
    assert "point 0" in err and "failed" in err and "1 of 3 points failed" in err
    rows = open(out).read().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["512", "2048"]


def test_parallel_map_on_ray_keeps_order_and_marks_failures(local_ray):
    import ray_helpers

    results = parallel_map(ray_helpers.square_unless_three, list(range(6)), ray="local")
    assert results[:3] == [0, 1, 4] and results[4:] == [16, 25]
    assert isinstance(results[3], FailedPoint) and "three" in results[3].error


def test_a_study_with_a_failing_point_exits_1_and_keeps_the_others(local_ray, tmp_path,
                                                                    capsys):
    """`study --ray` reports a failed point and exits 1 (as sweep does), keeping the rest."""
    status = cli_main(["study", "pool", "--out-dir", str(tmp_path), "--num-requests", "20",
                       "--prompt-len", "uniform:50:200", "--output-len", "uniform:5:40",
                       "--blocks", "1,256", "--ray"])
    err = capsys.readouterr().err
    assert status == 1 and "1 points failed" in err
    assert "point 0" in err  # probe: the 1-block pool (only the null block) really failed
    rows = open(tmp_path / "pool.csv").read().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["256"]
