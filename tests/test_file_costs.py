"""tests/file_costs.py and the `--dist loadfile` scheduler of tests/conftest.py: files go out
costliest first, files of a shared-fixture unit as one unit, and every measured file exists."""

from __future__ import annotations

import os
import types

import pytest

import file_costs  # tests/file_costs.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = "tests/server/test_fuzz.py"  # one long test
QUEUES = "tests/core/test_queues.py"  # many short ones


def test_every_measured_file_exists():
    missing = [path for path in file_costs.FILE_COSTS if not os.path.isfile(os.path.join(ROOT, path))]
    assert not missing, f"tests/file_costs.py names files that are gone: {missing}"


def test_costliest_first_not_most_tests_first():
    queue = {QUEUES: {f"{QUEUES}::t{i}": False for i in range(40)},
             "tests/new_file.py": {f"tests/new_file.py::t{i}": False for i in range(3)},
             FUZZ: {f"{FUZZ}::test_openapi": False}}
    order = [unit for unit, _ in file_costs.longest_first(queue)]
    assert order == [FUZZ, QUEUES, "tests/new_file.py"]
    assert file_costs.unit_cost(queue["tests/new_file.py"]) == 3 * file_costs.UNKNOWN_PER_TEST


class _Node:
    """What xdist's scheduler calls on a worker."""

    def __init__(self, name: str):
        self.name, self.sent, self.shutting_down = name, [], False
        self.gateway = types.SimpleNamespace(id=name)

    def send_runtest_some(self, indexes) -> None:
        self.sent.append(list(indexes))

    def shutdown(self) -> None:
        self.shutting_down = True


def test_the_suites_scheduler_hands_out_the_costliest_file_first(pytestconfig):
    """The scheduler the suite's conftest makes for --dist loadfile, fed a collection in which
    xdist's own order (most tests first) would send test_fuzz last."""
    pytest.importorskip("xdist")
    hook = pytestconfig.pluginmanager.hook.pytest_xdist_make_scheduler
    options = {"dist": "loadfile", "tx": ["2*popen"]}
    config = types.SimpleNamespace(getoption=options.get, getvalue=options.get,
                                   option=types.SimpleNamespace(loadscopereorder=True))
    scheduler = hook(config=config, log=None)
    assert type(scheduler).__name__ == "SharedFixtureFileScheduling"  # probe: the suite's own
    collection = ([f"{QUEUES}::t{i}" for i in range(40)] + [f"{FUZZ}::test_openapi"]
                  + ["tests/router/test_ray_points.py::a", "tests/router/test_ray_remote.py::b"])
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    sent = {node.name: [[collection[i] for i in batch] for batch in node.sent] for node in nodes}
    assert sent["gw0"][0] == collection[41:]  # the costliest unit first: the two Ray files
    assert sent["gw1"][0] == [f"{FUZZ}::test_openapi"]  # then the costliest single file
    assert sent["gw0"][1:] == [collection[:40]]  # xdist's second unit for a node short of work
