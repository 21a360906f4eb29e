"""Sliding window (issue 36): blocks wholly before every future query's window go back to the
pool (core/sliding_window.py, KVCacheManager(sliding_window=W)), as vLLM v1 frees them. Each
test pairs what must survive (outputs, integrity, prefix hits) with a probe that blocks really
were freed."""

from __future__ import annotations

import pytest

from harness import FakeRunner, expected_output, make_request, run_to_completion
from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.core.sliding_window import first_block_in_window, num_blocks_to_skip

BS = 4


def _grow(kv: KVCacheManager, request, upto: int, chunk: int = 1) -> None:
    """Allocate and compute `chunk` tokens at a time until `upto` are computed (no runner)."""
    while request.num_computed_tokens < upto:
        n = min(chunk, upto - request.num_computed_tokens)
        assert kv.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        kv.register_computed_blocks(request)
        kv.check_integrity()


def test_the_first_block_in_window_is_the_one_the_next_query_still_reads():
    # next query at position 20 with W = 8 reads 13..20: block 3 (12..15) is the first read
    assert first_block_in_window(20, 8, BS) == 3
    assert first_block_in_window(7, 8, BS) == 0  # reads 0..7: nothing slid out
    assert num_blocks_to_skip(20, None, BS, None) == 0  # no window, nothing freed
    assert num_blocks_to_skip(20, 8, BS, 2) == 1  # the last published block is kept


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_blocks_before_the_window_return_to_the_pool(prefix_caching):
    kv = KVCacheManager(64, BS, enable_prefix_caching=prefix_caching, sliding_window=8)
    request = make_request("a", 4, 100)
    request.all_token_ids.extend(range(100, 140))  # 44 tokens known
    _grow(kv, request, 40)
    # the probe: the leading slots hold the null block, and those blocks are free again
    skipped = kv.num_freed_for_window("a")
    assert skipped == first_block_in_window(40, 8, BS) == 8
    assert kv.block_ids("a")[:skipped] == [0] * skipped
    assert 0 not in kv.block_ids("a")[skipped:]
    assert kv.num_free_blocks == kv.num_usable_blocks - (len(kv.block_ids("a")) - skipped)
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_without_a_window_nothing_is_freed():
    kv = KVCacheManager(64, BS)
    request = make_request("a", 4, 100)
    request.all_token_ids.extend(range(100, 140))
    _grow(kv, request, 40)
    assert kv.num_freed_for_window("a") == 0
    assert 0 not in kv.block_ids("a")
    assert kv.num_free_blocks == kv.num_usable_blocks - 10


def test_freed_published_blocks_still_hit_and_publishing_goes_on():
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, sliding_window=8)
    first = make_request("a", 32, 8)
    _grow(kv, first, 32, chunk=5)
    assert kv.num_freed_for_window("a") > 0  # probe: some published blocks went back
    # every full block of the prompt was published, past the freed ones too
    again = make_request("b", 32, 8)
    again.all_token_ids[:] = list(first.all_token_ids)
    hits = kv.get_computed_blocks(again)
    assert hits.num_blocks == (32 - 1) // BS  # all leading full blocks, freed ones included
    assert hits.num_evictable > 0  # some hits sit in the free list: the freed ones


def _scheduler(num_blocks: int, window):
    kv = KVCacheManager(num_blocks, BS, sliding_window=window)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(config, kv, 256)


def test_a_window_lets_a_cramped_pool_decode_without_preempting():
    """Three requests of 8 + 120 tokens in a 65-block pool (64 usable): without a window they
    need 96 blocks and preempt; with W = 16 each holds at most 6 blocks. The outputs are the
    same either way (the scheduler decides nothing by window)."""
    runs = {}
    for window in (None, 16):
        scheduler = _scheduler(65, window)
        requests = [make_request(f"r{i}", 8, 120, ignore_eos=True) for i in range(3)]
        for r in requests:
            scheduler.add_request(r)
        outputs = run_to_completion(scheduler, FakeRunner())
        assert outputs == {r.request_id: expected_output(r) for r in requests}
        runs[window] = (outputs, scheduler.stats.num_preemptions)
    assert runs[None][0] == runs[16][0]
    assert runs[None][1] > 0  # probe: the cramped pool really was too small without a window
    assert runs[16][1] == 0


def test_preempting_a_request_with_freed_slots_returns_every_block():
    scheduler = _scheduler(200, 8)
    request = make_request("r", 8, 60, ignore_eos=True)
    scheduler.add_request(request)
    runner = FakeRunner()
    for _ in range(30):
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out))
    assert scheduler.kv.num_freed_for_window("r") > 0  # probe
    scheduler.kv.free(request)
    scheduler.kv.check_integrity()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swapping_out_and_in_a_request_with_freed_slots(prefix_caching):
    """A cramped pool under swap preemption: swapped requests keep their null slots (only held
    blocks move to the host), come back behind them, and finish with the expected tokens;
    integrity after every step. Probes: swaps happened, and slots were freed."""
    kv = KVCacheManager(26, BS, enable_prefix_caching=prefix_caching, num_host_blocks=200,
                        sliding_window=32)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="swap",
                             watermark=0.0, scheduler_reserve_full_isl=False)
    scheduler = Scheduler(config, kv, 84)
    requests = [make_request(f"r{i}", 24, 60, ignore_eos=True) for i in range(6)]
    for r in requests:
        scheduler.add_request(r)
    runner, freed = FakeRunner(), 0
    outputs = {}
    for _ in range(5000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        freed = max(freed, sum(kv.num_freed_for_window(r.request_id) for r in requests))
        for eco in scheduler.update_from_output(out, runner.execute(out)):
            if eco.finish_reason is not None:
                outputs[eco.request.request_id] = eco.request.output_token_ids
        scheduler.check_integrity()
    assert outputs == {r.request_id: expected_output(r) for r in requests}
    assert scheduler.stats.num_swapped_out > 0  # probe: the pool was too small, and swapped
    assert scheduler.stats.num_swapped_in > 0
    assert freed > 0  # probe: window slots were freed


def test_forks_of_a_parent_with_freed_slots_keep_them_and_decode_the_same():
    """Parallel sampling (n = 3) of a 40-token prompt chunked 16 at a time under W = 8: the
    parent has freed slots when it forks, the samples take its table (null slots included,
    sharing only held blocks), and every sample's tokens match the run without a window.
    Probes: the samples really had freed slots; the window run held fewer blocks at its peak."""
    from tokenweir.request import SamplingParams, make_sample_group
    runs = {}
    for window in (None, 8):
        kv = KVCacheManager(200, BS, sliding_window=window)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16), kv, 96)
        request = make_request("g", 40, 30, ignore_eos=True)
        request.sampling_params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=30,
                                                 ignore_eos=True)
        make_sample_group(request)
        scheduler.add_request(request)
        runner, outputs, freed, peak = FakeRunner(), {}, 0, 0
        for _ in range(1000):
            if not scheduler.has_unfinished_requests():
                break
            out = scheduler.schedule()
            freed = max([freed] + [kv.num_freed_for_window(rid) for rid in ("g#1", "g#2")])
            peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
            for eco in scheduler.update_from_output(out, runner.execute(out)):
                if eco.finish_reason is not None:
                    outputs[eco.request.request_id] = list(eco.request.output_token_ids)
            scheduler.check_integrity()
        runs[window] = outputs, freed, peak
    assert sorted(runs[None][0]) == ["g", "g#1", "g#2"]
    assert runs[8][0] == runs[None][0]
    assert runs[8][1] > 0 and runs[None][1] == 0  # probe: the samples held freed slots
    assert runs[8][2] < runs[None][2]
