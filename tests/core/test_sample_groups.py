"""Parallel sampling in the scheduler and the KV cache manager (issue 15): a group's samples
share the parent's prompt blocks by ref counts, each copies the block it first writes into
while another still holds it (copy-on-write), preempting one sample frees only its own blocks,
and memory pressure never changes a token. KVContentRunner models the KV bytes: every read is
checked against the request's own token history and every write must go into a block its
writer holds alone, so a missed or misplaced copy fails loudly."""

from __future__ import annotations

import random

import pytest

from tests.core.harness import (KVContentRunner, expected_output, make_request, make_scheduler,
                                run_to_completion, step)
from tokenweir.request import RequestStatus, SamplingParams, make_sample_group


def group_request(rid: str, prompt_len: int, max_tokens: int, n: int,
                  best_of: int | None = None, arrival: float = 0.0):
    request = make_request(rid, prompt_len, max_tokens, arrival=arrival, ignore_eos=True)
    request.sampling_params = SamplingParams(temperature=1.0, n=n, best_of=best_of, seed=7,
                                             max_tokens=max_tokens, ignore_eos=True)
    group = make_sample_group(request)
    assert group is not None and group.parent is request
    return request


def tables(sched) -> dict[str, list[int]]:
    return {rid: sched.kv.block_ids(rid) for rid in sched.requests}


def ref_counts(sched) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in sched.kv.pool.blocks[1:] if b.ref_cnt}


def test_sample_params_and_ids():
    request = group_request("a", 10, 8, n=3)
    samples = request.group.samples
    assert [s.request_id for s in samples] == ["a", "a#1", "a#2"]
    assert [s.sampling_params.seed for s in samples] == [7, 8, 9]
    assert all(s.sampling_params.n == 1 and s.sampling_params.best_of is None for s in samples)
    assert request.group.params.n == 3 and request.group.size == 3
    ranked = group_request("b", 10, 8, n=2, best_of=4)
    assert ranked.group.size == 4
    assert all(s.sampling_params.logprobs == 0 for s in ranked.group.samples)  # to rank them
    alone = make_request("c", 10, 8)
    assert make_sample_group(alone) is None and alone.group is None


@pytest.mark.parametrize("params, message", [
    (dict(n=0), "n must be"), (dict(n=2, best_of=1), "best_of must be"),
    (dict(n=2, best_of=3, temperature=0), "greedy"), (dict(n=1.5), "n must be"),
    (dict(n=3, seed=2**64 - 2), "seed must be"), (dict(n=257), "n must be")])
def test_bad_sampling_counts_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_fork_copy_on_write_preemption_and_finish_exact_blocks():
    """Prompt 10 tokens, blocks of 4, n = 3, a pool of 6 usable blocks."""
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24)
    sched.add_request(group_request("a", 10, 8, n=3))
    runner = KVContentRunner(sched.kv.pool, 4)

    out, _ = step(sched, runner)  # the parent prefills the prompt once, then forks
    assert out.num_scheduled_tokens == {"a": 10}
    assert tables(sched) == {"a": [1, 2, 3], "a#1": [1, 2, 3], "a#2": [1, 2, 3]}
    assert ref_counts(sched) == {1: 3, 2: 3, 3: 3}
    assert [r.request_id for r in sched.running] == ["a", "a#1", "a#2"]

    out, _ = step(sched, runner)  # each writes into block 3: two copy it, the last owns it
    assert out.num_scheduled_tokens == {"a": 1, "a#1": 1, "a#2": 1}
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ("a", 10), ("a#1", 9), ("a#2", 9)]  # new to the runner: whole tables
    assert out.blocks_to_copy == [(3, 4), (3, 5)]
    assert tables(sched) == {"a": [1, 2, 4], "a#1": [1, 2, 5], "a#2": [1, 2, 3]}
    assert ref_counts(sched) == {1: 3, 2: 3, 3: 1, 4: 1, 5: 1}

    step(sched, runner)
    out, _ = step(sched, runner)
    assert tables(sched)["a"] == [1, 2, 4, 6] and sched.kv.num_free_blocks == 0
    out, _ = step(sched, runner)  # a#1 needs a block: the tail sample (a#2) is the victim
    assert out.preempted_req_ids == {"a#2"}
    assert sched.requests["a#2"].status == RequestStatus.PREEMPTED
    assert tables(sched) == {"a": [1, 2, 4, 6], "a#1": [1, 2, 5, 3], "a#2": []}
    assert ref_counts(sched) == {1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1}  # only its own freed

    outputs = run_to_completion(sched, runner)
    assert sorted(outputs) == ["a", "a#1", "a#2"]
    assert ref_counts(sched) == {} and sched.kv.num_free_blocks == 6
    assert runner.copies == 2 and runner.context_checks > 0


def test_full_last_prompt_block_is_copied_by_the_samples_only():
    """Prompt 8 = two full blocks: the parent's next token starts a new block; the samples
    rewrite position 7 in block 2, which the parent keeps: both copy it."""
    sched = make_scheduler(num_blocks=20, block_size=4, max_model_len=24)
    sched.add_request(group_request("a", 8, 4, n=3))
    runner = KVContentRunner(sched.kv.pool, 4)
    step(sched, runner)
    assert tables(sched) == {"a": [1, 2], "a#1": [1, 2], "a#2": [1, 2]}
    out, _ = step(sched, runner)
    assert out.blocks_to_copy == [(2, 4), (2, 5)]
    assert tables(sched) == {"a": [1, 2, 3], "a#1": [1, 4], "a#2": [1, 5]}
    assert ref_counts(sched) == {1: 3, 2: 1, 3: 1, 4: 1, 5: 1}
    run_to_completion(sched, runner)
    assert ref_counts(sched) == {}


def test_prompt_is_prefilled_once():
    sched = make_scheduler(num_blocks=100, block_size=4, max_model_len=64)
    sched.add_request(group_request("a", 21, 6, n=4))
    runner = KVContentRunner(sched.kv.pool, 4)
    scheduled = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        scheduled += out.total_num_scheduled_tokens
    # 21 prompt tokens once, the last prompt token again for 3 samples, 5 decodes x 4
    assert scheduled == 21 + 3 + 4 * 5
    assert sched.stats.prompt_tokens == 21


def test_abort_before_the_fork_finishes_every_sample():
    sched = make_scheduler(num_blocks=100, block_size=4, max_model_len=64,
                           max_num_batched_tokens=16)
    parent = group_request("a", 40, 4, n=3)
    sched.add_request(parent)
    runner = KVContentRunner(sched.kv.pool, 4)
    step(sched, runner)  # a 16-token chunk: no first token yet
    assert not parent.group.forked
    sched.finish_requests(["a"])
    assert [s.status for s in parent.group.samples] == [RequestStatus.FINISHED_ABORTED] * 3
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"a", "a#1", "a#2"}
    assert ref_counts(sched) == {} and not sched.has_unfinished_requests()


def test_a_group_takes_a_seat_per_sample():
    sched = make_scheduler(num_blocks=200, block_size=4, max_model_len=64, max_num_seqs=4)
    sched.add_request(group_request("g", 12, 4, n=3))
    sched.add_request(make_request("x", 8, 4, arrival=1.0))
    sched.add_request(make_request("y", 8, 4, arrival=2.0))
    runner = KVContentRunner(sched.kv.pool, 4)
    out = sched.schedule()
    assert sorted(out.num_scheduled_tokens) == ["g", "x"]  # y waits: 3 + 1 seats taken
    sched.update_from_output(out, runner.execute(out))
    assert len(sched.running) == 4  # the fork filled the seats it had reserved
    sched.check_integrity()
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request(group_request("big", 8, 4, n=5))


def _groups(rng: random.Random, count: int) -> list:
    requests = []
    for i in range(count):
        n = rng.choice([1, 2, 4])
        if n == 1:
            requests.append(make_request(f"r{i}", rng.randint(3, 40), rng.randint(1, 24),
                                         arrival=float(i), ignore_eos=True))
        else:
            requests.append(group_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 24), n,
                                          arrival=float(i)))
    return requests


def _expected(requests) -> dict[str, list[int]]:
    samples = [s for r in requests for s in (r.group.samples if r.group else [r])]
    return {s.request_id: expected_output(s) for s in samples}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cramped_equals_roomy_with_groups(mode, prefix, seed):
    """Random groups of 1, 2 and 4 samples in a pool too small for them: every sample's tokens
    are what it gets alone; every read is checked against the KV bytes."""
    requests = _groups(random.Random(seed), 12)
    sched = make_scheduler(num_blocks=24, block_size=4, max_model_len=64,
                           enable_prefix_caching=prefix, num_host_blocks=64,
                           preemption_mode=mode, max_num_batched_tokens=32,
                           scheduler_reserve_full_isl=False)
    for request in requests:
        sched.add_request(request)
    runner = KVContentRunner(sched.kv.pool, 4)
    assert run_to_completion(sched, runner) == _expected(requests)
    assert sched.stats.num_preemptions > 0, "the cramped pool never preempted"
    assert runner.copies > 0 and runner.context_checks > 0
    if mode == "swap":
        assert sched.stats.num_swapped_out > 0
    assert ref_counts(sched) == {}


def test_a_preempted_sample_recomputes_from_the_prefix_cache():
    """With prefix caching, a sample preempted after the fork finds the prompt's full blocks
    (still held by its siblings) and recomputes only its tail."""
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24,
                           enable_prefix_caching=True)
    sched.add_request(group_request("a", 10, 8, n=3))
    runner = KVContentRunner(sched.kv.pool, 4)
    for _ in range(5):
        out, _ = step(sched, runner)
    assert out.preempted_req_ids == {"a#2"}
    while "a#2" not in out.num_scheduled_tokens:
        out, _ = step(sched, runner)
    [readmitted] = [n for n in out.scheduled_new_reqs if n.req_id == "a#2"]
    assert readmitted.num_computed_tokens == 8  # blocks 1 and 2 were cache hits
    assert readmitted.block_ids[:2] == [1, 2]
    run_to_completion(sched, runner)
    assert ref_counts(sched) == {}
