"""tests/conftest.py's xdist scheduler (`make test`: --dist loadfile): the costliest units of
SLOW_UNITS_FIRST are handed out first, longest first, so that no worker starts a long file
while the other has nothing left; the files of a shared fixture stay one unit. Driven through
the scheduler xdist itself would build, with stand-in worker nodes."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def suite_conftest(request):
    """tests/conftest.py as pytest loaded it: among its plugins, by its file (several
    conftest.py exist, and sys.modules keeps only the last one imported as `conftest`)."""
    want = TESTS / "conftest.py"
    for module in request.config.pluginmanager.get_plugins():
        if Path(getattr(module, "__file__", None) or "/").resolve() == want:
            return module
    pytest.fail("tests/conftest.py is not loaded")


class FakeConfig:
    """What LoadFileScheduling reads from pytest's config: two local workers, xdist's default
    ordering of units (by number of tests)."""

    class option:
        loadscopereorder = True

    def getoption(self, name):
        return {"dist": "loadfile"}[name]

    def getvalue(self, name):
        return {"tx": ["2*popen"]}[name]


class FakeNode:
    def __init__(self, name: str):
        self.name, self.shutting_down, self.sent = name, False, []
        self.gateway = type("Gateway", (), {"id": name})()

    def send_runtest_some(self, indexes):
        self.sent.append(list(indexes))

    def shutdown(self):
        self.shutting_down = True


COLLECTION = ([f"tests/core/test_many.py::test_{i}" for i in range(6)]
              + [f"tests/sim/test_some.py::test_{i}" for i in range(3)]
              + ["tests/server/test_fuzz.py::test_one",
                 "tests/router/test_ray_points.py::test_a",
                 "tests/router/test_ray_remote.py::test_b"])


def test_the_slow_units_are_handed_out_first_and_shared_fixture_files_together(suite_conftest):
    pytest.importorskip("xdist")
    scheduler = suite_conftest.pytest_xdist_make_scheduler(FakeConfig(), None)
    nodes = [FakeNode("gw0"), FakeNode("gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    first = [[COLLECTION[i] for i in node.sent[0]] for node in nodes]
    # the fuzz file (named before the Ray files) to one worker, the Ray files (one unit) to the
    # other; xdist's own order would have sent test_many.py (6 tests) and test_some.py (3) first
    assert first == [["tests/server/test_fuzz.py::test_one"],
                     ["tests/router/test_ray_points.py::test_a",
                      "tests/router/test_ray_remote.py::test_b"]]
    assert sorted(COLLECTION[i] for node in nodes for batch in node.sent for i in batch) == \
        sorted(COLLECTION)  # probe: every test was handed out, once


def test_the_other_units_keep_their_order(suite_conftest):
    queue = OrderedDict([("b.py", {}), ("tests/server/test_fuzz.py", {}), ("a.py", {}),
                         ("tests/engine/test_llm.py", {})])
    assert list(suite_conftest.slow_units_first(queue)) == [
        "tests/engine/test_llm.py", "tests/server/test_fuzz.py", "b.py", "a.py"]


def test_every_named_unit_is_a_file_or_a_shared_fixture_unit(suite_conftest):
    """A renamed file would silently lose its place: its old name must fail here."""
    shared = set(suite_conftest.SHARED_FIXTURE_UNITS.values())
    for unit in suite_conftest.SLOW_UNITS_FIRST:
        assert unit in shared or (TESTS.parent / unit).is_file(), unit
    assert len(set(suite_conftest.SLOW_UNITS_FIRST)) == len(suite_conftest.SLOW_UNITS_FIRST)
