"""The token budget and max_num_seqs; running before waiting; prioritize_prefill."""

from __future__ import annotations

import pytest

from tests.core.harness import FakeRunner, make_request, make_scheduler, step


def _run_checking_caps(s, runner, budget, max_seqs):
    """Run to idle; assert the caps every step; return (budget-full steps, seq-full steps,
    most requests scheduled in one step)."""
    full_budget = full_seqs = most = 0
    while s.has_unfinished_requests():
        out, _ = step(s, runner)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= budget
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        if max_seqs:
            assert len(out.num_scheduled_tokens) <= max_seqs
            assert s.num_running <= max_seqs
        full_budget += out.total_num_scheduled_tokens == budget
        full_seqs += s.num_running == max_seqs and len(s.waiting) > 0
        most = max(most, len(out.num_scheduled_tokens))
        s.check_integrity()
    return full_budget, full_seqs, most


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_budget_and_max_num_seqs_never_exceeded(policy):
    budget, max_seqs = 96, 6
    s = make_scheduler(num_blocks=2000, block_size=16, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs, scheduling_policy=policy)
    runner = FakeRunner()
    for i in range(40):
        s.add_request(make_request(f"r{i}", 5 + (i * 53) % 300, 3 + i % 17, arrival=i,
                                   priority=i % 3))
    full_budget, full_seqs, most = _run_checking_caps(s, runner, budget, max_seqs)
    assert full_budget > 0 and full_seqs > 0  # probes: both caps were actually binding
    assert most == max_seqs


def test_max_num_seqs_zero_is_unlimited():
    n = 300  # more than the default max_num_seqs (256)
    s = make_scheduler(num_blocks=2000, block_size=16, max_num_batched_tokens=4096,
                       max_num_seqs=0)
    runner = FakeRunner()
    for i in range(n):
        s.add_request(make_request(f"r{i}", 4, 5))
    _, _, most = _run_checking_caps(s, runner, 4096, 0)
    assert most == n


def test_running_requests_are_served_before_waiting_ones():
    s = make_scheduler(num_blocks=1000, block_size=16, max_num_batched_tokens=8)
    runner = FakeRunner()
    decoders = [make_request(f"d{i}", 2, 50) for i in range(4)]
    for d in decoders:
        s.add_request(d)
    step(s, runner)  # 4 x 2 prompt tokens = the whole budget
    s.add_request(make_request("big", 100, 5))
    for _ in range(3):
        out, _ = step(s, runner)
        assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "big": 4}


@pytest.mark.parametrize("prioritize_prefill", [False, True])
def test_running_prefill_takes_budget_before_waiting_admissions(prioritize_prefill):
    s = make_scheduler(num_blocks=1000, block_size=16, max_num_batched_tokens=512,
                       max_num_partial_prefills=4, prioritize_prefill=prioritize_prefill)
    runner = FakeRunner()
    s.add_request(make_request("first", 1500, 5))
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"first": 512}
    s.add_request(make_request("second", 10, 5))
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"first": 512}  # "second" gets nothing
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"first": 476, "second": 10}


@pytest.mark.parametrize("prioritize_prefill", [False, True])
def test_prioritize_prefill_puts_prefills_first(prioritize_prefill):
    s = make_scheduler(num_blocks=1000, block_size=16, max_num_batched_tokens=1024,
                       prioritize_prefill=prioritize_prefill)
    runner = FakeRunner()
    decoders = [make_request(f"d{i}", 3, 50) for i in range(4)]
    for d in decoders:
        s.add_request(d)
    step(s, runner)
    assert all(d.num_output_tokens == 1 for d in decoders)
    s.add_request(make_request("p", 2000, 5))
    out, _ = step(s, runner)
    if prioritize_prefill:
        # The prefill took the whole budget: no decode this step.
        assert out.num_scheduled_tokens == {"p": 1024}
    else:
        assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "p": 1020}
    out, _ = step(s, runner)
    if prioritize_prefill:
        # 976 prompt tokens left: the decodes fill what the prefill leaves of the budget.
        assert out.num_scheduled_tokens == {"p": 976, "d0": 1, "d1": 1, "d2": 1, "d3": 1}
        assert list(out.num_scheduled_tokens)[0] == "p"
    else:
        assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "p": 980}


def test_prioritize_prefill_drops_decodes_only_when_budget_is_exhausted():
    s = make_scheduler(num_blocks=1000, block_size=16, max_num_batched_tokens=1024,
                       prioritize_prefill=True)
    runner = FakeRunner()
    decoders = [make_request(f"d{i}", 3, 50) for i in range(4)]
    for d in decoders:
        s.add_request(d)
    step(s, runner)
    s.add_request(make_request("p", 1022, 5))
    out, _ = step(s, runner)
    # 1022 prompt tokens + 2 of the 4 decodes fill the budget exactly; d2, d3 wait.
    assert out.num_scheduled_tokens == {"p": 1022, "d0": 1, "d1": 1}
    assert [d.num_output_tokens for d in decoders] == [2, 2, 1, 1]
