"""Prefix caching and swap together, under every victim policy and preemption mode.

1. Identity: a cramped pool gives every request the same tokens as a roomy one, for each
   preemption_mode x preemption_policy x prefix caching on/off, on a workload with shared
   prefixes; each cramped run proves it preempted, swapped (swap mode) and hit the cache.
2. Seeded random runs of >= 10,000 steps per configuration family (prefix caching and swap on,
   shared prefix groups, random aborts and priorities, a cramped device pool and a host pool
   small enough that swap falls back to recompute), checking invariants after every step.

Every run uses `KVContentRunner`, which models the KV bytes: a wrong prefix hit, a wrong swap
pair, a copy in the wrong order or a write into a shared block fails its content checks.
"""

from __future__ import annotations

import random

import pytest

from tests.core.harness import (KVContentRunner, check_swap_order, device_tables,
                                expected_output, make_prompt_request, make_scheduler)
from tokenweir.core.kv_cache_manager import cdiv

MAX_MODEL_LEN = 96


def _workload(seed: int, n: int = 36):
    """(request id, prompt, max_tokens, priority) with prompts drawn from 4 prefix groups, and
    EOS positions. Shared prefixes are up to 24 tokens: whole blocks of 4 and 8, and a tail."""
    rng = random.Random(seed)
    groups = [[rng.randrange(3, 999) for _ in range(24)] for _ in range(4)]
    spec, eos_at = [], {}
    for i in range(n):
        shared = rng.choice(groups)[:rng.choice([0, 8, 16, 21, 24])]
        prompt = shared + [rng.randrange(3, 999) for _ in range(rng.randint(1, 24))]
        max_tokens = rng.randint(1, min(40, MAX_MODEL_LEN - len(prompt)))
        rid = f"w{i}"
        spec.append((rid, prompt, max_tokens, rng.randint(0, 3)))
        if rng.random() < 0.2:
            eos_at[rid] = rng.randrange(max_tokens)
    return spec, eos_at


def _drive(s, spec, eos_at, per_step=2):
    """Add `per_step` requests a step (arrival = step), run until idle, checking after every
    step. Returns (requests, runner, steps with both swap directions, reused swap-out blocks)."""
    runner = KVContentRunner(s.kv.pool, s.kv.block_size, eos_at=eos_at)
    reqs = [make_prompt_request(rid, prompt, m, arrival=float(i // per_step), priority=pr)
            for i, (rid, prompt, m, pr) in enumerate(spec)]
    pending = list(reqs)
    probes = {"in_and_out_steps": 0, "swap_out_reused": 0}
    steps = 0
    while pending or s.has_unfinished_requests():
        for _ in range(per_step):
            if pending:
                s.add_request(pending.pop(0))
        held = device_tables(s)
        out = s.schedule(now=float(steps))
        assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        result = runner.execute(out)
        overlap = check_swap_order(
            out, s, held, {rid: runner.blocks[rid] for rid in out.num_scheduled_tokens})
        probes["in_and_out_steps"] += bool(out.blocks_to_swap_in and out.blocks_to_swap_out)
        probes["swap_out_reused"] += len(overlap["swap_out_reused"])
        s.update_from_output(out, result, now=float(steps))
        s.check_integrity()
        steps += 1
        assert steps < 20_000, "the run does not drain"
    return reqs, runner, probes


CRAMPED = dict(num_blocks=1 + 28, block_size=4, max_num_batched_tokens=32,
               long_prefill_token_threshold=12, max_num_partial_prefills=2, max_num_seqs=10,
               watermark=0.0, scheduler_reserve_full_isl=False, num_host_blocks=20)
ROOMY = dict(num_blocks=2000, block_size=4, max_num_batched_tokens=4096,
             num_host_blocks=20)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("victim_policy", ["fcfs", "priority", "cost"])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_cramped_and_roomy_give_identical_tokens(mode, victim_policy, caching):
    spec, eos_at = _workload(seed=11)
    common = dict(max_model_len=MAX_MODEL_LEN, preemption_mode=mode,
                  preemption_policy=victim_policy, enable_prefix_caching=caching,
                  max_preemptions=2)
    roomy = make_scheduler(**ROOMY, **common)
    roomy_reqs, _, _ = _drive(roomy, spec, eos_at)
    cramped = make_scheduler(**CRAMPED, **common)
    reqs, runner, _ = _drive(cramped, spec, eos_at)
    for r, rr in zip(reqs, roomy_reqs):
        assert r.output_token_ids == rr.output_token_ids == \
            expected_output(r, eos_at.get(r.request_id)), r.request_id
        assert r.status == rr.status and r.is_finished
    # Probes: the cramped run shed load (the roomy one never did), in the mode asked for.
    st = cramped.stats
    assert st.num_preemptions > 0 and roomy.stats.num_preemptions == 0
    if mode == "swap":
        assert st.num_swapped_out > 0 and st.num_swapped_in > 0
    if mode == "recompute":
        assert st.num_swapped_out == 0 and st.recomputed_tokens > 0
    if caching:
        assert cramped.kv.prefix_stats.hits > 0 and roomy.kv.prefix_stats.hits > 0
        assert any(r.num_cached_tokens > 0 for r in reqs)
    else:
        assert cramped.kv.prefix_stats.hits == 0 and not cramped.kv.pool.cached
    assert runner.context_checks > 0 and runner.writes > 0


# ---- long seeded random runs ----------------------------------------------------------------
MIN_STEPS = 10_000

FAMILIES = {
    "swap-cost": dict(preemption_mode="swap", preemption_policy="cost", block_size=4,
                      max_num_batched_tokens=24, scheduling_policy="fcfs",
                      prioritize_prefill=False),
    "swap-fcfs-prefill-first": dict(preemption_mode="swap", preemption_policy="fcfs",
                                    block_size=4, max_num_batched_tokens=48,
                                    scheduling_policy="fcfs", prioritize_prefill=True),
    "auto-priority-prefill-first": dict(preemption_mode="auto", preemption_policy="priority",
                                        block_size=8, max_num_batched_tokens=48,
                                        scheduling_policy="priority", prioritize_prefill=True),
    "auto-cost": dict(preemption_mode="auto", preemption_policy="cost", block_size=8,
                      max_num_batched_tokens=24, scheduling_policy="priority",
                      prioritize_prefill=False),
}


# Of the steps, drawn at random (a stream of its own), those that run the whole
# check_integrity (O(pool + queue)); it also runs after the last step. As in
# test_random_invariants.py: a persisting break is caught at the next checked step, a recurring
# one after about four of its occurrences; the checks below run after every step.
FULL_CHECK_SHARE = 0.25


def _check_step(s, out, runner, cfg, full: bool):
    scheduled = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= \
        cfg["max_num_batched_tokens"]
    assert all(n >= 1 for n in scheduled.values())
    assert not scheduled.keys() & (out.finished_req_ids | out.preempted_req_ids)
    assert s.num_running + s.num_waiting == len(s.requests), "a request was lost or doubled"
    if full:
        s.check_integrity()
    bs = cfg["block_size"]
    for r in s.running:
        assert runner.computed[r.request_id] == r.num_computed_tokens
        held = s.kv.num_held_blocks(r.request_id)
        # A swapped victim carries the block it was given in the step that preempted it.
        assert cdiv(r.num_computed_tokens, bs) <= held <= cdiv(r.num_computed_tokens, bs) + 1
    for r in s.waiting:
        swapped = s.kv.num_swapped_blocks(r.request_id)
        kept = s.kv.num_held_blocks(r.request_id)  # the shared prefix a swapped victim keeps
        assert swapped == 0 or cdiv(r.num_computed_tokens, bs) <= swapped + kept


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_prefix_swap_run_keeps_invariants(family):
    rng = random.Random(family)
    cfg = dict(max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=16,
               max_num_partial_prefills=2, max_num_seqs=12, watermark=0.0,
               scheduler_reserve_full_isl=False, enable_prefix_caching=True, max_preemptions=2)
    cfg.update(FAMILIES[family])
    # One max_model_len request plus a little; the host pool holds about one request.
    cfg["num_blocks"] = 1 + cdiv(MAX_MODEL_LEN, cfg["block_size"]) + 4
    cfg["num_host_blocks"] = cdiv(MAX_MODEL_LEN, cfg["block_size"])
    s = make_scheduler(**cfg)
    eos_at: dict[str, int] = {}
    runner = KVContentRunner(s.kv.pool, cfg["block_size"], eos_at=eos_at)
    groups = [[rng.randrange(3, 999) for _ in range(40)] for _ in range(5)]
    added, finished, aborted = {}, set(), set()
    probes = {"in_and_out_steps": 0, "swap_out_reused": 0}
    full_checks = random.Random(f"{family}-checks")  # which steps: not `rng`, the run's own
    step_no = 0
    while step_no < MIN_STEPS or s.has_unfinished_requests():
        assert step_no < 4 * MIN_STEPS, "the run does not drain"
        if step_no < MIN_STEPS and rng.random() < 0.12:
            rid = f"{family}-{len(added)}"
            prompt = rng.choice(groups)[:rng.randint(0, 40)] + \
                [rng.randrange(3, 999) for _ in range(rng.randint(1, 30))]
            max_tokens = rng.randint(1, min(30, MAX_MODEL_LEN - len(prompt)))
            if rng.random() < 0.2:
                eos_at[rid] = rng.randrange(max_tokens)
            added[rid] = make_prompt_request(rid, prompt, max_tokens, arrival=float(step_no),
                                             priority=rng.randint(0, 3))
            s.add_request(added[rid])
        if s.requests and rng.random() < 0.01:
            victim = rng.choice(sorted(s.requests))
            s.finish_requests([victim])
            aborted.add(victim)
        held = device_tables(s)
        out = s.schedule(now=float(step_no))
        result = runner.execute(out)
        overlap = check_swap_order(
            out, s, held, {rid: runner.blocks[rid] for rid in out.num_scheduled_tokens})
        probes["in_and_out_steps"] += bool(out.blocks_to_swap_in and out.blocks_to_swap_out)
        probes["swap_out_reused"] += len(overlap["swap_out_reused"])
        if s.requests and rng.random() < 0.005:  # abort while the step is "on the device"
            victim = rng.choice(sorted(s.requests))
            s.finish_requests([victim])
            aborted.add(victim)
        for eco in s.update_from_output(out, result, now=float(step_no)):
            if eco.finish_reason is not None:
                rid = eco.request.request_id
                assert rid not in finished and rid not in aborted
                finished.add(rid)
        _check_step(s, out, runner, cfg, full_checks.random() < FULL_CHECK_SHARE)
        step_no += 1
    s.check_integrity()  # after the last step

    assert step_no >= MIN_STEPS
    assert finished | aborted == set(added) and not finished & aborted
    assert not s.requests and not s.running and not s.waiting
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks
    assert s.kv.host_pool.num_free_blocks == cfg["num_host_blocks"]
    for rid in finished:
        assert added[rid].output_token_ids == expected_output(added[rid], eos_at.get(rid)), rid
    # Probes: load was shed both ways, swap-outs fell back to recompute, the cache hit, blocks
    # freed by a swap-out were handed on in the same step, requests were aborted.
    st = s.stats
    assert st.num_preemptions > st.num_swapped_out > 0 and st.num_swapped_in > 0
    assert st.recomputed_tokens > 0
    assert s.kv.prefix_stats.hits > 0
    assert probes["swap_out_reused"] > 0
    if cfg["prioritize_prefill"]:
        # Only here can one step swap in (waiting phase) and then out (decode phase).
        assert probes["in_and_out_steps"] > 0
    assert len(aborted) > 0 and len(finished) > 500
