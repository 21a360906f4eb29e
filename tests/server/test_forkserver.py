"""tests/forkserver.py, the test hook that starts `python -m tokenweir serve` (and benchmark
scripts) by forking a process with torch preloaded: a process it starts sees what a fresh
interpreter would (argv, working directory, environment, sys.path, __main__, streams) and
reports the exit status a fresh interpreter would give; the probe (`preloaded`) shows which of
the two started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import forkserver  # tests/forkserver.py

pytestmark = pytest.mark.skipif(
    not forkserver.ENABLED, reason="TOKENWEIR_TEST_FORKSERVER=0: the fork server is off")

SCRIPT = r'''
import json, os, sys
preloaded = "torch" in sys.modules  # before this script imports anything heavy
whole_list = "fastapi" in sys.modules  # forkserver.PRELOAD's, not only torch
if sys.argv[1:2] == ["exit"]:
    print("bye", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
if sys.argv[1:2] == ["raise"]:
    raise ValueError("from the child")
if sys.argv[1:2] == ["threads"]:
    import torch
    print(json.dumps({"preloaded": preloaded, "whole_list": whole_list,
                      "threads": torch.get_num_threads()}))
    sys.exit(0)
if sys.argv[1:2] == ["breakpoint"]:
    breakpoint("hook called")  # sys.breakpointhook reads PYTHONBREAKPOINT now
    print(json.dumps({"preloaded": preloaded}))
    sys.exit(0)
if sys.argv[1:2] == ["sleep"]:
    print("sleeping", flush=True)
    import time; time.sleep(60)
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__,
                  "env": os.environ.get("FORKSERVER_PROBE"), "path": sys.path[:3],
                  "tokenweir": any(m.split(".")[0] == "tokenweir" for m in sys.modules),
                  "preloaded": preloaded}))
'''


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": "/no/such/dir",
            "FORKSERVER_PROBE": "yes", **extra}


def _both(argv: list, env: dict, cwd: str):
    """(forked, fresh): the same call through the fork server and through subprocess.run."""
    forked = forkserver.run(argv, env=env, cwd=cwd, timeout=120)
    fresh = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return forked, fresh


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe_script.py"
    path.write_text(SCRIPT)
    return path


def test_a_forked_script_sees_what_a_fresh_interpreter_sees(script, tmp_path):
    forked, fresh = _both([sys.executable, str(script), "a", "b c"], _env(), str(tmp_path))
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    got, want = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert got.pop("preloaded") is True and want.pop("preloaded") is False  # the probe
    assert got == want
    assert want["path"][:2] == [str(tmp_path), "/no/such/dir"]  # script dir, PYTHONPATH
    assert want["tokenweir"] is False and want["name"] == "__main__"


def test_a_forked_module_run_sees_what_python_dash_m_sees(script, tmp_path):
    for flags in ([], ["-P"]):
        argv = [sys.executable, *flags, "-m", "probe_script", "x"]
        forked, fresh = _both(argv, _env(PYTHONPATH=str(tmp_path)), str(tmp_path / ".."))
        assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
        got, want = json.loads(forked.stdout), json.loads(fresh.stdout)
        assert got.pop("preloaded") is True and want.pop("preloaded") is False
        assert got == want, flags


@pytest.mark.parametrize("args, code, text", [(["exit", "3"], 3, "bye"),
                                              (["raise"], 1, "ValueError: from the child")])
def test_exit_status_and_stderr_are_a_fresh_interpreters(script, tmp_path, args, code, text):
    forked, fresh = _both([sys.executable, str(script), *args], _env(), str(tmp_path))
    assert forked.returncode == fresh.returncode == code
    assert text in forked.stderr and text in fresh.stderr


def test_signals_reach_the_child_and_its_status_says_so(script, tmp_path):
    proc = forkserver.popen([sys.executable, str(script), "sleep"], env=_env(),
                            cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    assert isinstance(proc, forkserver.ForkedProcess)  # probe: the fork server started it
    assert proc.stdout.readline() == b"sleeping\n"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    assert proc.stdout.read() == b""


def test_an_import_time_setting_that_differs_is_never_forked_from_another_setting(script,
                                                                                 tmp_path):
    """libgomp reads OMP_NUM_THREADS when torch loads: a call asking for 2 threads gets them
    (a fork server of its own loaded torch with 2, or, where that one refuses because a
    library started threads at import, a fresh interpreter), never the 1-thread fork server's
    torch; the 1-thread calls around it are forked. The 2-thread fork server is told to import
    torch alone (forkserver.PRELOAD_VARIABLE: all its child needs)."""
    # the answer is checked against the setting itself (torch's thread count is what
    # OMP_NUM_THREADS says: a fresh interpreter's answer, which this test compared with
    # before, adds nothing the count does not say, at ~1.5 CPU-s of `import torch` each)
    for threads in ("1", "2", "1"):
        extra = {} if threads == "1" else {forkserver.PRELOAD_VARIABLE: "torch"}
        argv = [sys.executable, str(script), "threads"]
        env = _env(OMP_NUM_THREADS=threads, **extra)
        forked = forkserver.run(argv, env=env, cwd=str(tmp_path), timeout=120)
        assert forked.returncode == 0, forked.stderr
        got = json.loads(forked.stdout)
        preloaded, whole_list = got.pop("preloaded"), got.pop("whole_list")
        assert preloaded or threads != "1"  # probe: the 1-thread calls were forked
        assert whole_list == (threads == "1")  # the 2-thread answer: torch alone, or fresh
        assert got == {"threads": int(threads)}
    # probe: the 2-thread setting's fork server imported torch and not the rest of the list
    # (here it then refuses, as with the whole list: torch's import under OMP_NUM_THREADS=2
    # leaves a thread, and the call runs in a fresh interpreter)
    key = tuple(sorted(forkserver._import_env(
        _env(OMP_NUM_THREADS="2", **{forkserver.PRELOAD_VARIABLE: "torch"})).items()))
    with open(f"/proc/{forkserver._SERVERS[key]['proc'].pid}/maps") as maps:
        mapped = maps.read()
    assert "libtorch" in mapped and "tokenizers" not in mapped


def test_the_preload_list_is_part_of_a_fork_servers_key():
    """Two calls that differ only in what the fork server should import are not served by the
    same one (the first's would lack, or carry, what the second asked for)."""
    variable = forkserver.PRELOAD_VARIABLE
    assert forkserver._import_env({variable: "torch", "HOME": "/x"}) == {variable: "torch"}
    # the setting the test above asks for, beside it in the key (there both differ)
    assert forkserver._import_env({variable: "torch", "OMP_NUM_THREADS": "2"}) == {
        variable: "torch", "OMP_NUM_THREADS": "2"}
    assert forkserver._preload({variable: "torch,numpy"}) == ("torch", "numpy")
    assert forkserver._preload({}) == forkserver.PRELOAD


def test_a_setting_read_after_the_fork_is_served_by_the_same_fork_server(script, tmp_path):
    """PYTHONBREAKPOINT is read when breakpoint() is called, not at import (`ray.init` sets it
    in the test process; as part of the fork server's key it started a second fork server):
    the call is forked from the fork server already there, and its child honours the hook as
    a fresh interpreter does."""
    assert forkserver.run([sys.executable, str(script), "a"], env=_env(),
                          cwd=str(tmp_path)).returncode == 0  # this setting's fork server is up
    servers = len(forkserver._SERVERS)
    argv = [sys.executable, str(script), "breakpoint"]
    forked, fresh = _both(argv, _env(PYTHONBREAKPOINT="builtins.print"), str(tmp_path))
    assert len(forkserver._SERVERS) == servers  # no fork server of its own
    got, want = forked.stdout.splitlines(), fresh.stdout.splitlines()
    assert got[0] == want[0] == "hook called"  # the child read the variable when called
    assert json.loads(got[1])["preloaded"] is True  # probe: forked
    assert json.loads(want[1])["preloaded"] is False


def test_what_ray_and_torch_set_in_the_test_process_starts_no_second_fork_server():
    """`ray.init` sets PYTHONBREAKPOINT in the test process, the inductor's first use sets
    TORCHINDUCTOR_CACHE_DIR: both are read after the fork, so neither changes the key."""
    env = _env()
    for name, value in (("PYTHONBREAKPOINT", "ray.util.rpdb._driver_set_trace"),
                        ("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_root")):
        assert forkserver._import_env({**env, name: value}) == forkserver._import_env(env), name
    # probe: a setting read at import still is a key of its own
    assert forkserver._import_env({**env, "OMP_NUM_THREADS": "2"}) != forkserver._import_env(env)


def test_stopping_a_fork_server_removes_its_socket_folder(tmp_path, monkeypatch):
    """Each fork server's socket lives in a folder of its own under the temporary directory:
    stop_servers (run at exit) removes it, so runs leave no tw-forkserver-* folders behind."""
    folder = tmp_path / "tw-forkserver-x"
    folder.mkdir()
    (folder / "sock").write_text("")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(forkserver, "_SERVERS",
                        {(): {"path": str(folder / "sock"), "proc": stand_in, "folder": str(folder)}})
    forkserver.stop_servers()
    assert stand_in.returncode == -signal.SIGTERM  # probe: the server was stopped
    assert not folder.exists()
