"""A test hook: start `python -m tokenweir ...` (or `python SCRIPT ...`) processes by forking a
process that has already imported the heavy third-party libraries (torch, fastapi, uvicorn,
transformers, ...), instead of a fresh interpreter importing them again (~4.5 of a `tokenweir
serve` start's ~6.5 CPU-s is `import torch`; the suite starts ~20 servers and routers).

What a started process runs is unchanged: the same argv, environment, working directory and
standard streams, in its own process (its own pid, signals, exit status, sys.path as a fresh
interpreter would build it). Not one tokenweir module is imported before the fork: tokenweir's
own import-time code (env reads, preflight, prefetch thread) runs in the child as in a fresh
process. What differs: the third-party modules of PRELOAD are already in sys.modules, their
objects in the collector's permanent generation (`gc.freeze`, as tokenweir's own start-ups do
after a build: tokenweir/startup_gc.py), so a child's full collection does not walk them again
(~0.3 s each: a benchmark's `gc.collect()` between runs).
Environment variables that those libraries read at import (OMP_*, MKL_*, TORCH*, TRITON*, ...:
see `_import_env`) are the fork server's own: one fork server per distinct set of them (started
with the first request's environment; at most MAX_SERVERS, then processes start the ordinary
way).

    proc = forkserver.popen(argv, env=..., cwd=..., stdout=PIPE, stderr=STDOUT)

returns a `subprocess.Popen`-like object (pid, args, returncode, stdout, poll, wait,
send_signal, terminate, kill). `popen` falls back to `subprocess.Popen` when the fork server
cannot serve the call (TOKENWEIR_TEST_FORKSERVER=0, an interpreter flag other than -P, a fork
server that failed to start or has more than one thread). Fork servers belong to the test
process: started on first use, stopped at exit.

Its children's CPU time (from wait4) is summed in CHILD_CPU (a test-run profiler reads it; the
children are not the test process's own, so RUSAGE_CHILDREN does not see them)."""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

PRELOAD = ("numpy", "torch", "tokenizers", "llguidance", "fastapi", "uvicorn", "starlette",
           "pydantic", "httpx", "anyio", "prometheus_client", "jinja2", "click", "tqdm",
           "transformers", "safetensors")
IMPORT_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "TRITON", "CUDA",
                       "LD_", "MALLOC_", "GLIBC_", "HF_", "TRANSFORMERS", "TOKENIZERS",
                       "PYTHON")
ENABLED = os.environ.get("TOKENWEIR_TEST_FORKSERVER", "1") != "0"
CHILD_CPU = [0.0]  # CPU seconds of every reaped child (user + sys)
MAX_SERVERS = 4
_SERVERS: dict = {}  # the import-time environment (sorted items) -> {path, proc}
_LOCK = threading.Lock()


# Read by the child after the fork, from the request's environment, so no part of the key:
# PYTHONPATH and PYTHONSAFEPATH build its sys.path (_become); breakpoint() reads
# PYTHONBREAKPOINT when called; torch's inductor reads TORCHINDUCTOR_CACHE_DIR when it first
# needs its cache. The last two are set in the test process itself (by `ray.init`, and by the
# inductor's first use): as keys they started a second fork server (~6.5 CPU-s) in a worker.
READ_AFTER_FORK = ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONBREAKPOINT", "TORCHINDUCTOR_CACHE_DIR")


# A caller that knows its children need less than PRELOAD (a fork server started only to
# serve one setting, as tests/server/test_forkserver.py's) names the modules here, comma-
# separated: that fork server imports only those (a fork server with the whole list imports
# ~6.5 CPU-s; torch alone ~2.5). What a child runs is unchanged; it imports the rest itself.
PRELOAD_VARIABLE = "TOKENWEIR_TEST_FORKSERVER_PRELOAD"


def _import_env(env: dict) -> dict:
    """The variables the preloaded libraries may read at import (READ_AFTER_FORK excepted),
    and PRELOAD_VARIABLE (what the fork server imports)."""
    return {k: v for k, v in env.items()
            if (k.startswith(IMPORT_ENV_PREFIXES) and k not in READ_AFTER_FORK)
            or k == PRELOAD_VARIABLE}


def _preload(env: dict) -> tuple:
    """The modules a fork server started with env imports before it serves."""
    named = env.get(PRELOAD_VARIABLE)
    return PRELOAD if named is None else tuple(m for m in named.split(",") if m)


# ---------------------------------------------------------------- client (the test process)

class ForkedProcess:
    """The Popen-like handle of a process the fork server started."""

    def __init__(self, args, pid: int, conn: socket.socket, stdout):
        self.args, self.pid, self._conn, self.stdout = args, pid, conn, stdout
        self.stderr = None
        self.returncode: Optional[int] = None

    def _read_status(self, timeout: Optional[float]) -> None:
        if self.returncode is not None:
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        data = self._conn.recv(4096)
        self._conn.close()
        if not data:  # the fork server died: the child's status is lost
            self.returncode = -signal.SIGKILL
            return
        status = json.loads(data)
        CHILD_CPU[0] += status["cpu"]
        self.returncode = status["returncode"]

    def poll(self) -> Optional[int]:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _start_server(env: dict) -> Optional[str]:
    """The socket path of the fork server whose import-time environment is env's (started,
    with env less PYTHONPATH, on first use), or None if it cannot start."""
    key = tuple(sorted(_import_env(env).items()))
    if key not in _SERVERS:
        if len(_SERVERS) >= MAX_SERVERS:
            return None
        folder = tempfile.mkdtemp(prefix="tw-forkserver-")
        path = os.path.join(folder, "sock")
        proc = subprocess.Popen([sys.executable, __file__, path],
                                env={k: v for k, v in env.items() if k != "PYTHONPATH"},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        line = proc.stdout.readline().decode().strip()  # "ready", or why not
        if not _SERVERS:
            atexit.register(stop_servers)
        _SERVERS[key] = {"path": path if line == "ready" else None, "proc": proc,
                         "folder": folder}
    return _SERVERS[key]["path"]


def stop_servers() -> None:
    """Stop every fork server of this process (their children are not waited for) and remove
    its socket's folder."""
    for server in _SERVERS.values():
        if server["proc"].poll() is None:
            server["proc"].terminate()
            server["proc"].wait(timeout=30)
        shutil.rmtree(server["folder"], ignore_errors=True)


def _servable(argv: list) -> bool:
    return (ENABLED and len(argv) >= 2 and argv[0] == sys.executable
            and all(not a.startswith("-") or a in ("-m", "-P") for a in _flags(argv)))


def _flags(argv: list) -> list:
    """The interpreter's own options: argv[1:] up to the script or `-m module`."""
    flags = []
    for a in argv[1:]:
        if not a.startswith("-") or a == "-m":
            break
        flags.append(a)
    return flags


def popen(argv: list, env: Optional[dict] = None, cwd: Optional[str] = None,
          stdout=None, stderr=None):
    """Start argv like subprocess.Popen(argv, env, cwd, stdin=DEVNULL, stdout, stderr) (stdout:
    None, PIPE or DEVNULL; stderr: None, STDOUT or DEVNULL), through the fork server when it
    can serve the call (see the module doc), else with subprocess.Popen."""
    env = dict(os.environ if env is None else env)
    with _LOCK:
        path = _start_server(env) if _servable(argv) else None
    if path is None:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=stderr)
    return _spawn(path, argv, env, cwd or os.getcwd(), stdout, stderr)


def run(argv: list, env: Optional[dict] = None, cwd: Optional[str] = None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """subprocess.run(argv, env, cwd, capture_output=True, text=True, timeout), through the
    fork server when it can serve the call (else subprocess.run itself)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(argv, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, proc.returncode, out.read().decode(),
                                           err.read().decode())


def _stream_fds(stdout, stderr):
    """(fds to send as 0, 1, 2; the pipe's read end as a file or None; fds to close here)."""
    null_in = os.open(os.devnull, os.O_RDONLY)
    close = [null_in]
    reader = None
    if stdout == subprocess.PIPE:
        r, out = os.pipe()
        reader = os.fdopen(r, "rb")
        close.append(out)
    else:
        out = _plain_fd(stdout, 1, close)
    err = out if stderr == subprocess.STDOUT else _plain_fd(stderr, 2, close)
    return [null_in, out, err], reader, close


def _plain_fd(stream, inherited: int, close: list) -> int:
    """The fd a DEVNULL / file-like / None stream argument stands for (None: `inherited`, as
    Popen does); an fd opened here is added to `close`."""
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY)
        close.append(fd)
        return fd
    return stream.fileno() if hasattr(stream, "fileno") else inherited


def _spawn(path, argv, env, cwd, stdout, stderr) -> ForkedProcess:
    fds, reader, close = _stream_fds(stdout, stderr)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], fds)
    finally:
        for fd in close:
            os.close(fd)
    pid = int.from_bytes(_recv_exactly(conn, 8), "big")
    return ForkedProcess(argv, pid, conn, reader)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise RuntimeError("the fork server closed the connection")
        data += chunk
    return data


# ---------------------------------------------------------------- the fork server

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(path: str):
    """Accept requests until told to stop; returns (in a forked child) the request to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready" if _threads() == 1 else f"{_threads()} threads after the imports",
          flush=True)
    children: dict[int, socket.socket] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        _reap(children)
        if os.getppid() != parent:  # the test process died without stopping us
            sys.exit(0)
        if not ready:
            continue
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        size = int.from_bytes(msg[:8], "big")
        body = msg[8:]
        while len(body) < size:
            body += conn.recv(size - len(body))
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for other in children.values():
                other.close()
            return json.loads(body), fds
        for fd in fds:
            os.close(fd)
        conn.sendall(pid.to_bytes(8, "big"))
        children[pid] = conn


def _reap(children: dict) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
        try:
            conn.sendall(json.dumps({"returncode": code,
                                     "cpu": usage.ru_utime + usage.ru_stime}).encode())
        except OSError:
            pass
        conn.close()


def _become(request: dict, fds: list, base_path: list) -> None:
    """In the forked child: take the request's streams, directory, environment, argv and
    sys.path, as a fresh `python [-P] (-m MOD | SCRIPT) ARGS` would have them."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    flags = _flags(argv)
    rest = argv[1 + len(flags):]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    safe = "-P" in flags or os.environ.get("PYTHONSAFEPATH")
    if rest[0] == "-m":
        first = [] if safe else [os.getcwd()]
    else:
        first = [] if safe else [os.path.dirname(os.path.abspath(rest[0]))]
    sys.path[:] = first + [os.path.abspath(p) for p in pythonpath] + base_path
    sys.argv = rest[1:] if rest[0] == "-m" else rest


def _run(request: dict) -> int:
    """Run the module or script as __main__; the exit status a fresh interpreter would give."""
    import runpy
    import traceback
    argv = request["argv"]
    rest = argv[1 + len(_flags(argv)):]
    try:
        if rest[0] == "-m":
            sys.argv[0] = rest[1]  # runpy replaces it with the module's path
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(rest[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:  # noqa: BLE001  (as the interpreter: print it, exit 1)
        traceback.print_exc()
        return 1


def _main(path: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    base_path = [p for p in sys.path[1:] if p != here]
    for name in _preload(os.environ):
        try:
            __import__(name)
        except ImportError:
            pass
    gc.freeze()  # the preloaded modules' objects: never scanned by a child's collector passes
    request, fds = _serve(path)
    _become(request, fds, base_path)
    sys.exit(_run(request))


if __name__ == "__main__":
    _main(sys.argv[1])
