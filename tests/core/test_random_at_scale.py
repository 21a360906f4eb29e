"""A seeded random scheduler run of >= 100,000 steps with every feature on at once (issue 14):
chunked prefill, prefix caching, swap and auto preemption, cost victims, the slo policy's
pauses and mid-step cuts, aborts (tests/core/random_run.py). Invariants after every step;
at the end every request accounted for once, every output as if never preempted, both pools
free. Each probe below proves its feature really fired. benchmarks/random_scheduler_run.py
runs 1,000,000 such steps."""

from __future__ import annotations

import time

import pytest

from tests.core.random_run import random_run

pytestmark = pytest.mark.soak  # `make test-soak` (CI runs it after `make test`)

MIN_STEPS = 100_000


def test_random_run_at_scale_with_every_feature_keeps_invariants():
    start = time.perf_counter()
    stats = random_run(MIN_STEPS, seed=0, steps_per_segment=25_000)
    seconds = time.perf_counter() - start
    assert stats.steps >= MIN_STEPS
    assert stats.integrity_checks == stats.steps  # a full check after every step
    assert stats.request_checks > stats.steps and stats.kv_positions_checked > stats.steps
    c = stats.counters
    # Probes: load was shed both ways (swap, and recompute where swap fell back or auto chose
    # it), prompts were chunked, the cache hit, the slo policy paused and steps were cut,
    # requests were aborted, and most requests finished.
    assert c["preemptions"] > c["swapped_out"] > 0 and c["swapped_in"] > 0
    assert c["recomputed_tokens"] > 0 and c["chunked_prefill_steps"] > 0
    assert c["prefix_hits"] > 0
    assert c["slo_pauses"] > 0 and c["slo_cuts"] > 0 and stats.cuts > 0
    assert stats.aborted > 0 and stats.finished > 5_000
    print(f"{stats.steps} steps, {stats.invariant_checks} invariant checks, "
          f"{stats.requests} requests in {seconds:.1f} s; {c}")
