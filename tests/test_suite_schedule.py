"""The suite's own xdist schedule (tests/conftest.py: `make test` runs --dist loadfile): the
units SEND_FIRST names go out before every other unit, in its order, and the files of a
SHARED_FIXTURE_UNITS group stay one unit; every test is still sent exactly once."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xdist")


@pytest.fixture
def suite_conftest(request):
    """tests/conftest.py as pytest loaded it."""
    here = Path(__file__).with_name("conftest.py").resolve()
    for plugin in request.config.pluginmanager.get_plugins():
        if Path(getattr(plugin, "__file__", "") or "/").resolve() == here:
            return plugin
    raise AssertionError("tests/conftest.py is not loaded")


class FakeNode:
    """What xdist's loadfile scheduler asks of a worker: the test indexes it is sent."""

    def __init__(self, name: str):
        self.sent: list[int] = []
        self.shutting_down = False
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indexes):
        self.sent.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


def _scheduler(conftest, collection):
    from xdist.remote import Producer

    config = SimpleNamespace(getoption=lambda name: {"dist": "loadfile"}[name],
                             getvalue=lambda name: {"tx": ["popen", "popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=True))
    sched = conftest.pytest_xdist_make_scheduler(config, Producer("test", enabled=False))
    nodes = [FakeNode("gw0"), FakeNode("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes


def test_send_first_units_go_out_first_then_xdists_order(suite_conftest, monkeypatch):
    first = ["tests/x/test_long_b.py", "tests/x/test_long_a.py"]
    monkeypatch.setattr(suite_conftest, "SEND_FIRST", tuple(first))
    many = [f"tests/x/test_many.py::t{i}" for i in range(8)]
    some = [f"tests/x/test_some.py::t{i}" for i in range(5)]
    collection = many + some + [f"{first[1]}::only", f"{first[0]}::only",
                                "tests/x/test_short.py::only"]
    sched, nodes = _scheduler(suite_conftest, collection)
    units = [list(OrderedDict.fromkeys(collection[i].split("::")[0] for i in node.sent))
             for node in nodes]
    # each worker is handed a unit, then one more while it holds 2 tests or fewer: the named
    # units first (xdist alone sends test_many and test_some first, then only test_long_a)
    assert units == [[first[0], "tests/x/test_many.py"], [first[1], "tests/x/test_some.py"]]
    assert list(sched.workqueue) == ["tests/x/test_short.py"]


def test_send_first_keeps_its_order_and_every_other_unit(suite_conftest):
    queue = OrderedDict((name, {}) for name in ["a", "b", "c", "d"])
    suite_conftest.send_first(queue, first=("d", "missing", "b"))
    assert list(queue) == ["d", "b", "a", "c"]


def test_send_first_names_units_of_this_suite(suite_conftest):
    """A renamed or moved file would silently fall out of SEND_FIRST: each name is a file of
    the suite (or SHARED_FIXTURE_UNITS' name for a group of them)."""
    root = Path(__file__).resolve().parents[1]
    for unit in suite_conftest.SEND_FIRST:
        assert list(root.glob(unit)), unit


def test_the_ray_files_are_one_unit(suite_conftest):
    collection = ["tests/router/test_ray_points.py::t0", "tests/router/test_ray_remote.py::t1",
                  "tests/a/test_a.py::t0"]
    sched, nodes = _scheduler(suite_conftest, collection)
    assert len(nodes[0].sent + nodes[1].sent) == 3  # every test sent once
    ray = [n for n in nodes if 0 in n.sent]
    assert ray and 1 in ray[0].sent  # both ray files went to the worker that got one
