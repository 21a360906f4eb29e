"""Simulator points as Ray tasks (`tokenweir sweep --ray [ADDRESS]`, `tokenweir study ...
--ray [ADDRESS]`): one task per configuration point, on a local Ray started on demand or on
the cluster at ADDRESS, with a progress bar.

Contracts:
- The results are those of the serial run, in the jobs' order: a point is a pure function of
  its job (the simulator is deterministic), and nothing here changes a job.
- A point that raises is reported (its index, its job's first element, the error) and stands
  as a `FailedPoint` in its place; every other point still runs and is returned.
- Ray is optional (`pip install 'tokenweir[ray]'`): without it, `--ray` says how to install it.
- An ADDRESS (host:port) where nothing listens is refused at once (ValueError), before Ray's
  own connection retries would wait for minutes.
- `fn` must be a module-level function (Ray ships it by reference); on a remote cluster the
  workers need tokenweir importable (the same version).
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

LOCAL = "local"  # the flag's value when given without an address
CONNECT_TIMEOUT_S = 10.0  # how long ADDRESS has to accept a connection
INSTALL_HINT = ("--ray needs Ray: pip install 'tokenweir[ray]' (or pip install ray), "
                "or leave --ray out to run the points in local processes")


@dataclass(frozen=True)
class FailedPoint:
    index: int
    error: str


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return ray


def ray_map(fn: Callable, jobs: Sequence[Any], address: str, desc: str = "points") -> list:
    """[fn(job) for job in jobs] as Ray tasks; a failed point is a FailedPoint."""
    from tqdm import tqdm

    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        check_reachable(address)
        ray.init(address=None if address == LOCAL else address, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
    try:
        task = ray.remote(_run_point)
        pending = {task.remote(fn, job): i for i, job in enumerate(jobs)}
        results: list = [None] * len(jobs)
        with tqdm(total=len(jobs), desc=f"{desc} (ray)", file=sys.stderr, leave=False) as bar:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    index = pending.pop(ref)
                    results[index] = _result(ray, ref, index, jobs[index])
                    bar.update()
        return results
    finally:
        if started_here:
            ray.shutdown()


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """ValueError at once when ADDRESS is host:port and nothing listens there (ray.init
    would retry its connection for minutes); other forms (local, auto, ray://) pass."""
    host, _, port = address.rpartition(":")
    if address == LOCAL or "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(f"--ray {address}: no Ray cluster answers there ({exc}); start one "
                         "with `ray start --head`, or leave the address out for a local "
                         "Ray") from None


def _run_point(fn: Callable, job: Any) -> Any:
    return fn(job)


def _result(ray, ref, index: int, job: Any) -> Any:
    try:
        return ray.get(ref)
    except Exception as exc:  # noqa: BLE001 - a point's failure is reported, not fatal
        cause = getattr(exc, "cause", None) or exc
        failed = FailedPoint(index, f"{type(cause).__name__}: {cause}")
        print(f"point {index} ({_label(job)}) failed: {failed.error}", file=sys.stderr)
        return failed


def _label(job: Any) -> str:
    head = job[0] if isinstance(job, tuple) and job else job
    return str(head)[:120]


def succeeded(results: Sequence[Any]) -> list:
    """The results that are not FailedPoints."""
    return [r for r in results if not isinstance(r, FailedPoint)]


def failures(results: Sequence[Any]) -> list[FailedPoint]:
    return [r for r in results if isinstance(r, FailedPoint)]
