"""Several instances behind a router, in one deterministic event loop.

Each instance (instance.py) is a real Scheduler + KVCacheManager + SimRunner. Events sit in one
heap keyed (time, kind, sequence): ties break by kind (arrivals, KV transfers done, batch ends,
wake-ups), then by insertion order, so a run is a pure function of its inputs. One instance with
pp_size 1 reproduces `Simulation` step for step.

Prefill/decode disaggregation (`pd=(P, D)`): a request is routed to a prefill instance and runs
there with max_tokens=1; when it finishes, its prompt's cached full blocks are pinned on the
prefill instance, a decode instance (chosen by the same router policy) reserves blocks for
them, and the bytes cross that decode instance's link: `new blocks * block_size * KV bytes per
token / link bytes per second`, transfers into one instance queued FIFO on its link. A
transfer waits (FIFO) until the decode pool has room. When it is done, the decode instance
receives the request (same prompt, same output target); its admission hits the transferred
blocks in the prefix cache and computes only the prompt's last partial block before sampling
the first token (the user's first token comes from the decode instance). Needs prefix caching.

Sessions (sessions.py): a turn's completion schedules the next turn as an arrival
`delay` later, its prompt built from the finished request's tokens.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenweir.config import EngineConfig
from tokenweir.core.sched.scheduler import SchedulerStats
from tokenweir.request import Request
from tokenweir.sim.build import (GPU_MEMORY_UTILIZATION, block_size_bytes, host_pool_and_costs,
                                 pool_blocks)
from tokenweir.sim.hardware import get_hardware, get_shape
from tokenweir.sim.instance import Instance, KVImport, make_request
from tokenweir.sim.sim_engine import gc_paused
from tokenweir.sim.latency import RooflineLatencyModel
from tokenweir.sim.router import make_router
from tokenweir.sim.sessions import Session
from tokenweir.sim.simulator import RequestRecord, SimResult
from tokenweir.sim.workload import RequestSpec

ARRIVAL, TRANSFER_DONE, STEP_END, WAKE = 0, 1, 2, 3


@dataclass(slots=True)
class Job:
    """A user-visible request (one turn of a session, or one workload request)."""

    request_id: str
    arrival: float
    tokens: list[int]
    output_len: int
    priority: int = 0
    ttft_slo_ms: Optional[float] = None
    session: Optional[Session] = None
    turn: int = 0


@dataclass(slots=True)
class Handoff:
    job: Job
    prefill: Instance
    hold: Request
    decode: Instance
    ready: float  # the prefill finished
    imp: Optional[KVImport] = None
    num_bytes: int = 0
    start: float = 0.0  # the bytes started to cross the link


@dataclass(slots=True)
class TransferRecord:
    request_id: str
    prefill: int
    decode: int
    num_bytes: int
    ready: float
    start: float
    done: float


@dataclass
class ClusterResult:
    overall: SimResult  # one record per user request; steps, ITL and stats of every instance
    instances: list[SimResult]
    roles: list[str]
    routed: list[int]
    max_in_flight: list[int]
    transfers: list[TransferRecord] = field(default_factory=list)
    num_sessions: int = 0


class Cluster:
    def __init__(self, instances: list[Instance], router, specs: list[RequestSpec],
                 sessions: Optional[list[Session]] = None, decode_router=None,
                 link_bytes_per_s: float = 12.5e9, kv_bytes_per_token: int = 0) -> None:
        self.instances = instances
        self.front = [i for i in instances if i.role != "decode"]
        self.decode = [i for i in instances if i.role == "decode"]
        if not self.front:
            raise ValueError("a cluster needs at least one prefill or mixed instance")
        if any(i.role == "prefill" for i in instances) != bool(self.decode):
            raise ValueError("prefill instances and decode instances come together")
        self.router, self.decode_router = router, decode_router
        self.specs = sorted(specs, key=lambda s: (s.arrival, s.index))
        self.sessions = sorted(sessions or [], key=lambda s: (s.start, s.session_id))
        self.link_bytes_per_s = link_bytes_per_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self.records: dict[str, RequestRecord] = {}
        self.jobs: dict[str, Job] = {}
        self._prefill_of: dict[str, Instance] = {}
        self._pending: dict[int, deque[Handoff]] = {d.index: deque() for d in self.decode}
        self._link_free: dict[int, float] = {d.index: 0.0 for d in self.decode}
        self.transfers: list[TransferRecord] = []
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> ClusterResult:
        """Run to the end, the cyclic garbage collector paused as in Simulation.run (the loop
        makes no reference cycles; a test checks that a collection afterwards finds nothing)."""
        with gc_paused():
            return self._run()

    def _run(self) -> ClusterResult:
        started = time.perf_counter()
        if self.specs:
            self._push(self.specs[0].arrival, ARRIVAL, 0)
        for session in self.sessions:
            self._push(session.start, ARRIVAL, Job(
                session.request_id(0), session.start, session.first_prompt(),
                session.turns[0].output_len, session.priority, None, session, 0))
        now = 0.0
        while self._heap:
            now, kind, _, payload = heapq.heappop(self._heap)
            if kind == ARRIVAL:
                self._route(self._arrival_job(payload), now)
            elif kind == TRANSFER_DONE:
                self._transfer_done(payload, now)
            elif kind == STEP_END:
                self._step_end(payload, now)
            else:
                payload.wake_pending = False
                if payload.can_start(now):
                    self._start(payload, now)
        self._check_drained(now)
        return self._result(now, time.perf_counter() - started)

    def _arrival_job(self, payload: Any) -> Job:
        if not isinstance(payload, int):
            return payload
        spec = self.specs[payload]
        if payload + 1 < len(self.specs):
            self._push(self.specs[payload + 1].arrival, ARRIVAL, payload + 1)
        return Job(spec.request_id, spec.arrival, spec.prompt_tokens(), spec.output_len,
                   spec.priority, spec.ttft_slo_ms)

    def _poke(self, inst: Instance, now: float) -> None:
        """Something new for `inst`: start a batch at `now` if it is free. If it is not, a batch
        end or a stage-free wake-up is already queued for it."""
        if inst.can_start(now) and not inst.wake_pending:
            inst.wake_pending = True
            self._push(now, WAKE, inst)

    def _start(self, inst: Instance, now: float) -> None:
        end = inst.start_batch(now)
        if end is not None:
            self._push(end, STEP_END, inst)
            if inst.pp_size > 1:
                self._push(inst.stage0_free, WAKE, inst)  # the next micro-batch may enter
        elif inst.step_again:  # the step only preempted: its victims may be re-admitted now
            self._poke(inst, now)
        if inst.role == "decode":
            self._pump_transfers(inst, now)  # admissions released import reservations

    def _step_end(self, inst: Instance, now: float) -> None:
        for eco in inst.finish_batch(now):
            if eco.finish_reason is None:
                continue
            if inst.role == "prefill":
                self._hand_off(inst, eco.request, now)
            else:
                self._complete(inst, eco.request, now)
        if inst.can_start(now):
            self._start(inst, now)
        elif inst.role == "decode":
            self._pump_transfers(inst, now)

    def _check_drained(self, now: float) -> None:
        for inst in self.instances:
            if inst.scheduler.has_unfinished_requests():
                raise RuntimeError(
                    f"simulation stalled at t={now:.3f}s: instance {inst.index} ({inst.role}) "
                    f"has {inst.scheduler.num_waiting} waiting and {inst.scheduler.num_running} "
                    f"running requests that cannot be scheduled")
        for index, queue in self._pending.items():
            if queue:
                raise RuntimeError(
                    f"simulation stalled at t={now:.3f}s: {len(queue)} KV transfers to decode "
                    f"instance {index} never found room in its pool")

    # ---- requests ----------------------------------------------------------------------------
    def _route(self, job: Job, now: float) -> None:
        self.jobs[job.request_id] = job
        self.records[job.request_id] = RequestRecord(
            job.request_id, now, len(job.tokens), job.output_len, job.priority, job.ttft_slo_ms)
        inst = self.front[self.router.choose(job.tokens, [i.load for i in self.front])]
        inst.num_routed += 1
        output_len = 1 if inst.role == "prefill" else job.output_len
        inst.add_request(make_request(job.request_id, job.tokens, output_len, inst.max_model_len,
                                      now, job.priority, job.ttft_slo_ms),
                         output_len, job.ttft_slo_ms)
        if inst.role == "prefill":
            self._prefill_of[job.request_id] = inst
        self._poke(inst, now)

    def _complete(self, inst: Instance, request: Request, now: float) -> None:
        """The user's request is done (on a mixed or a decode instance)."""
        rid = request.request_id
        job = self.jobs.pop(rid)
        done, user = inst.records[rid], self.records[rid]
        first = self._prefill_of.pop(rid, None)
        start = first.records[rid] if first is not None else done
        user.first_scheduled = start.first_scheduled
        user.num_cached_tokens = start.num_cached_tokens
        user.num_preemptions = done.num_preemptions + (
            start.num_preemptions if start is not done else 0)
        user.first_token, user.finished = done.first_token, now
        user.num_output, user.finish_reason = done.num_output, done.finish_reason
        user.num_finishes += 1
        session = job.session
        if session is not None and job.turn + 1 < len(session.turns):
            turn = job.turn + 1
            self._push(now + session.turns[turn].delay, ARRIVAL, Job(
                session.request_id(turn), now + session.turns[turn].delay,
                session.next_prompt(turn, request.all_token_ids),
                session.turns[turn].output_len, session.priority, None, session, turn))

    # ---- prefill -> decode hand-over ---------------------------------------------------------
    def _hand_off(self, prefill: Instance, request: Request, now: float) -> None:
        job = self.jobs[request.request_id]
        hold = prefill.hold_prefix(job.tokens)
        loads = [d.load + len(self._pending[d.index]) for d in self.decode]
        decode = self.decode[self.decode_router.choose(job.tokens, loads)]
        decode.num_routed += 1
        self._pending[decode.index].append(Handoff(job, prefill, hold, decode, now))
        self._pump_transfers(decode, now)

    def _pump_transfers(self, decode: Instance, now: float) -> None:
        """Start queued transfers into `decode`, in order, while its pool has room."""
        queue = self._pending[decode.index]
        while queue:
            h = queue[0]
            imp = decode.reserve_import(h.job.request_id, h.job.tokens, h.job.output_len)
            if imp is None:
                return
            queue.popleft()
            h.imp = imp
            h.num_bytes = imp.num_new_blocks * decode.kv.block_size * self.kv_bytes_per_token
            h.start = max(now, self._link_free[decode.index])
            done = h.start + h.num_bytes / self.link_bytes_per_s
            self._link_free[decode.index] = done
            self._push(done, TRANSFER_DONE, h)

    def _transfer_done(self, h: Handoff, now: float) -> None:
        job, decode = h.job, h.decode
        decode.complete_import(h.imp)
        h.prefill.release(h.hold)
        self.transfers.append(TransferRecord(job.request_id, h.prefill.index, decode.index,
                                             h.num_bytes, h.ready, h.start, now))
        decode.add_request(make_request(job.request_id, job.tokens, job.output_len,
                                        decode.max_model_len, now, job.priority,
                                        job.ttft_slo_ms),
                           job.output_len, job.ttft_slo_ms)
        self._poke(decode, now)
        self._poke(h.prefill, now)  # its pinned blocks are free again

    # ---- results -----------------------------------------------------------------------------
    def _result(self, end: float, wall: float) -> ClusterResult:
        per_instance = [SimResult(list(i.records.values()), i.steps, i.itl, i.scheduler.stats,
                                  end, wall, i.kv.prefix_stats.hits, i.kv.prefix_stats.queries)
                        for i in self.instances]
        itl = array("d")
        for r in per_instance:
            itl.extend(r.itl)
        front = [r for r, i in zip(per_instance, self.instances) if i.role != "decode"]
        overall = SimResult(list(self.records.values()),
                            [s for r in per_instance for s in r.steps], itl,
                            _sum_stats(r.stats for r in per_instance), end, wall,
                            sum(r.prefix_hit_tokens for r in front),
                            sum(r.prefix_query_tokens for r in front))
        return ClusterResult(overall, per_instance, [i.role for i in self.instances],
                             [i.num_routed for i in self.instances],
                             [i.max_in_flight for i in self.instances], self.transfers,
                             len(self.sessions))


def _sum_stats(all_stats) -> SchedulerStats:
    """Field-wise sum of the instances' counters (dicts summed per key, lists per element)."""
    total = SchedulerStats()
    for stats in all_stats:
        for f in dataclasses.fields(SchedulerStats):
            setattr(total, f.name, _add(getattr(total, f.name), getattr(stats, f.name)))
    return total


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k))
                for k in {**a, **b}}
    if isinstance(a, list):
        return [x + y for x, y in zip(a, b)] + a[len(b):] + b[len(a):]
    return a + b


# ---- building ------------------------------------------------------------------------------
def cluster_pool_blocks(config: EngineConfig, kwargs: dict[str, Any],
                        model: RooflineLatencyModel, pp_size: int) -> int:
    """KV blocks per instance: as `build.pool_blocks`, over tp * pp devices when the size is not
    given explicitly (pipeline stages each hold 1/pp of the weights and of the KV)."""
    if pp_size == 1 or config.cache.num_gpu_blocks_override is not None \
            or "kv_cache_space" in kwargs:
        return pool_blocks(config, kwargs, model)
    hw, shape = model.hardware, model.shape
    block_bytes = block_size_bytes(config, model)
    free = (hw.memory_bytes * model.tp * pp_size * GPU_MEMORY_UTILIZATION
            - shape.num_matmul_params * hw.dtype_bytes)
    if free <= block_bytes:
        raise ValueError(f"{shape.name} weights do not fit {model.tp * pp_size} x {hw.name}")
    return int(free // block_bytes) + 1


def parse_pd(text: Optional[str]) -> Optional[tuple[int, int]]:
    """'P:D' -> (P, D), both >= 1; None or '' -> None."""
    if not text:
        return None
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"bad --pd {text!r}: use P:D, e.g. 1:3") from None
    if p < 1 or d < 1:
        raise ValueError(f"bad --pd {text!r}: need at least one prefill and one decode instance")
    return p, d


def build_cluster(kwargs: dict[str, Any], specs: list[RequestSpec],
                  model_shape: str = "llama-7b", hardware: str = "h100", tp: int = 1,
                  pp_size: int = 1, num_instances: int = 1, router: str = "round-robin",
                  pd: Optional[tuple[int, int]] = None, link_gbps: float = 100.0,
                  sessions: Optional[list[Session]] = None,
                  latency_model: Optional[RooflineLatencyModel] = None,
                  record_steps: bool = True, record_itl_times: bool = False,
                  check: bool = False) -> Cluster:
    kwargs = {k: v for k, v in kwargs.items() if k != "model"}
    config = EngineConfig.from_kwargs(**kwargs)
    shape = get_shape(model_shape)
    model = latency_model or RooflineLatencyModel(shape, get_hardware(hardware), tp)
    if num_instances < 1:
        raise ValueError(f"num_instances must be >= 1, got {num_instances}")
    if link_gbps <= 0:
        raise ValueError(f"link_gbps must be positive, got {link_gbps}")
    if pd is not None and not config.cache.enable_prefix_caching:
        raise ValueError("prefill/decode disaggregation hands KV over through the prefix "
                         "cache: enable prefix caching")
    roles = ["prefill"] * pd[0] + ["decode"] * pd[1] if pd else ["mixed"] * num_instances
    max_model_len = config.model.max_model_len or shape.max_position_embeddings
    num_host_blocks, costs = host_pool_and_costs(config, model)
    num_blocks = cluster_pool_blocks(config, kwargs, model, pp_size)
    instances = [Instance(i, config, model, num_blocks, max_model_len, role, num_host_blocks,
                          costs, pp_size, record_steps, record_itl_times, check)
                 for i, role in enumerate(roles)]
    bs = config.cache.block_size
    num_front = sum(1 for r in roles if r != "decode")
    return Cluster(instances, make_router(router, num_front, bs), specs, sessions,
                   make_router(router, len(roles) - num_front, bs) if pd else None,
                   link_gbps * 1e9 / 8, shape.kv_bytes_per_token(model.hardware.dtype_bytes))


# ---- reporting -----------------------------------------------------------------------------
def summarize_cluster(result: ClusterResult, ttft_slo_ms: Optional[float] = None,
                      tpot_slo_ms: Optional[float] = None) -> dict:
    """{'overall': metrics over user requests, 'instances': one metrics dict per instance}."""
    from tokenweir.sim.metrics import summarize

    overall = summarize(result.overall, ttft_slo_ms, tpot_slo_ms)
    overall["num_instances"] = len(result.instances)
    overall["num_sessions"] = result.num_sessions
    if result.transfers:
        waits = [t.done - t.ready for t in result.transfers]
        overall["kv_transfers"] = len(result.transfers)
        overall["kv_transfer_gb"] = sum(t.num_bytes for t in result.transfers) / 1e9
        overall["kv_handoff_mean_ms"] = sum(waits) / len(waits) * 1000
    instances = []
    for i, r in enumerate(result.instances):
        metrics = summarize(r, ttft_slo_ms, tpot_slo_ms)
        instances.append({"instance": i, "role": result.roles[i], "routed": result.routed[i],
                          "max_in_flight": result.max_in_flight[i], **metrics})
    return {"overall": overall, "instances": instances}


INSTANCE_COLUMNS = (("instance", "{}"), ("role", "{}"), ("routed", "{}"),
                    ("num_steps", "{}"), ("preemptions", "{}"), ("max_in_flight", "{}"),
                    ("ttft_p50_ms", "{:.1f}"), ("itl_p99_ms", "{:.2f}"),
                    ("kv_usage_mean", "{:.3f}"), ("prefix_hit_rate", "{:.3f}"))


def format_instance_table(instances: list[dict]) -> str:
    header = "  ".join(f"{name:>14s}" for name, _ in INSTANCE_COLUMNS)
    rows = [header]
    for m in instances:
        cells = [fmt.format(m.get(name, float("nan"))) for name, fmt in INSTANCE_COLUMNS]
        rows.append("  ".join(f"{c:>14s}" for c in cells))
    return "\n".join(rows)


def cluster_result_json(result: ClusterResult) -> str:
    """Everything a run decided (records, steps, gaps, transfers), without wall-clock time:
    two runs of the same inputs give the same bytes."""
    body = {"requests": [dataclasses.asdict(r) for r in result.overall.requests],
            "instances": [{"requests": [dataclasses.asdict(x) for x in r.requests],
                           "steps": [dataclasses.asdict(s) for s in r.steps],
                           "itl": list(r.itl), "stats": dataclasses.asdict(r.stats)}
                          for r in result.instances],
            "routed": result.routed, "max_in_flight": result.max_in_flight,
            "transfers": [dataclasses.asdict(t) for t in result.transfers],
            "end": result.overall.end_time}
    return json.dumps(body, sort_keys=True)
