"""A prompt's full blocks packed once at its prefix lookup and sliced there and at its
publication (KVCacheManager._packed_prompt, issue 36, clus15) key exactly what packing each
block apart keys: two schedulers run the same seeded workloads (prefix groups, chunked
prefills, a cramped pool whose preemptions look prompts up again with their output, ids that
int64 does not hold), one with the one-call packing turned off, and every step's block ids,
outputs and prefix-cache map agree. Probes: prompts were packed in one call, others fell back,
the cache hit, chunks and preemptions happened, and the packings were dropped."""

from __future__ import annotations

import random

import pytest

from tests.core.harness import FakeRunner, make_prompt_request, make_scheduler

HUGE = 1 << 63  # beyond int64: a block holding it is keyed by its tuple


def _workload(seed: int, n: int = 60) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    groups = [[rng.randrange(3, 999) for _ in range(40)] for _ in range(4)]
    spec = []
    for i in range(n):
        shared = rng.choice(groups)[:rng.choice([0, 8, 16, 21, 40])]
        prompt = shared + [rng.randrange(3, 999) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.15:
            prompt[rng.randrange(len(prompt))] = HUGE + rng.randrange(3)
        spec.append((f"r{i}", prompt, rng.randint(1, 30)))
    return spec


def _cache(scheduler) -> dict:
    return {key: block.block_id for key, block in scheduler.kv.pool.cached.items()}


def _run(seed: int, packed: bool):
    scheduler = make_scheduler(num_blocks=40, block_size=4, max_model_len=128,
                               enable_prefix_caching=True, max_num_batched_tokens=24,
                               long_prefill_token_threshold=10)
    if not packed:
        scheduler.kv._packed_prompt = lambda request, num_blocks: None
    runner, rng = FakeRunner(), random.Random(seed + 1)
    pending, trace = _workload(seed), []
    for step in range(3000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                rid, prompt, max_tokens = pending.pop(0)
                scheduler.add_request(make_prompt_request(rid, prompt, max_tokens))
        if not pending and not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule(float(step))
        outputs = scheduler.update_from_output(out, runner.execute(out), float(step))
        scheduler.check_integrity()
        trace.append((dict(out.new_block_ids),
                      [(n.req_id, n.block_ids, n.num_computed_tokens)
                       for n in out.scheduled_new_reqs],
                      sorted(out.preempted_req_ids),
                      [(o.request.request_id, o.new_token_ids, o.finish_reason)
                       for o in outputs],
                      _cache(scheduler)))
    assert not scheduler.has_unfinished_requests()
    return trace, scheduler


@pytest.mark.parametrize("seed", range(6))
def test_packed_prompts_key_what_packing_each_block_keys(seed):
    fast, fast_sched = _run(seed, packed=True)
    plain, plain_sched = _run(seed, packed=False)
    assert len(fast) == len(plain)
    for k, (a, b) in enumerate(zip(fast, plain)):
        assert a == b, f"step {k} differs"
    kv, stats = fast_sched.kv, fast_sched.stats
    assert kv.num_packed_prompts > 20 and plain_sched.kv.num_packed_prompts == 0  # probes
    assert any(isinstance(key[2], tuple) for *_, cache in fast for key in cache)  # HUGE ids
    assert kv.prefix_stats.hits > 0 and stats.num_preemptions > 0
    assert not kv._packed  # each dropped: published to its end, or freed


def test_a_packing_is_dropped_when_its_request_is_freed_unpublished():
    scheduler = make_scheduler(num_blocks=40, block_size=4, max_model_len=128,
                               enable_prefix_caching=True)
    request = make_prompt_request("a", list(range(3, 30)), 4)
    scheduler.add_request(request)
    scheduler.kv.get_computed_blocks(request)
    assert "a" in scheduler.kv._packed  # probe: the lookup packed it
    scheduler.finish_requests(["a"])
    assert not scheduler.kv._packed


def test_a_lookup_of_more_blocks_than_packed_packs_again():
    """A request whose tokens grew since its last lookup (its output, before a recompute) is
    looked up over all its full blocks, not only those packed before."""
    scheduler = make_scheduler(num_blocks=40, block_size=4, max_model_len=128,
                               enable_prefix_caching=True)
    kv, tokens = scheduler.kv, list(range(3, 40))
    other = make_prompt_request("b", tokens, 4)
    kv.allocate_slots(other, len(tokens), computed_blocks=kv.get_computed_blocks(other))
    other.num_computed_tokens = len(tokens)
    kv.register_computed_blocks(other)  # its 9 full blocks cached
    request = make_prompt_request("a", tokens[:13], 4)
    assert len(kv.get_computed_blocks(request)) == 3  # packed: its 3 full blocks
    request.all_token_ids.extend(tokens[13:])
    assert len(kv.get_computed_blocks(request)) == 9
