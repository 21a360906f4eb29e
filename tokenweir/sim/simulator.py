"""The simulator's one event loop: instances behind a router on a virtual clock.

Each instance (instance.py) is a real Scheduler + KVCacheManager + SimRunner; one instance is
simply a cluster of one (`Simulation` builds that). Events (events.py) are typed and ordered
(time, kind, sequence), so a run is a pure function of its inputs.

The engine loop of an instance: something new for an idle instance (an arrival, a KV import,
preempted victims to re-admit) queues a wake-up at the same instant, so every request arriving
at that instant joins the first step; a wake-up or a step end starts the next step, whose end
lands `step_seconds` later (through the pipeline stages when pp_size > 1); at a step's end
`update_from_output` runs with `now` = that end time. What a step does is SimEngine's
(sim_engine.py); this file only decides when steps start and end, and where requests go.

A request added to an instance while a step runs there is shown to that instance's SLO cutter
(slo policy, mid-step cuts), which also looks as a step with a prefill chunk begins and then
on its monitor's timer while it runs (Poll events, every POLL_SECONDS from its last look): a
cut replaces the step's end with an earlier one.

Prefill/decode disaggregation (`pd=(P, D)`, disagg.py): a request is routed to a prefill
instance and runs there with max_tokens=1; when it finishes, a decode instance (chosen by the
same router policy) reserves blocks for its prompt's full blocks and the bytes cross that
instance's link. When they are done, the decode instance receives the request (same prompt,
same output target); its admission hits the transferred blocks in the prefix cache and
computes only the prompt's last partial block before sampling the first token (the user's
first token comes from the decode instance). Needs prefix caching.

Sessions (sessions.py): a turn's completion schedules the next turn as an arrival `delay`
later, its prompt built from the finished request's tokens.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from tokenweir.core.outputs import SchedulerStats
from tokenweir.request import Request
from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.disagg import Handoff, KVLinks, TransferRecord
from tokenweir.sim.events import (Arrival, EventKind, EventQueue, Poll, StepEnd, TransferDone,
                                  Wake)
from tokenweir.sim.instance import Instance
from tokenweir.routing import RoundRobinRouter
from tokenweir.sim.sessions import Session
from tokenweir.sim.setup import EngineSetup, Recording
from tokenweir.sim.sim_engine import RequestRecord, StepRecord, gc_paused, make_request
from tokenweir.sim.slo_cuts import SimStepCutter
from tokenweir.sim.workload import RequestSpec

ARRIVAL, TRANSFER_DONE, STEP_END, WAKE, POLL = (
    EventKind.ARRIVAL, EventKind.TRANSFER_DONE, EventKind.STEP_END, EventKind.WAKE,
    EventKind.POLL)


@dataclass
class SimResult:
    requests: list[RequestRecord]
    steps: list[StepRecord]
    # Every inter-token gap (seconds), over all requests: in order (array), or as exact
    # value -> count (ValueCounts, Simulation(itl_counts=True); memory grows with steps only).
    itl: Union[array, ValueCounts]
    stats: SchedulerStats
    end_time: float
    wall_seconds: float
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class ClusterResult:
    overall: SimResult  # one record per user request; steps, ITL and stats of every instance
    instances: list[SimResult]
    roles: list[str]
    routed: list[int]
    max_in_flight: list[int]
    transfers: list[TransferRecord] = field(default_factory=list)
    num_sessions: int = 0


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


class Simulator:
    """The event loop over `instances` (roles mixed, or prefill + decode): user requests from
    `specs` and `sessions` go to the front instances through `router`; PD hand-offs go to the
    decode instances through `decode_router` over links of `link_bytes_per_s`."""

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
        # The front instances' request maps, whose sizes are their loads (`_front_loads`).
        self._front_requests = [i.scheduler.requests for i in self.front]
        self.specs = sorted(specs, key=lambda s: (s.arrival, s.index))
        self.sessions = sorted(sessions or [], key=lambda s: (s.start, s.session_id))
        self.links = KVLinks(self.decode, link_bytes_per_s, kv_bytes_per_token)
        self.records: dict[str, RequestRecord] = {}  # per user request
        self.jobs: dict[str, Job] = {}
        self._prefill_of: dict[str, Instance] = {}
        self.events = EventQueue()

    @property
    def transfers(self) -> list[TransferRecord]:
        return self.links.transfers

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> ClusterResult:
        """Run to the end. The cyclic garbage collector is paused meanwhile: the loop makes no
        reference cycles (tests check that a collection afterwards finds nothing), and at
        100k requests the collector's passes over the growing heap cost ~10% of the run."""
        with gc_paused():
            return self._run()

    def _run(self) -> ClusterResult:
        started = time.perf_counter()
        self._queue_first_arrivals()
        by_kind = {ARRIVAL: self._on_arrival, TRANSFER_DONE: self._on_transfer_done,
                   STEP_END: self._on_step_end, WAKE: self._on_wake, POLL: self._on_poll}
        now = self.events.run([by_kind[kind] for kind in sorted(EventKind)])  # by kind
        self._check_drained(now)
        return self._result(now, time.perf_counter() - started)

    def _queue_first_arrivals(self) -> None:
        """The workload's first request (each one queues the next: the heap stays small) and
        every session's first turn."""
        if self.specs:
            self.events.push(self.specs[0].arrival, ARRIVAL, Arrival(0))
        for session in self.sessions:
            self.events.push(session.start, ARRIVAL, Arrival(job=Job(
                session.request_id(0), session.start, session.first_prompt(),
                session.turns[0].output_len, session.priority, None, session, 0)))

    def _on_arrival(self, event: Arrival, now: float) -> None:
        job = event.job
        if job is None:
            index = event.spec_index
            spec = self.specs[index]
            if index + 1 < len(self.specs):
                self.events.push(self.specs[index + 1].arrival, ARRIVAL, Arrival(index + 1))
            job = Job(spec.request_id, spec.arrival, spec.prompt_tokens(), spec.output_len,
                      spec.priority, spec.ttft_slo_ms)
        self._route(job, now)

    def _on_transfer_done(self, event: TransferDone, now: float) -> None:
        h = event.handoff
        self.links.finish(h, now)
        job, decode = h.job, h.decode
        self._add(decode, job, job.output_len, now)
        self._poke(h.prefill, now)  # its pinned blocks are free again

    def _on_step_end(self, event: StepEnd, now: float) -> None:
        inst = event.instance
        if not inst.is_current(event.batch):
            return  # superseded by a mid-step cut
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
            self._start_transfers(inst, now)

    def _on_wake(self, event: Wake, now: float) -> None:
        inst = event.instance
        inst.wake_pending = False
        if inst.can_start(now):
            self._start(inst, now)

    def _on_poll(self, event: Poll, now: float) -> None:
        inst = event.instance
        if not inst.is_current(event.batch) or event.chain != inst.cutter.chain:
            return  # the batch ended or was cut, or an arrival restarted the timer
        self._cut_or_poll(inst, event.batch, inst.poll(now), now)

    def _cut_or_poll(self, inst: Instance, batch, cut, now: float) -> None:
        """After an SLO monitor look at `batch`: the end of the batch replacing it when the
        look cut it, else the monitor's next timer look (a batch it does not watch gets none)."""
        if cut is not None:
            self.events.push(cut.end, STEP_END, StepEnd(inst, cut))
        else:
            self._queue_poll(inst, batch, now)

    def _queue_poll(self, inst: Instance, batch, now: float) -> None:
        """The SLO monitor's next timer look at `batch`, if it falls inside it."""
        at = inst.next_poll(now)
        if at is not None:
            self.events.push(at, POLL, Poll(inst, batch, inst.cutter.chain))

    def _poke(self, inst: Instance, now: float) -> None:
        """Something new for `inst`: start a batch at `now` if it is free. If it is not, a batch
        end or a stage-free wake-up is already queued for it."""
        if inst.can_start(now) and not inst.wake_pending:
            inst.wake_pending = True
            self.events.push(now, WAKE, Wake(inst))

    def _start(self, inst: Instance, now: float) -> None:
        batch = inst.start_batch(now)
        if batch is not None:
            self.events.push(batch.end, STEP_END, StepEnd(inst, batch))
            if inst.cutter is not None:  # the monitor's look as the batch begins
                self._cut_or_poll(inst, batch, inst.look_at_start(now), now)
            if inst.pp_size > 1:  # the next micro-batch may enter when stage 0 frees
                self.events.push(inst.stage0_free, WAKE, Wake(inst))
        elif inst.step_again:  # the step only preempted: its victims may be re-admitted now
            self._poke(inst, now)
        if inst.role == "decode":
            self._start_transfers(inst, now)  # admissions released import reservations

    def _check_drained(self, now: float) -> None:
        for inst in self.instances:
            if inst.scheduler.has_unfinished_requests():
                raise RuntimeError(
                    f"simulation stalled at t={now:.3f}s: instance {inst.index} ({inst.role}) "
                    f"has {inst.scheduler.num_waiting} waiting and {inst.scheduler.num_running} "
                    f"running requests that cannot be scheduled")
        self.links.check_drained(now)

    # ---- requests ----------------------------------------------------------------------------
    def _route(self, job: Job, now: float) -> None:
        self.jobs[job.request_id] = job
        self.records[job.request_id] = RequestRecord(
            job.request_id, now, len(job.tokens), job.output_len, job.priority, job.ttft_slo_ms)
        front = self.front
        inst = front[0] if len(front) == 1 else front[self.router.choose(
            job.tokens, self._front_loads(), job.session and job.session.session_id)]
        inst.num_routed += 1
        if inst.role == "prefill":
            self._prefill_of[job.request_id] = inst
            self._add(inst, job, 1, now)
        else:
            self._add(inst, job, job.output_len, now)

    def _front_loads(self) -> list[int]:
        """`Instance.load` of each front instance, in one C-level pass (once per arrival over
        every front instance): KV imports go to decode instances only, so a front instance's
        `num_incoming` is 0 and its load is the number of requests its scheduler holds."""
        return list(map(len, self._front_requests))

    def _add(self, inst: Instance, job: Job, output_len: int, now: float) -> None:
        """Give `job` to `inst` (as its request, `output_len` tokens long) at `now`."""
        request = make_request(job.request_id, job.tokens, output_len, inst.max_model_len,
                               now, job.priority, job.ttft_slo_ms)
        inst.add_request(request, output_len, job.ttft_slo_ms)
        cut = inst.cut_if_ordered(request, now)
        if inst.in_flight and inst.cutter is not None:  # the monitor looked (timer restarted)
            self._cut_or_poll(inst, inst.in_flight[0], cut, now)
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
            arrival = now + session.turns[turn].delay
            self.events.push(arrival, ARRIVAL, Arrival(job=Job(
                session.request_id(turn), arrival,
                session.next_prompt(turn, request.all_token_ids),
                session.turns[turn].output_len, session.priority, None, session, turn)))

    # ---- prefill -> decode hand-over ---------------------------------------------------------
    def _hand_off(self, prefill: Instance, request: Request, now: float) -> None:
        job = self.jobs[request.request_id]
        hold = prefill.hold_prefix(job.tokens)
        loads = [d.load + self.links.queued(d) for d in self.decode]
        decode = self.decode[self.decode_router.choose(job.tokens, loads)]
        decode.num_routed += 1
        self.links.enqueue(Handoff(job, prefill, hold, decode, now))
        self._start_transfers(decode, now)

    def _start_transfers(self, decode: Instance, now: float) -> None:
        for h in self.links.start_transfers(decode, now):
            self.events.push(h.done, TRANSFER_DONE, TransferDone(h))

    # ---- results -----------------------------------------------------------------------------
    def _result(self, end: float, wall: float) -> ClusterResult:
        per_instance = [SimResult(list(i.records.values()), i.steps, i.itl, i.scheduler.stats,
                                  end, wall, i.kv.prefix_stats.hits, i.kv.prefix_stats.queries)
                        for i in self.instances]
        return ClusterResult(_overall(list(self.records.values()), per_instance,
                                      [i.role for i in self.instances]),
                             per_instance, [i.role for i in self.instances],
                             [i.num_routed for i in self.instances],
                             [i.max_in_flight for i in self.instances], self.transfers,
                             len(self.sessions))


def _overall(requests: list[RequestRecord], per_instance: list[SimResult],
             roles: list[str]) -> SimResult:
    """The user's view: one record per user request; steps, gaps and counters of every
    instance (an instance alone: its own, not copied); prefix hits of the front instances."""
    first = per_instance[0]
    if len(per_instance) == 1:
        return SimResult(requests, first.steps, first.itl, first.stats, first.end_time,
                         first.wall_seconds, first.prefix_hit_tokens, first.prefix_query_tokens)
    itl: Union[array, ValueCounts] = ValueCounts() if isinstance(first.itl, ValueCounts) \
        else array("d")
    for r in per_instance:
        itl.extend(r.itl)
    front = [r for r, role in zip(per_instance, roles) if role != "decode"]
    return SimResult(requests, [s for r in per_instance for s in r.steps], itl,
                     sum_stats(r.stats for r in per_instance), first.end_time,
                     first.wall_seconds, sum(r.prefix_hit_tokens for r in front),
                     sum(r.prefix_query_tokens for r in front))


def sum_stats(all_stats) -> SchedulerStats:
    """Field-wise sum of the instances' counters (dicts summed per key, lists per element)."""
    total = SchedulerStats()
    for stats in all_stats:
        for f in dataclasses.fields(SchedulerStats):
            setattr(total, f.name, _sum_values(getattr(total, f.name), getattr(stats, f.name)))
    return total


def _sum_values(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: _sum_values(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k))
                for k in {**a, **b}}
    if isinstance(a, list):
        return [x + y for x, y in zip(a, b)] + a[len(b):] + b[len(a):]
    return a + b


class Simulation:
    """One instance on the one loop: a cluster of one, built from one engine's parts.

    `run()` returns that instance's result. `pp_size` and `sessions` work as in a cluster."""

    def __init__(self, setup: EngineSetup, specs: list[RequestSpec],
                 recording: Recording = Recording(), pp_size: int = 1,
                 sessions: Optional[list[Session]] = None) -> None:
        self.config = setup.config
        self.instance = Instance(0, setup, "mixed", pp_size, recording)
        self.simulator = Simulator([self.instance], RoundRobinRouter(1), specs, sessions)
        self.engine = self.instance
        self.scheduler, self.runner = self.instance.scheduler, self.instance.runner
        self.max_model_len = setup.max_model_len

    @property
    def cutter(self) -> Optional[SimStepCutter]:
        return self.instance.cutter

    @property
    def steps(self) -> list[StepRecord]:
        return self.instance.steps

    def run(self) -> SimResult:
        return self.simulator.run().instances[0]
