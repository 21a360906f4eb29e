"""A tensor-parallel worker process (rank >= 1): `python -m tokenweir.parallel.worker`.

Started by `TPExecutor` with one end of a private socket pair as `--fd`. Protocol on that
connection (pickled tuples in, status dicts out, strictly one reply per request):

    <- WorkerSpec                      -> {"status": "ready"}            (after loading)
    <- ("execute", SchedulerOutput, vote: bool)
                                       -> {"status": "ok", "step_id": s}
                                        | {"status": "cut", "step_id": s, "layer": i}
                                        | {"status": "error", "step_id": s, "message", "traceback"}
    <- ("set_should_cut", ShouldCut)   -> {"status": "ok"}
    <- ("measure", method_name)        -> {"status": "ok", "result": <the method's result>}
    <- ("shutdown",)                   -> {"status": "ok"}, then exit

A cut is reported as a status, never as an exception type. After an error the worker exits at
once: its sockets close, so the other ranks' pending collectives fail instead of waiting for
the group timeout. The worker also exits when the driver goes away (EOF on the connection, or
a watchdog thread noticing that its parent process is gone).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tokenweir.malloc_tuning import tune_malloc
from tokenweir.parallel.vote import ShouldCut, never_cut

# Runner methods the driver may ask every rank to run in lockstep (timed forwards).
MEASUREMENTS = ("measure_preemption_costs", "measure_ttft_line")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank's runner (sent once, pickled)."""

    model_path: str
    dtype: str  # a key of _DTYPES
    device_type: str  # "cpu" or "cuda" (rank r uses cuda:r)
    tp_size: int
    store_host: str
    store_port: int
    timeout_s: float
    num_threads: int
    num_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    seed: int
    num_host_blocks: int


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def join_group(spec: WorkerSpec, rank: int) -> None:
    """Join the default process group through the driver's TCPStore."""
    store = dist.TCPStore(spec.store_host, spec.store_port, spec.tp_size, is_master=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    dist.init_process_group(backend_for(spec.device_type), store=store, rank=rank,
                            world_size=spec.tp_size, timeout=timedelta(seconds=spec.timeout_s))


def build_runner(spec: WorkerSpec, rank: int):
    from tokenweir.model.loader import load_model
    from tokenweir.parallel.sharding import shard_model
    from tokenweir.parallel.tp_runner import TPModelRunner

    device = rank_device(spec.device_type, rank)
    loaded = load_model(spec.model_path, _DTYPES[spec.dtype], device, pack=False)  # sharded next
    model = shard_model(loaded.model, rank, spec.tp_size)
    return TPModelRunner(model, model.arch, spec.num_blocks, spec.block_size,
                         _DTYPES[spec.dtype], device, spec.eos_token_ids, spec.seed,
                         num_host_blocks=spec.num_host_blocks, rank=rank)


def _execute(runner, conn: Connection, out, should_cut: ShouldCut | None) -> None:
    try:
        result = runner.execute_step(out, should_cut)
    except BaseException as exc:  # noqa: BLE001 - reported, then the process leaves
        conn.send({"status": "error", "step_id": out.step_id, "message": repr(exc),
                   "traceback": traceback.format_exc()})
        os._exit(1)
    if result.cut is not None:
        conn.send({"status": "cut", "step_id": out.step_id, "layer": result.cut.layer_index})
    else:
        conn.send({"status": "ok", "step_id": out.step_id})


def serve(runner, conn: Connection) -> None:
    """Answer requests until shutdown or until the driver disappears."""
    should_cut: ShouldCut = never_cut
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - e.g. a request that does not unpickle here
            conn.send({"status": "error", "message": f"unreadable request: {exc!r}"})
            os._exit(1)
        kind = request[0]
        if kind == "execute":
            _, out, vote = request
            _execute(runner, conn, out, should_cut if vote else None)
        elif kind == "set_should_cut":
            should_cut = request[1] or never_cut
            conn.send({"status": "ok"})
        elif kind == "measure" and request[1] in MEASUREMENTS:
            conn.send({"status": "ok", "result": getattr(runner, request[1])()})
        elif kind == "shutdown":
            conn.send({"status": "ok"})
            return
        else:
            conn.send({"status": "error", "message": f"unknown request {kind!r}"})


def _die_with_parent(parent_pid: int, period_s: float = 1.0) -> None:
    """Exit when the driver process is gone (re-parented), even while stuck in a collective.

    A watchdog thread, not PR_SET_PDEATHSIG: Linux sends that signal when the *thread* that
    started the worker exits, and drivers may well start executors from short-lived threads."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=watch, name="tokenweir-tp-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    conn = Connection(args.fd)
    spec: WorkerSpec = conn.recv()
    torch.set_num_threads(spec.num_threads)
    if spec.device_type == "cpu":
        tune_malloc()  # as the engine process does (tokenweir/malloc_tuning.py)
    try:
        join_group(spec, args.rank)
        runner = build_runner(spec, args.rank)
    except BaseException as exc:  # noqa: BLE001
        conn.send({"status": "error", "message": repr(exc), "traceback": traceback.format_exc()})
        os._exit(1)
    conn.send({"status": "ready"})
    serve(runner, conn)
    dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    main()
