"""A seeded random scheduler run with every feature on at once, invariants checked after every
step (issue 14). Shared by tests/core/test_random_at_scale.py (>= 100,000 steps in CI) and
benchmarks/random_scheduler_run.py (1,000,000 steps).

Each segment is one scheduler with: chunked prefill (a small budget and a long-prefill
threshold), prefix caching (prompts drawn from shared prefix groups), the "slo" scheduling
policy (TTFT targets on a scripted clock, so it pauses running prefills between steps) and
random mid-step cuts rolled back as the real runner's are, "cost" victims, swap or auto
preemption into a host pool that holds about one request (so swap also falls back to
recompute), random priorities, and aborts both between steps and while a step is "on the
device". The runner is `KVContentRunner`: it models the KV bytes, so a wrong prefix hit, swap
pair or copy order fails its content checks.

Cheap checks: the pools are small on purpose (one max_model_len request plus 12 blocks), so
the full integrity check after every step walks a few dozen blocks and at most `max_num_seqs`
requests; the per-step checks are O(running requests); the KV-content checks are O(context of
the step's requests), which the small max_model_len bounds. Nothing is O(history).

Hook for n > 1 groups (helper `parallel`): `fan_out` turns one drawn prompt into the requests
of its group. It returns one request today; when SamplingParams.n lands, return the group's
requests (and the end-of-run checks hold per request unchanged).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from tests.core.harness import (KVContentRunner, check_swap_order, device_tables,
                                expected_output, kv_chain, make_prompt_request,
                                make_scheduler)
from tokenweir.core.kv_cache_manager import cdiv
from tokenweir.core.outputs import SLO_BETWEEN_STEPS, SLO_MID_STEP
from tokenweir.core.sched import slo
from tokenweir.request import Request

MAX_MODEL_LEN = 96
SECONDS_PER_TOKEN = 0.001  # the scripted clock: a step takes 1 ms per scheduled token
# Arrivals per step: about what the cramped pool serves, so queues build and drain (faster,
# the waiting queue grows without bound and every step pays for it).
ARRIVAL_P = 0.09

# Every segment has every feature on; segments differ in what only one value can have.
SEGMENTS = (
    dict(preemption_mode="auto", block_size=4, max_num_batched_tokens=24,
         prioritize_prefill=False, slo_preempt_gate="conservative"),
    dict(preemption_mode="swap", block_size=8, max_num_batched_tokens=48,
         prioritize_prefill=True, slo_preempt_gate="aggressive"),
)


@dataclass
class RunStats:
    """What a run did: the probes that each feature really fired, and the checks made."""
    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    cuts: int = 0
    readmitted_in_step: int = 0  # victims preempted and re-admitted within one step
    integrity_checks: int = 0  # full Scheduler.check_integrity passes (one per step)
    request_checks: int = 0  # per-request invariants checked after steps
    kv_positions_checked: int = 0  # KV-content positions the runner verified
    counters: dict = field(default_factory=dict)  # summed scheduler / cache counters

    def add(self, name: str, value: int) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    @property
    def invariant_checks(self) -> int:
        return self.integrity_checks + self.request_checks + self.kv_positions_checked


def fan_out(request: Request) -> list[Request]:
    """The requests of one drawn prompt's group: itself (n = 1) until n > 1 groups land."""
    return [request]


def segment_config(index: int) -> dict:
    cfg = dict(max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=16,
               max_num_partial_prefills=2, max_num_seqs=12, watermark=0.0,
               scheduler_reserve_full_isl=False, enable_prefix_caching=True, max_preemptions=2,
               scheduling_policy="slo", preemption_policy="cost")
    cfg.update(SEGMENTS[index % len(SEGMENTS)])
    cfg["num_blocks"] = 1 + cdiv(MAX_MODEL_LEN, cfg["block_size"]) + 12
    cfg["num_host_blocks"] = cdiv(MAX_MODEL_LEN, cfg["block_size"])
    return cfg


class Segment:
    """One scheduler, driven for `arrival_steps` steps of random arrivals, then drained."""

    def __init__(self, seed: int, index: int, arrival_steps: int, stats: RunStats) -> None:
        self.rng, self.cfg, self.stats = random.Random(seed), segment_config(index), stats
        self.arrival_steps, self.name = arrival_steps, f"s{seed}-{index}"
        self.s = make_scheduler(**self.cfg)
        self.s.policy.ttft_predictor = slo.TTFTPredictor(a=SECONDS_PER_TOKEN, c=0.0)
        self.eos_at: dict[str, int] = {}
        self.runner = KVContentRunner(self.s.kv.pool, self.cfg["block_size"], self.eos_at)
        self.groups = [[self.rng.randrange(3, 999) for _ in range(40)] for _ in range(5)]
        self.added: dict[str, Request] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.cut_touched: set[str] = set()  # requests scheduled in a step that was cut
        self.now, self.step_no = 0.0, 0

    def run(self) -> None:
        while self.step_no < self.arrival_steps or self.s.has_unfinished_requests():
            assert self.step_no < 4 * self.arrival_steps + 1000, "the run does not drain"
            self.step()
        self.check_end()

    def step(self) -> None:
        rng, s = self.rng, self.s
        if self.step_no < self.arrival_steps and rng.random() < ARRIVAL_P:
            for request in fan_out(self.draw_request()):
                self.added[request.request_id] = request
                s.add_request(request)
        if s.requests and rng.random() < 0.01:
            self.abort_one()
        held = device_tables(s)
        out = s.schedule(now=self.now)
        self.now += SECONDS_PER_TOKEN * out.total_num_scheduled_tokens + 1e-4
        prefills = [r for r, n in out.num_scheduled_tokens.items() if n > 1]
        if prefills and rng.random() < 0.02:
            self.cut(out, rng.choice(prefills))
        else:
            self.execute_and_update(out, held)
        self.check_step(out)
        self.step_no += 1

    def draw_request(self) -> Request:
        rng = self.rng
        rid = f"{self.name}-{len(self.added)}"
        prompt = rng.choice(self.groups)[:rng.randint(0, 40)] + \
            [rng.randrange(3, 999) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, min(30, MAX_MODEL_LEN - len(prompt)))
        if rng.random() < 0.2:
            self.eos_at[rid] = rng.randrange(max_tokens)
        request = make_prompt_request(rid, prompt, max_tokens, arrival=self.now,
                                      priority=rng.randint(0, 3))
        # Tight targets make the slo policy pause and cut; loose and none make it wait.
        request.ttft_slo_ms = rng.choice([None, 20.0, 60.0, 300.0, 5000.0])
        return request

    def abort_one(self) -> None:
        victim = self.rng.choice(sorted(self.s.requests))
        self.s.finish_requests([victim])
        self.aborted.add(victim)

    def execute_and_update(self, out, held) -> None:
        s, runner = self.s, self.runner
        result = runner.execute(out)
        check_swap_order(out, s, held,
                         {rid: runner.blocks[rid] for rid in out.num_scheduled_tokens})
        if s.requests and self.rng.random() < 0.005:  # abort while the step is on the device
            self.abort_one()
        for eco in s.update_from_output(out, result, now=self.now):
            if eco.finish_reason is not None:
                rid = eco.request.request_id
                assert eco.finish_reason != "error", eco.request.error
                assert rid not in self.finished and rid not in self.aborted
                self.finished.add(rid)

    def cut(self, out, victim_id: str) -> None:
        """What the real runner does when the SLO monitor cuts a step at a layer: it takes in
        the step's state updates but advances nothing and samples nothing (its KV writes lie
        past every computed position); the scheduler rolls the step back."""
        runner = self.runner
        ids = list(out.num_scheduled_tokens)
        saved = {rid: (runner.computed.get(rid), runner.known.get(rid),
                       list(runner.tokens.get(rid, ())), list(runner.chain.get(rid, ())))
                 for rid in ids}
        runner.execute(out)
        new = {n.req_id: n for n in out.scheduled_new_reqs}
        for rid in ids:
            if rid in new:
                token_ids = new[rid].token_ids
                runner.computed[rid] = new[rid].num_computed_tokens
                runner.known[rid] = len(token_ids)
                runner.tokens[rid], runner.chain[rid] = list(token_ids), kv_chain(token_ids)
            else:
                (runner.computed[rid], runner.known[rid], runner.tokens[rid],
                 runner.chain[rid]) = saved[rid]
        self.cut_touched.update(ids)
        self.s.roll_back_cut_step(out, victim_id, 3, 30)
        self.stats.cuts += 1

    def check_step(self, out) -> None:
        s, cfg, runner, stats = self.s, self.cfg, self.runner, self.stats
        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= \
            cfg["max_num_batched_tokens"]
        assert all(n >= 1 for n in scheduled.values())
        assert not scheduled.keys() & out.finished_req_ids
        # A victim preempted in this step may be re-admitted in it: then it comes in full.
        readmitted = scheduled.keys() & out.preempted_req_ids
        assert readmitted <= {new.req_id for new in out.scheduled_new_reqs}
        stats.readmitted_in_step += len(readmitted)
        s.check_integrity()
        stats.integrity_checks += 1
        bs = cfg["block_size"]
        for r in s.running:
            assert runner.computed[r.request_id] == r.num_computed_tokens
            held = s.kv.num_held_blocks(r.request_id)
            # A swapped victim carries the block it was given in the step that preempted it.
            # A cut step's requests keep the blocks it gave them: up to their known tokens.
            most = r.num_tokens if r.request_id in self.cut_touched else r.num_computed_tokens
            assert cdiv(r.num_computed_tokens, bs) <= held <= cdiv(most, bs) + 1
        for r in s.waiting:
            swapped = s.kv.num_swapped_blocks(r.request_id)
            kept = s.kv.num_held_blocks(r.request_id)
            assert swapped == 0 or cdiv(r.num_computed_tokens, bs) <= swapped + kept
        stats.request_checks += len(s.running) + len(s.waiting)

    def check_end(self) -> None:
        s, stats = self.s, self.stats
        assert self.finished | self.aborted == set(self.added)
        assert not self.finished & self.aborted
        assert not s.requests and not s.running and not s.waiting
        assert s.kv.num_free_blocks == s.kv.num_usable_blocks
        assert s.kv.host_pool.num_free_blocks == self.cfg["num_host_blocks"]
        for rid in self.finished:  # every output as if never preempted, swapped or cut
            request = self.added[rid]
            assert request.output_token_ids == expected_output(request, self.eos_at.get(rid)), rid
        stats.steps += self.step_no
        stats.requests += len(self.added)
        stats.finished += len(self.finished)
        stats.aborted += len(self.aborted)
        stats.kv_positions_checked += self.runner.context_checks
        st = s.stats
        for name, value in (("preemptions", st.num_preemptions),
                            ("swapped_out", st.num_swapped_out),
                            ("swapped_in", st.num_swapped_in),
                            ("recomputed_tokens", st.recomputed_tokens),
                            ("chunked_prefill_steps", st.num_chunked_prefill_steps),
                            ("slo_pauses", st.preemptions_by_cause[SLO_BETWEEN_STEPS]),
                            ("slo_cuts", st.preemptions_by_cause[SLO_MID_STEP]),
                            ("prefix_hits", s.kv.prefix_stats.hits)):
            stats.add(name, value)


def random_run(total_steps: int, seed: int = 0, steps_per_segment: int = 25_000,
               progress: Optional[Callable[[RunStats], None]] = None) -> RunStats:
    """Segments of `steps_per_segment` arrival steps (plus their drains), cycling through
    SEGMENTS, until at least `total_steps` steps ran. Raises AssertionError on any broken
    invariant."""
    stats = RunStats()
    index = 0
    while stats.steps < total_steps:
        arrival_steps = min(steps_per_segment, total_steps - stats.steps)
        Segment(seed * 1000 + index, index, arrival_steps, stats).run()
        index += 1
        if progress is not None:
            progress(stats)
    return stats
