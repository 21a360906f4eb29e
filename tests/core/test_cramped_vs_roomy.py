"""The same requests give the same tokens whatever the pool and budget (FakeRunner's tokens
depend only on request id and position), and the cramped run really preempted and chunked."""

from __future__ import annotations

import random

import pytest

from tests.core.harness import (FakeRunner, expected_output, make_request, make_scheduler,
                                run_to_completion)

MAX_MODEL_LEN = 400


def _workload(seed: int):
    rng = random.Random(seed)
    reqs, eos_at = [], {}
    for i in range(40):
        prompt = rng.randint(1, 300)
        max_tokens = rng.randint(1, min(80, MAX_MODEL_LEN - prompt))
        rid = f"r{i}"
        reqs.append((rid, prompt, max_tokens, float(i), rng.randint(0, 3)))
        if rng.random() < 0.3:
            eos_at[rid] = rng.randrange(max_tokens)
    return reqs, eos_at


def _run(spec, eos_at, **config):
    s = make_scheduler(max_model_len=MAX_MODEL_LEN, **config)
    reqs = [make_request(rid, p, m, arrival=t, priority=pr) for rid, p, m, t, pr in spec]
    for r in reqs:
        s.add_request(r)
    finished = run_to_completion(s, FakeRunner(eos_at=eos_at))
    return s, reqs, finished


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed,threshold,partial,prefill_first",
                         [(1, 0, 1, False), (2, 48, 2, False), (3, 32, 3, True)])
def test_cramped_and_roomy_runs_give_identical_tokens(policy, seed, threshold, partial,
                                                      prefill_first):
    spec, eos_at = _workload(seed)
    roomy, reqs, roomy_out = _run(spec, eos_at, num_blocks=4000, block_size=16,
                                  max_num_batched_tokens=8192, scheduling_policy=policy)
    cramped, _, cramped_out = _run(
        spec, eos_at, num_blocks=30, block_size=16, max_num_batched_tokens=96, max_num_seqs=12,
        scheduler_reserve_full_isl=False, scheduling_policy=policy,
        long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
        prioritize_prefill=prefill_first)
    assert len(roomy_out) == len(reqs)
    assert cramped_out == roomy_out
    for r in reqs:
        assert roomy_out[r.request_id] == expected_output(r, eos_at.get(r.request_id))
    # Probes: the cramped run shed load and chunked; the roomy one did neither.
    assert cramped.stats.num_preemptions > 0
    assert cramped.stats.num_chunked_prefill_steps > 0
    assert cramped.stats.recomputed_tokens > 0
    assert sum(r.num_preemptions for r in reqs) == 0  # `reqs` are the roomy run's objects
    assert roomy.stats.num_preemptions == 0
    assert roomy.stats.num_steps < cramped.stats.num_steps
