"""Admission control (watermark, full-sequence check) and start-up refusals."""

from __future__ import annotations

import pytest

from tests.core.harness import FakeRunner, make_request, make_scheduler, step
from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.sched.scheduler import Scheduler

# 100 usable blocks of 4 tokens.
POOL = dict(num_blocks=101, block_size=4, max_model_len=400)


# ---- watermark ----------------------------------------------------------------------------
def _with_running_a(watermark, b_prompt):
    """a (338 tokens = 85 blocks) runs; b (b_prompt tokens) waits behind it."""
    s = make_scheduler(**POOL, watermark=watermark, scheduler_reserve_full_isl=False,
                       max_num_batched_tokens=512)
    runner = FakeRunner()
    a = make_request("a", 338, 40)
    s.add_request(a)
    step(s, runner)
    assert s.kv.num_held_blocks("a") == 85 and s.kv.num_free_blocks == 15
    b = make_request("b", b_prompt, 4)
    s.add_request(b)
    return s, runner, a, b


def test_watermark_blocks_admission_while_something_runs():
    s, runner, a, b = _with_running_a(watermark=0.1, b_prompt=24)  # b needs 6 > 15 - 10
    assert s.watermark_blocks == 10
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1}
    assert list(s.waiting) == [b]


@pytest.mark.parametrize("watermark,b_prompt", [(0.0, 24), (0.1, 20)])
def test_watermark_probe_admits_what_fits_outside_it(watermark, b_prompt):
    """Probes for the refusal above: no watermark admits the same b; a 5-block b fits."""
    s, runner, a, b = _with_running_a(watermark=watermark, b_prompt=b_prompt)
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": b_prompt}


def test_running_requests_grow_into_the_watermark():
    s, runner, a, b = _with_running_a(watermark=0.1, b_prompt=24)
    least_free = s.kv.num_free_blocks
    while not a.is_finished:
        out = s.schedule()
        assert out.num_scheduled_tokens == {"a": 1}  # b never gets in while a runs
        least_free = min(least_free, s.kv.num_free_blocks)
        s.update_from_output(out, runner.execute(out))
    assert least_free == 100 - 95 < s.watermark_blocks  # a dipped into the watermark
    assert s.stats.num_preemptions == 0
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"b": 24}  # a gone: b admitted


def test_with_nothing_running_a_request_may_take_the_watermark():
    s = make_scheduler(**POOL, watermark=0.1, scheduler_reserve_full_isl=False,
                       max_num_batched_tokens=512)
    big = make_request("big", 380, 4)  # 95 blocks > 100 - 10
    s.add_request(big)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"big": 380}


def test_the_same_request_is_refused_when_something_runs():
    s = make_scheduler(**POOL, watermark=0.1, scheduler_reserve_full_isl=False,
                       max_num_batched_tokens=512)
    runner = FakeRunner()
    s.add_request(make_request("tiny", 2, 50))
    step(s, runner)
    s.add_request(make_request("big", 380, 4))  # 95 blocks > 99 free - 10
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"tiny": 1}


# ---- full-sequence check ------------------------------------------------------------------
@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_full_sequence_check(reserve_full_isl):
    s = make_scheduler(**POOL, watermark=0.0, scheduler_reserve_full_isl=reserve_full_isl,
                       max_num_batched_tokens=512)
    runner = FakeRunner()
    s.add_request(make_request("a", 200, 4))  # 50 blocks held
    step(s, runner)
    assert s.kv.num_free_blocks == 50
    b = make_request("b", 40, 200)  # first chunk 10 blocks; prompt + max_tokens = 60 blocks
    s.add_request(b)
    out, _ = step(s, runner)
    if reserve_full_isl:
        assert out.num_scheduled_tokens == {"a": 1}
        assert s.kv.num_held_blocks("b") == 0
        while "b" not in out.num_scheduled_tokens:  # admitted once a has finished
            out, _ = step(s, runner)
        assert s.requests.get("a") is None
    else:
        assert out.num_scheduled_tokens == {"a": 1, "b": 40}
        assert s.kv.num_held_blocks("b") == 10


# ---- start-up refusals --------------------------------------------------------------------
def test_pool_too_small_for_one_max_model_len_request_is_refused():
    with pytest.raises(ValueError) as exc:
        make_scheduler(num_blocks=10, block_size=16, max_model_len=1000)
    msg = str(exc.value)
    assert "1000" in msg and "63 blocks" in msg and "9 usable" in msg and "16 tokens" in msg


def test_pool_exactly_one_max_model_len_request_is_accepted():
    make_scheduler(num_blocks=64, block_size=16, max_model_len=1000)  # 63 usable blocks
    with pytest.raises(ValueError):
        make_scheduler(num_blocks=63, block_size=16, max_model_len=1000)


def test_chunking_off_with_budget_below_max_model_len_is_refused():
    """Without chunked prefill a prompt longer than the budget could never be scheduled (and a
    preempted request longer than it could never come back): refuse at start-up."""
    with pytest.raises(ValueError) as exc:
        make_scheduler(max_model_len=4096, max_num_batched_tokens=2048,
                       enable_chunked_prefill=False)
    assert "2048" in str(exc.value) and "4096" in str(exc.value)
    make_scheduler(max_model_len=2048, max_num_batched_tokens=2048, enable_chunked_prefill=False)
    make_scheduler(max_model_len=4096, max_num_batched_tokens=2048, enable_chunked_prefill=True)


def test_invalid_scheduler_config_is_refused():
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        Scheduler(SchedulerConfig(max_num_partial_prefills=0), KVCacheManager(100, 16), 64)
    s = make_scheduler(num_blocks=1000, block_size=16, max_model_len=4096)
    with pytest.raises(ValueError, match="4200 exceeds max_model_len=4096"):
        s.add_request(make_request("x", 4000, 200))
    s.add_request(make_request("x", 4000, 96))
    assert len(s.waiting) == 1
