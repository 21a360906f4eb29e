"""The tensor-parallel executor: this process is rank 0 and drives tp_size - 1 worker processes.

The scheduler stays in the driver. Each step the driver sends the `SchedulerOutput` (pickled over
a private socket pair per worker), then runs the same step itself; every rank runs its shard
(`TPModelRunner`), rank 0 samples, and each worker answers with a structured status (see
`tokenweir.parallel.worker`). `execute` returns rank 0's `ModelRunnerOutput` (with `cut` set
when the collective vote cut the step, on every rank before the same layer: checked against
the workers' statuses) and raises `TPWorkerError` for anything else (a crash, a silent worker,
ranks that disagree); after that error the executor is closed.

The executor stands in for a `ModelRunner` in the engine: `execute`, `cut_signal`,
`measure_preemption_costs`, `measure_ttft_line`.

Only one executor (one default process group) can live in a process at a time. Workers are
started with `python -m tokenweir.parallel.worker`, so scripts need no `__main__` guard.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, Pipe
from typing import Any, Optional

import torch
import torch.distributed as dist

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.model.llama import CausalLM
from tokenweir.parallel.sharding import check_shardable, shard_model
from tokenweir.parallel.tp_runner import TPModelRunner
from tokenweir.parallel.vote import ShouldCut, SignalVote
from tokenweir.parallel.worker import WorkerSpec, backend_for, rank_device
from tokenweir.runner.interrupt import CutSignal

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class TPWorkerError(RuntimeError):
    """A worker failed (crashed, raised, or disagreed about a cut); the group is unusable."""


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: Connection


class TPExecutor:
    def __init__(self, full_model: CausalLM, model_path: str, tp_size: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device,
                 eos_token_ids: frozenset[int], seed: int = 0, num_host_blocks: int = 0,
                 timeout_s: float = 60.0, num_threads: Optional[int] = None) -> None:
        """`full_model` is rank 0's source of weights (sharded here, shared where replicated);
        workers load `model_path` themselves with the same dtype. `timeout_s` bounds every
        collective and every wait for a worker's answer."""
        check_shardable(full_model.arch, tp_size)
        if tp_size < 2:
            raise ValueError("TPExecutor needs tensor_parallel_size >= 2")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed group already exists in this process: "
                               "only one tensor-parallel engine can run per process")
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.should_cut: Optional[ShouldCut] = None  # the driver's local vote (SLO monitor)
        self._cut_signal: Optional[CutSignal] = None
        self.last_statuses: list[dict[str, Any]] = []  # the workers' answers to the last step
        self.workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, timeout_s)
        try:
            spec = self._spec(model_path, dtype, device, num_blocks, block_size, eos_token_ids,
                              seed, num_host_blocks, num_threads)
            self._start(spec)
            device = rank_device(device.type, 0)
            model = shard_model(full_model, 0, tp_size)
            self.runner = TPModelRunner(model, model.arch, num_blocks, block_size, dtype,
                                        device, eos_token_ids, seed,
                                        num_host_blocks=num_host_blocks, rank=0)
            self._expect_all("ready")
        except BaseException:
            self.close()
            raise

    # ---- life cycle --------------------------------------------------------------------
    def _spec(self, model_path, dtype, device, num_blocks, block_size, eos_token_ids, seed,
              num_host_blocks, num_threads) -> WorkerSpec:
        if not model_path:
            raise ValueError("tensor parallelism needs the model's path (workers load it)")
        self._store = dist.TCPStore("127.0.0.1", 0, self.tp_size, is_master=True,
                                    wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout_s))
        threads = num_threads or max(1, torch.get_num_threads() // self.tp_size)
        return WorkerSpec(model_path=model_path, dtype=_DTYPE_NAMES[dtype],
                          device_type=device.type, tp_size=self.tp_size,
                          store_host="127.0.0.1", store_port=self._store.port,
                          timeout_s=self.timeout_s, num_threads=threads, num_blocks=num_blocks,
                          block_size=block_size, eos_token_ids=frozenset(eos_token_ids),
                          seed=seed, num_host_blocks=num_host_blocks)

    def _start(self, spec: WorkerSpec) -> None:
        """Launch the workers, hand them the spec, and join the group as rank 0."""
        for rank in range(1, self.tp_size):
            ours, theirs = Pipe(duplex=True)
            cmd = [sys.executable, "-m", "tokenweir.parallel.worker", "--rank", str(rank),
                   "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())]
            process = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
            theirs.close()
            self.workers.append(_Worker(rank, process, ours))
            ours.send(spec)
        dist.init_process_group(backend_for(spec.device_type), store=self._store, rank=0,
                                world_size=self.tp_size,
                                timeout=timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        """Stop the workers (killing any that do not exit in time) and leave the group.
        Idempotent; also runs when the executor is garbage-collected or at exit."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ---- steps -------------------------------------------------------------------------
    def set_worker_should_cut(self, rank: int, should_cut: Optional[ShouldCut]) -> None:
        """Install a (picklable) local vote on worker `rank`; None: never vote to cut."""
        worker = self.workers[rank - 1]
        worker.conn.send(("set_should_cut", should_cut))
        self._check(worker, self._receive(worker), "ok")

    @property
    def cut_signal(self) -> Optional[CutSignal]:
        return self._cut_signal

    @cut_signal.setter
    def cut_signal(self, signal: Optional[CutSignal]) -> None:
        """Set by the engine under the slo policy (as on ModelRunner): from then on every step
        holds the collective vote, rank 0 voting from the signal's orders."""
        self._cut_signal = signal
        self.should_cut = None if signal is None else SignalVote(signal)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank. A vote is held at every layer boundary when the driver
        has a `should_cut`; workers then vote with their own (default: never). A cut step
        returns rank 0's output with `cut` set; every worker's status is in `last_statuses`."""
        if self.closed:
            raise TPWorkerError("the tensor-parallel executor is closed")
        vote = self.should_cut is not None
        for worker in self.workers:
            worker.conn.send(("execute", out, vote))
        try:
            result = self.runner.execute_step(out, self.should_cut)
        except Exception as exc:
            self._fail(f"rank 0 failed in step {out.step_id}: {exc!r}", exc)
        self.last_statuses = [self._receive(worker) for worker in self.workers]
        self._check_step(out.step_id, result, self.last_statuses)
        return result

    def measure_preemption_costs(self) -> PreemptionCosts:
        return self._measure("measure_preemption_costs")

    def measure_ttft_line(self) -> tuple[float, float]:
        return self._measure("measure_ttft_line")

    def _measure(self, method: str):
        """Rank 0's result of a timed measurement every rank runs in lockstep."""
        for worker in self.workers:
            worker.conn.send(("measure", method))
        result = getattr(self.runner, method)()
        for worker in self.workers:
            self._check(worker, self._receive(worker), "ok")
        return result

    # ---- statuses ----------------------------------------------------------------------
    def _check_step(self, step_id: int, result: ModelRunnerOutput,
                    statuses: list[dict[str, Any]]) -> None:
        """Every worker must agree with rank 0: all ran the step, or all were cut before the
        same layer. Anything else closes the executor."""
        cut = result.cut
        expected = "ok" if cut is None else "cut"
        for worker, status in zip(self.workers, statuses):
            self._check(worker, status, expected)
            if cut is not None and status["layer"] != cut.layer_index:
                self._fail(f"step {step_id}: rank 0 was cut before layer {cut.layer_index}, "
                           f"rank {worker.rank} before layer {status['layer']}")

    def _check(self, worker: _Worker, status: dict[str, Any], expected: str) -> None:
        if status.get("status") != expected:
            detail = status.get("traceback") or status.get("message") or status
            self._fail(f"rank {worker.rank} answered {status.get('status')!r} where "
                       f"{expected!r} was expected: {detail}")

    def _receive(self, worker: _Worker) -> dict[str, Any]:
        """The worker's next status; a dead or silent worker becomes a status too."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if worker.conn.poll(0.05):
                    return worker.conn.recv()
            except (EOFError, OSError):
                return _exit_status(worker)
        return {"status": "error", "message": f"no answer within {self.timeout_s} s"}

    def _expect_all(self, expected: str) -> None:
        for worker in self.workers:
            self._check(worker, self._receive(worker), expected)

    def _fail(self, message: str, cause: Optional[BaseException] = None):
        """Collect what the workers say, close the group, and raise TPWorkerError."""
        notes = []
        if cause is not None:  # rank 0 failed first: the workers' answers say why
            self.last_statuses = [self._receive_quickly(worker) or {"status": "silent"}
                                  for worker in self.workers]
            notes = [f"rank {worker.rank}: {status.get('message')}"
                     for worker, status in zip(self.workers, self.last_statuses)
                     if status.get("status") == "error"]
        self.close()
        raise TPWorkerError("; ".join([message, *notes])) from cause

    def _receive_quickly(self, worker: _Worker) -> Optional[dict[str, Any]]:
        try:
            return worker.conn.recv() if worker.conn.poll(1.0) else None
        except (EOFError, OSError):
            return None


def _exit_status(worker: _Worker) -> dict[str, Any]:
    """The status of a worker whose connection closed without an answer."""
    try:
        code = worker.process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        code = None
    return {"status": "error", "message": f"worker closed its connection (exit code {code})"}


def _shutdown(workers: list[_Worker], timeout_s: float) -> None:
    """Ask each worker to exit, kill those that do not within a few seconds, leave the
    group. Must not reference the executor (it runs from a weakref finalizer)."""
    for worker in workers:
        try:
            worker.conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
    for worker in workers:
        try:
            worker.process.wait(timeout=min(5.0, timeout_s))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
        worker.conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
