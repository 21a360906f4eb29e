"""One serving instance: its own real Scheduler, KVCacheManager and SimRunner (SimEngine), driven
by the simulator's one event loop (simulator.py), which owns the clock. A single-instance run is
a cluster of one of these.

Pipeline parallelism (`pp_size` > 1), modelled simply: the latency model's step time T is split
into `pp_size` equal stages of T / pp_size; a batch enters stage s once it has left stage s - 1
and the batch ahead of it has left stage s. A new batch may start when stage 0 is free and fewer
than `pp_size` batches are in flight, so batches complete in the order they started. Requests
of an in-flight batch are hidden from the scheduler while the next batch is planned (they owe
no tokens until their batch returns), so micro-batches never share a request. The token budget
applies per micro-batch (it is what spreads a burst of prompts over the stages);
`max_num_seqs` stays a limit on the whole instance. With pp_size == 1 one batch is in flight at
a time: a step starts when the previous one ends.

Mid-step cuts (slo policy with slo_mid_step_cut): each instance has its own SimStepCutter
(slo_cuts.py). A request added while a batch is in flight is shown to it (`cut_if_ordered`);
when the SLO monitor orders that batch cut, the batch is replaced by one carrying the cut
runner output, ending at the cut's layer boundary: the loop's event for the old end goes
stale. Cuts model one step on one stage, so they need pp_size == 1.

KV import/hold (prefill/decode disaggregation): `hold_prefix` pins the cached full blocks of a
finished prefill until its transfer is done; `reserve_import` allocates blocks for an incoming
prompt's full blocks (reusing any it already caches), `complete_import` publishes them in the
prefix cache once the bytes have arrived, and the decode request's admission then hits them.
A hold is a placeholder owner in the KV manager (ids start with '~'), never a scheduler request.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Optional

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.core.outputs import EngineCoreOutput
from tokenweir.request import Request
from tokenweir.sim.decode_stretch import StretchDriver, stands
from tokenweir.sim.setup import EngineSetup, Recording
from tokenweir.sim.sim_engine import SimEngine, StepRecord, make_request  # noqa: F401
from tokenweir.sim.slo_cuts import setup_slo

ROLES = ("mixed", "prefill", "decode")


@dataclass(slots=True)
class Batch:
    """A batch in flight: what was scheduled, what the runner returned, when it runs."""

    out: SchedulerOutput
    runner_out: ModelRunnerOutput
    start: float
    end: float


@dataclass(slots=True)
class KVImport:
    """Blocks reserved on a receiving instance for one incoming prompt."""

    holder: Request
    num_blocks: int  # full prompt blocks the holder covers
    num_new_blocks: int  # of those, blocks whose bytes must cross the link
    need_after: int  # blocks the request still needs at admission (its tail and output)


class Instance(SimEngine):
    def __init__(self, index: int, setup: EngineSetup, role: str = "mixed", pp_size: int = 1,
                 recording: Recording = Recording()) -> None:
        if role not in ROLES:
            raise ValueError(f"instance role must be one of {ROLES}, got {role!r}")
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        super().__init__(setup, recording)
        self.index, self.role, self.pp_size = index, role, pp_size
        self.cutter = setup_slo(setup.config, self.scheduler, self.runner, setup.model,
                                setup.max_model_len)
        if self.cutter is not None and pp_size > 1:
            raise ValueError("slo mid-step cuts model a step on one pipeline stage: use "
                             "pp_size 1 or turn slo_mid_step_cut off")
        self.in_flight: deque[Batch] = deque()
        self.max_in_flight = 0  # probe: most batches in flight at once
        self._stage_free = [0.0] * pp_size
        self.wake_pending = False
        self.num_routed = 0  # requests the router sent here
        self.num_incoming = 0  # KV transfers reserved or under way towards this instance
        self._imports: dict[str, KVImport] = {}
        self._import_reserve = 0  # blocks promised to imported requests not yet admitted
        self._num_holds = 0
        # Pure-decode steps touching only the rows with an event (decode_stretch.py); None
        # where its standing conditions fail. Set it to None to take the general path always.
        self.stretch: Optional[StretchDriver] = StretchDriver(self) if stands(self) else None

    # ---- requests ------------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Requests here or on their way: what least-loaded routing compares. Read between
        steps, where the scheduler's requests are exactly its running and waiting ones
        (check_integrity), counted without a call into the waiting queue (once per instance
        per arrival)."""
        return len(self.scheduler.requests) + self.num_incoming

    # ---- the engine loop -------------------------------------------------------------------
    def can_start(self, now: float) -> bool:
        return len(self.in_flight) < self.pp_size and now >= self._stage_free[0]

    @property
    def stage0_free(self) -> float:
        return self._stage_free[0]

    def start_batch(self, now: float) -> Optional[Batch]:
        """Plan and launch one batch; returns it (its `end`: when it completes), or None if
        nothing runs (`step_again` then tells whether the empty step preempted)."""
        if self.stretch is not None:
            batch = self._start_stretch_step(now)
            if batch is not None:
                return batch
        step = self.start_step(now)
        if step is None:
            return None
        out, runner_out = step
        seconds = runner_out.step_seconds
        end = self._through_pipeline(now, seconds)
        # the record's seconds: the batch's latency, start to completion
        self.record_step(now, end - now if self.pp_size > 1 else seconds, out)
        batch = Batch(out, runner_out, now, end)
        self.in_flight.append(batch)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        if self.cutter is not None:
            self.cutter.step_started(now, seconds, out)
        return batch

    def _start_stretch_step(self, now: float) -> Optional[Batch]:
        """The next step as a decode-stretch step (a Batch without a SchedulerOutput), or None."""
        seconds = self.stretch.start(now)
        if seconds is None:
            return None
        self.step_again, self._empty_steps = False, 0
        end = self._through_pipeline(now, seconds)
        if self.record_steps:
            num_reqs, num_decodes, num_tokens = self.stretch.step_shape()
            scheduler = self.scheduler
            self.steps.append(StepRecord(now, seconds, num_reqs, num_decodes, num_tokens,
                                         self.kv.usage(), scheduler.num_running,
                                         scheduler.num_waiting))
        batch = Batch(None, None, now, end)
        self.in_flight.append(batch)
        self.max_in_flight = max(self.max_in_flight, 1)
        return batch

    def cut_if_ordered(self, request: Request, now: float) -> Optional[Batch]:
        """`request` was just added: the SLO monitor sees it (with no batch in flight it only
        restarts its timer). When it orders the batch in flight cut, returns the replacing
        batch, which ends at the cut."""
        if self.cutter is None:
            return None
        return self._replace_if_cut(self.cutter.on_arrival(request, now))

    def look_at_start(self, now: float) -> Optional[Batch]:
        """The SLO monitor's look as the batch just started begins (only a batch it may cut
        wakes it); a cut as `cut_if_ordered`. Only for an instance with a cutter."""
        return self._replace_if_cut(self.cutter.look_at_start(now))

    def poll(self, now: float) -> Optional[Batch]:
        """The SLO monitor's timer look at the batch in flight; a cut as `cut_if_ordered`."""
        return self._replace_if_cut(self.cutter.look(now))

    def next_poll(self, now: float) -> Optional[float]:
        """When the SLO monitor's timer next looks at the batch in flight (None: not before
        the batch ends). Only for an instance with a cutter."""
        return self.cutter.next_poll(now)

    def _replace_if_cut(self, cut) -> Optional[Batch]:
        if cut is None:
            return None
        end, runner_out = cut
        old = self.in_flight[0]  # pp_size 1: the only one
        batch = Batch(old.out, runner_out, old.start, end)
        self.in_flight[0] = batch
        self._stage_free[0] = end
        if self.record_steps:
            self.steps[-1].seconds = runner_out.step_seconds
        return batch

    def is_current(self, batch: Batch) -> bool:
        """`batch` is the next to complete (not replaced by a cut, not completed)."""
        return bool(self.in_flight) and self.in_flight[0] is batch

    def _schedule(self, now: float) -> Optional[SchedulerOutput]:
        """The next batch, planned with in-flight requests hidden from the scheduler (and
        `max_num_seqs` lowered by their number); None when the instance is full of them.
        Import reservations of the requests it admits are released."""
        out = self._schedule_around_in_flight(now)
        if out is not None:
            self._release_admitted_imports(out)
        return out

    def _schedule_around_in_flight(self, now: float) -> Optional[SchedulerOutput]:
        if not self.in_flight:
            return self.scheduler.schedule(now)
        busy = {rid for b in self.in_flight for rid in b.out.num_scheduled_tokens}
        scheduler = self.scheduler
        before, config = scheduler.running, scheduler.config
        hidden = [r for r in before if r.request_id in busy]
        if config.max_num_seqs:
            room = config.max_num_seqs - len(hidden)
            if room <= 0:
                return None
            scheduler.config = dataclasses.replace(config, max_num_seqs=room)
        scheduler.running = [r for r in before if r.request_id not in busy]
        try:
            return scheduler.schedule(now)
        finally:
            scheduler.config = config
            after = scheduler.running
            kept = {id(r) for r in after}
            previous = {id(r) for r in before}
            scheduler.running = ([r for r in before if r.request_id in busy or id(r) in kept]
                                 + [r for r in after if id(r) not in previous])

    def _through_pipeline(self, now: float, seconds: float) -> float:
        """Move a batch of `seconds` total work through the stages; returns its completion."""
        if self.pp_size == 1:
            end = now + seconds
            self._stage_free[0] = end
            return end
        stage_seconds = seconds / self.pp_size
        t = now
        for s in range(self.pp_size):
            t = max(t, self._stage_free[s]) + stage_seconds
            self._stage_free[s] = t
        return t

    def finish_batch(self, now: float) -> list[EngineCoreOutput]:
        """Complete the oldest in-flight batch at `now`; returns the scheduler's outputs."""
        batch = self.in_flight.popleft()
        if batch.out is None:
            return self.stretch.complete(now)
        if self.cutter is not None:
            self.cutter.step_ended()
        return self.complete_step(batch.out, batch.runner_out, now)

    # ---- KV hand-over (prefill/decode disaggregation) ---------------------------------------
    def _holder(self, tokens: list[int]) -> Request:
        self._num_holds += 1
        return make_request(f"~kv{self.index}.{self._num_holds}", tokens, 1,
                            self.max_model_len + 1, 0.0)

    def hold_prefix(self, tokens: list[int]) -> Request:
        """Pin the cached full blocks of `tokens` (a prefill just finished: its blocks are free
        but still cached) until `release`; they cannot be evicted while being sent."""
        holder = self._holder(tokens)
        hits = self.kv.get_computed_blocks(holder)
        if hits:
            assert self.kv.allocate_slots(holder, 0, computed_blocks=hits) is not None
        return holder

    def release(self, holder: Request) -> None:
        self.kv.free(holder)

    def reserve_import(self, request_id: str, tokens: list[int],
                       output_len: int) -> Optional[KVImport]:
        """Blocks for the full blocks of an incoming prompt, or None (nothing changed) when the
        pool cannot take them while keeping room for every imported request's admission."""
        kv = self.kv
        holder = self._holder(tokens)
        num_blocks = (len(tokens) - 1) // kv.block_size
        hits = kv.get_computed_blocks(holder)[:num_blocks]
        full_len = min(len(tokens) + output_len, self.max_model_len)
        need_after = kv.blocks_for_tokens(full_len) - num_blocks
        reserve = self._import_reserve + need_after + self.scheduler.watermark_blocks
        new_tokens = (num_blocks - len(hits)) * kv.block_size
        if kv.allocate_slots(holder, new_tokens, computed_blocks=hits,
                             reserved_blocks=reserve) is None:
            return None
        self._import_reserve += need_after
        self.num_incoming += 1
        imp = KVImport(holder, num_blocks, num_blocks - len(hits), need_after)
        self._imports[request_id] = imp
        return imp

    def complete_import(self, imp: KVImport) -> None:
        """The bytes have arrived: publish the blocks so the request's admission hits them."""
        imp.holder.num_computed_tokens = imp.num_blocks * self.kv.block_size
        self.kv.register_computed_blocks(imp.holder)
        self.num_incoming -= 1

    def _release_admitted_imports(self, out: SchedulerOutput) -> None:
        if not self._imports:
            return
        for new in out.scheduled_new_reqs:
            imp = self._imports.pop(new.req_id, None)
            if imp is not None:
                self.kv.free(imp.holder)
                self._import_reserve -= imp.need_after
