"""Fixtures shared by the router tests."""

from __future__ import annotations

import pytest

import ray_cluster  # tests/router/ray_cluster.py

_RUNNING: dict = {}  # the head this process started and has not stopped: context, value


def _stop_head() -> None:
    if _RUNNING:
        _RUNNING.pop("context").__exit__(None, None, None)
        _RUNNING.clear()


class _Head:
    """Unpacks as (process, address) of this process's Ray head, starting it first if none
    runs (the first use, or a use after the head was stopped early)."""

    def __iter__(self):
        if not _RUNNING:
            context = ray_cluster.head()
            _RUNNING["value"] = context.__enter__()
            _RUNNING["context"] = context
        return iter(_RUNNING["value"])


@pytest.fixture
def no_sweep_png(monkeypatch):
    """`sweep` in this process writes its CSV and draws no PNG beside it (as without
    matplotlib, which sim/cli.py:_plot allows): the Ray tests compare CSVs, never the plot,
    and drawing it cost ~1 s per sweep."""
    import tokenweir.sim.cli as sim_cli

    monkeypatch.setattr(sim_cli, "_plot", lambda rows, names, csv_path: None)


@pytest.fixture(scope="session")
def ray_head():
    """(process, address) of one Ray head (ray_cluster.head), shared by test_ray_remote.py and
    test_ray_points.py (scheduled on one xdist worker, one after the other). It is stopped
    after the last of those files' tests, not at the session's end: an idle head's daemons
    kept taking CPU from every test the worker ran after it."""
    if not ray_cluster.HAVE_RAY or ray_cluster.RAY is None:
        pytest.skip("ray, or its command, is not installed")
    yield _Head()
    _stop_head()


@pytest.hookimpl(trylast=True)  # after pytest's own teardown (test_ray_points' driver)
def pytest_runtest_teardown(item, nextitem):
    """The head stops when the next test is not in a file that uses it (test_ray_*.py;
    test_ray_points asks for it inside a fixture, so its tests do not name it)."""
    if _RUNNING and (nextitem is None or not nextitem.path.name.startswith("test_ray_")):
        _stop_head()
