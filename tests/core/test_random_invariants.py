"""Seeded random runs of at least 10,000 steps, checking the scheduler's invariants: random
arrivals, prompt lengths, max_tokens, EOS positions, priorities and aborts (some between
schedule() and update_from_output()), in a cramped pool, under random settings.

After every step: the step's budget, seats and partial prefills, the running requests' blocks
and computed tokens, and the count of requests (running + waiting == known). The whole
`check_integrity` (every block's ref count, the free list, every waiting request: O(pool +
queue) per step, ~2/3 of the run's time when it ran every step) runs after a random quarter of
the steps (its own seeded stream, so the run itself is unchanged) and after the last: a broken
invariant that persists is caught at the next checked step, and one that recurs (a preemption,
an abort that gets it wrong) is caught after about four of its occurrences."""

from __future__ import annotations

import random

import pytest

from tests.core.harness import FakeRunner, expected_output, make_request, make_scheduler
from tokenweir.core.kv_cache_manager import cdiv
from tokenweir.core.sched import policy as sched_policy

MIN_STEPS = 10_000
MAX_MODEL_LEN = 640
FULL_CHECK_SHARE = 0.25  # of the steps, drawn at random, that run the whole check_integrity


# Per seed: the settings each run must cover; the rest is drawn at random.
FORCED = {
    0: dict(scheduling_policy="fcfs", prioritize_prefill=False, scheduler_reserve_full_isl=False),
    1: dict(scheduling_policy="priority", prioritize_prefill=True,
            scheduler_reserve_full_isl=True),
    2: dict(scheduling_policy="fcfs", prioritize_prefill=True, max_num_seqs=0),
    3: dict(scheduling_policy="priority", enable_chunked_prefill=False,
            max_num_batched_tokens=MAX_MODEL_LEN),  # chunking off needs budget >= max_model_len
}


def _random_config(rng: random.Random, seed: int) -> dict:
    block_size = rng.choice([4, 8, 16])
    cfg = dict(
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        # Room for one max_model_len request, plus a little: a cramped pool.
        num_blocks=1 + cdiv(MAX_MODEL_LEN, block_size) + rng.randint(0, 24),
        max_num_batched_tokens=rng.choice([48, 96, 256]),
        max_num_seqs=rng.choice([0, 6, 24]),
        enable_chunked_prefill=True,
        long_prefill_token_threshold=rng.choice([0, 16, 64, 200]),
        max_num_partial_prefills=rng.randint(1, 4),
        watermark=rng.choice([0.0, 0.01, 0.05]),
    )
    cfg.update(FORCED[seed])
    return cfg


def _check_step(s, out, cfg, runner, full: bool):
    budget, max_seqs = cfg["max_num_batched_tokens"], cfg["max_num_seqs"]
    scheduled = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= budget
    assert all(n >= 1 for n in scheduled.values())
    if max_seqs:
        assert len(scheduled) <= max_seqs and s.num_running <= max_seqs
    assert not scheduled.keys() & out.finished_req_ids
    assert not scheduled.keys() & out.preempted_req_ids
    # the update's Request objects: one per entry, in order (after in-step preemptions too)
    assert [r.request_id for r in out.scheduled_requests] == list(scheduled)
    if not cfg["enable_chunked_prefill"]:
        for new in out.scheduled_new_reqs:
            assert scheduled[new.req_id] == len(new.token_ids) - new.num_computed_tokens
    assert s.num_running + s.num_waiting == len(s.requests), "a request was lost or doubled"
    if full:
        s.check_integrity()  # every block's ref count >= 0 among the rest
    bs = cfg["block_size"]
    num_partial = 0
    for r in s.running:
        # Blocks are allocated exactly for the computed tokens: no leak, no shortfall.
        assert s.kv.num_held_blocks(r.request_id) == cdiv(r.num_computed_tokens, bs)
        assert runner.computed[r.request_id] == r.num_computed_tokens
        num_partial += r.num_computed_tokens > 0 and sched_policy.is_prefilling(r)
    assert num_partial <= cfg["max_num_partial_prefills"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_run_keeps_invariants(seed):
    rng = random.Random(seed)
    cfg = _random_config(rng, seed)
    s = make_scheduler(**cfg)
    eos_at: dict[str, int] = {}
    runner = FakeRunner(eos_at=eos_at)
    full_checks = random.Random(1000 + seed)  # which steps run check_integrity: not `rng`
    # Arrivals about as fast as the cramped pool can serve them, so queues build and drain.
    arrival_p = 0.04 if cfg["max_num_batched_tokens"] < 96 else 0.06
    added, finished, aborted, outputs = {}, set(), set(), {}
    step_no = 0
    while step_no < MIN_STEPS or s.has_unfinished_requests():
        assert step_no < 20 * MIN_STEPS, "the run does not drain"
        if step_no < MIN_STEPS and rng.random() < arrival_p:
            rid = f"s{seed}-r{len(added)}"
            prompt = rng.randint(1, 600)
            max_tokens = rng.randint(1, min(120, MAX_MODEL_LEN - prompt))
            if rng.random() < 0.3:
                eos_at[rid] = rng.randrange(max_tokens)
            req = make_request(rid, prompt, max_tokens, arrival=float(step_no),
                               priority=rng.randint(0, 4))
            s.add_request(req)
            added[rid] = req
        if s.requests and rng.random() < 0.004:
            victim = rng.choice(sorted(s.requests))
            s.finish_requests([victim])
            aborted.add(victim)
        out = s.schedule(now=float(step_no))
        result = runner.execute(out)
        if s.requests and rng.random() < 0.002:  # abort while the step is "on the device"
            victim = rng.choice(sorted(s.requests))
            s.finish_requests([victim])
            aborted.add(victim)
        for eco in s.update_from_output(out, result, now=float(step_no)):
            if eco.finish_reason is not None:
                rid = eco.request.request_id
                assert rid not in finished and rid not in aborted
                finished.add(rid)
                outputs[rid] = eco.request.output_token_ids
        _check_step(s, out, cfg, runner, full_checks.random() < FULL_CHECK_SHARE)
        step_no += 1
    s.check_integrity()  # after the last step

    assert step_no >= MIN_STEPS
    # Every request is accounted for, exactly once; nothing is left anywhere.
    assert finished | aborted == set(added) and not finished & aborted
    assert not s.requests and not s.running and not s.waiting
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks
    for rid in finished:
        assert outputs[rid] == expected_output(added[rid], eos_at.get(rid)), rid
    for rid in aborted:
        assert added[rid].status.finish_reason == "abort"
    # Probes: the pool really was cramped, prompts were chunked, aborts happened.
    assert s.stats.num_preemptions > 0
    assert len(added) > 300 and len(aborted) > 0
    if cfg["enable_chunked_prefill"]:
        assert s.stats.num_chunked_prefill_steps > 0
