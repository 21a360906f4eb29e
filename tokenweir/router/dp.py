"""`tokenweir serve --data-parallel-size N`: N replicas of the engine, each a process of its
own (`tokenweir serve` on a free loopback port) on cores of its own (this process's cores cut
into N equal shares, one torch thread per core of the share, the process pinned to it, so that
no replica's threads run on another's cores; with fewer cores than replicas, one thread each,
unpinned), and the router in front on the --host/--port the user gave.

The router starts once every replica answers /health (a replica that exits first ends the
command). On SIGINT/SIGTERM the router stops taking requests, then each replica is sent
SIGTERM and drains as a lone `tokenweir serve` would.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
import time
from typing import Optional

import httpx

from tokenweir.router.cli import router_config, serve_router

READY_TIMEOUT_S = 900.0  # a first kernel build on a busy machine, then loading the weights


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_data_parallel(args: argparse.Namespace) -> int:
    size = args.data_parallel_size
    shares = core_shares(sorted(os.sched_getaffinity(0)), size)
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no torch state shared
    replicas: list[tuple[multiprocessing.Process, str]] = []
    try:
        for cores in shares:
            port = free_port()
            replica_args = argparse.Namespace(**{**vars(args), "port": port,
                                                 "host": "127.0.0.1", "data_parallel_size": 1})
            process = context.Process(target=_replica_main, args=(replica_args, cores),
                                      daemon=False)
            process.start()
            replicas.append((process, f"http://127.0.0.1:{port}"))
        _wait_ready(replicas)
        config = router_config(args, replicas=tuple(url for _, url in replicas),
                               routing_policy=args.routing_policy, host=args.host,
                               port=args.port, log_level=args.log_level,
                               max_request_body_bytes=args.max_request_body_bytes)
        return serve_router(config)
    finally:
        _stop(replicas, args.drain_timeout)


def core_shares(cores: list[int], size: int) -> list[Optional[list[int]]]:
    """Each replica's cores: `size` equal, disjoint shares of `cores` (the remainder unused);
    None for every replica when there are fewer cores than replicas."""
    share = len(cores) // size
    if share == 0:
        return [None] * size
    return [cores[i * share:(i + 1) * share] for i in range(size)]


def _replica_main(args: argparse.Namespace, cores: Optional[list[int]]) -> None:
    """A replica process: pinned to `cores` with one torch thread each (one thread, unpinned,
    when None) before torch loads; it is sent SIGTERM if the parent dies without stopping it
    (Linux)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores) if cores else 1)
    _die_with_parent()
    from tokenweir.server.cli import run_serve

    raise SystemExit(run_serve(args))


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's finally still stops the replicas


def _wait_ready(replicas: list[tuple[multiprocessing.Process, str]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(replicas)
    while pending:
        process, url = pending[0]
        if process.exitcode is not None:
            raise SystemExit(f"tokenweir serve: replica {url} exited ({process.exitcode}) "
                             "before it was ready")
        try:
            if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"tokenweir serve: replica {url} not ready after "
                             f"{READY_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


def _stop(replicas: list[tuple[multiprocessing.Process, str]], drain_timeout: float) -> None:
    for process, _ in replicas:
        if process.exitcode is None and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    for process, _ in replicas:
        process.join(drain_timeout + 10)
        if process.exitcode is None:
            process.kill()
            process.join()
