"""The simulator's speed paths give exactly what the plain paths give: exact ITL counts, the
latency models' one-pass totals, and the KV manager's "nothing to register" shortcut."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tokenweir.core.kv_cache_manager import KVCacheManager, block_key_packer, block_tokens_key
from tokenweir.sim.build import build_simulation
from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.hardware import get_hardware, get_shape
from tokenweir.sim.latency import (NoisyLatencyModel, RooflineLatencyModel, StepTotals,
                                   decode_predictor)
from tokenweir.sim.metrics import describe, percentile, summarize
from tokenweir.sim.sim_engine import make_request
from tokenweir.sim.sim_runner import _TOKEN_STRIDE, SimRunner
from tokenweir.sim.workload import synthetic

SMALL = "smollm2-135m"


def test_value_counts_percentiles_and_mean_match_the_full_sorted_sample():
    rng = random.Random(5)
    sample = [rng.choice([0.001, 0.0025, 0.003, 0.0125, 0.2]) for _ in range(997)]
    counts = ValueCounts(sample)
    ordered = sorted(sample)
    assert len(counts) == len(sample)
    assert list(counts) == ordered
    for p in (0, 1, 50, 90, 99, 99.9, 100):
        assert counts.percentile(p) == percentile(ordered, p)
    assert counts.mean() == pytest.approx(sum(sample) / len(sample), rel=1e-12)
    assert describe(counts) == pytest.approx(describe(sample), rel=1e-12)
    assert describe(ValueCounts())["p50"] != describe(ValueCounts())["p50"]  # nan when empty


def test_value_counts_fold_their_adds_into_the_map_an_eager_add_makes():
    """`add` defers (pending lists); `counts`, read at any point, is the dict that adding each
    value at once would have made: the same counts, in the same order of first appearance."""
    rng = random.Random(8)
    counts, eager = ValueCounts(), {}
    for i in range(3000):
        value, weight = rng.choice([0.5, 0.25, 3.0, rng.random()]), rng.randint(1, 9)
        counts.add(value, weight)
        eager[value] = eager.get(value, 0) + weight
        if i % 397 == 0 or i == 2999:
            assert list(counts.counts.items()) == list(eager.items())
    merged = ValueCounts()
    merged.extend(counts)
    merged.extend([0.25, 7.0])
    eager[0.25] += 1
    eager[7.0] = 1
    assert list(merged.counts.items()) == list(eager.items())
    assert len(merged) == sum(eager.values())


def _specs():
    return synthetic(120, 400.0, seed=7, prompt="lognormal:100:0.7", output="uniform:2:40",
                     num_prefix_groups=2, prefix_len=48, max_model_len=1024)


def test_itl_as_counts_summarizes_exactly_like_itl_in_order():
    engine = {"max_model_len": 1024, "num_gpu_blocks_override": 120,
              "max_num_batched_tokens": 256, "scheduler_reserve_full_isl": False}
    in_order = build_simulation(engine, _specs(), SMALL, "h100", check=True).run()
    as_counts = build_simulation(engine, _specs(), SMALL, "h100", itl_counts=True).run()
    assert isinstance(as_counts.itl, ValueCounts)
    # Counts mode also takes the scheduler's bulk path for plain decodes (ids, no output
    # objects): every record, step and counter must come out the same.
    assert [dataclasses.asdict(r) for r in as_counts.requests] == \
        [dataclasses.asdict(r) for r in in_order.requests]
    assert as_counts.steps == in_order.steps and as_counts.stats == in_order.stats
    assert in_order.stats.num_preemptions > 0  # gaps that span a preemption are covered
    assert len(as_counts.itl) == len(in_order.itl) > 1000
    assert list(as_counts.itl) == sorted(in_order.itl)
    assert len(as_counts.itl.counts) < len(in_order.itl) / 5  # the point: few distinct values
    a, b = summarize(in_order), summarize(as_counts)
    for key in ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms"):
        assert a[key] == b[key]
    assert a["itl_mean_ms"] == pytest.approx(b["itl_mean_ms"], rel=1e-12)


@pytest.mark.parametrize("tp", [1, 4])
def test_roofline_totals_equal_the_per_request_prediction(tp):
    model = RooflineLatencyModel(get_shape("llama-7b"), get_hardware("h100"), tp)
    rng = random.Random(tp)
    for _ in range(200):
        chunks = [(rng.choice([1, 1, 1, rng.randint(2, 700)]), rng.randint(0, 3000))
                  for _ in range(rng.randint(1, 40))]
        reference = _roofline_by_hand(model, chunks)
        assert model.step_time(chunks) == reference
        assert model.predict_totals(StepTotals.of_chunks(chunks)) == reference


@pytest.mark.parametrize("shape,tp", [("llama-7b", 1), ("llama-7b", 4), ("mixtral-8x7b", 2)])
def test_a_pure_decode_prediction_is_the_totals_prediction(shape, tp):
    """`predict_decodes(n, context)` (a decode stretch's step) returns, bit for bit,
    `predict_totals` of the StepTotals it stands for, and the per-request roofline; the
    stretch takes it (`decode_predictor`) only from the roofline itself: not through a noisy
    wrapper (its draws go through predict_totals), nor from a subclass overriding
    predict_totals."""
    model = RooflineLatencyModel(get_shape(shape), get_hardware("h100"), tp)
    rng = random.Random(7)
    for _ in range(300):
        contexts = [rng.randint(1, 4000) for _ in range(rng.randint(1, 256))]
        n, context = len(contexts), sum(contexts)
        want = model.predict_totals(StepTotals(n, n, n, context, context, n, context))
        assert model.predict_decodes(n, context) == want
        assert want == _roofline_by_hand(model, [(1, c) for c in contexts])
    assert decode_predictor(model) is not None

    class Overriding(RooflineLatencyModel):  # e.g. benchmarks/vs_vidur.py's op-time model
        def predict_totals(self, t: StepTotals) -> float:
            return 1.0
    noisy = NoisyLatencyModel(model, 0.1)
    assert decode_predictor(noisy) is None  # it forwards predict_decodes to its base
    assert decode_predictor(Overriding(get_shape(shape), get_hardware("h100"), tp)) is None


def _roofline_by_hand(model: RooflineLatencyModel, chunks) -> float:
    """The per-request sums of the roofline's docstring, written out."""
    tokens = rows = attn_units = kv_tokens = 0
    for q, c in chunks:
        tokens += q
        rows += 1
        attn_units += q * (2 * c + q + 1)
        kv_tokens += c + 2 * q
    return model._combine(tokens, rows, attn_units, kv_tokens)


def test_sim_runner_totals_match_the_step_it_ran():
    """The sums the SimRunner gathers while advancing equal those of the step's chunks."""
    engine = {"max_model_len": 1024, "num_gpu_blocks_override": 400,
              "max_num_batched_tokens": 256, "long_prefill_token_threshold": 64}
    sim = build_simulation(engine, _specs(), SMALL, "h100")
    sim.instance.stretch = None  # its steps' outputs list only the requests beside the rows
    seen = []
    runner = sim.runner
    original = runner._advance

    def spy(out, fast):
        before = {rid: runner.computed[rid] for rid in out.num_scheduled_tokens}
        sampled, totals = original(out, fast)
        chunks = [(q, before[rid]) for rid, q in out.num_scheduled_tokens.items()]
        seen.append((totals, StepTotals.of_chunks(chunks)))
        return sampled, totals

    runner._advance = spy
    sim.run()
    assert len(seen) > 50
    assert any(t.num_decode_reqs and t.num_prefill_tokens for t, _ in seen)  # mixed steps ran
    assert all(got == want for got, want in seen)


def test_registration_shortcut_leaves_nothing_unpublished():
    """After every update, the full registration rule finds nothing left to publish, though
    the update skipped it for most requests; swap-outs (which unpublish blocks, the case the
    shortcut must not miss) really happen in this run."""
    engine = {"max_model_len": 1024, "num_gpu_blocks_override": 110,
              "max_num_batched_tokens": 256, "scheduler_reserve_full_isl": False,
              "preemption_mode": "swap", "swap_space": 0.01}
    sim = build_simulation(engine, _specs(), SMALL, "h100", check=True)
    kv: KVCacheManager = sim.scheduler.kv
    counted = {"skipped": 0, "registered": 0}
    update = sim.scheduler.update_from_output

    def checking_update(out, runner_out, now=0.0, decoded=None):
        behind = set(kv.registration_behind)
        for rid, n in out.num_scheduled_tokens.items():
            request = sim.scheduler.requests.get(rid)
            if request is not None:  # the shortcut's test, as update will see it
                filled = (request.num_computed_tokens + n) % kv.block_size < n
                counted["registered" if filled or rid in behind else "skipped"] += 1
        result = update(out, runner_out, now, decoded)
        for rid in out.num_scheduled_tokens:
            request = sim.scheduler.requests.get(rid)
            if request is None or rid not in kv.num_registered:
                continue
            before = kv.num_registered[rid]
            kv.register_computed_blocks(request)
            assert kv.num_registered[rid] == before, f"{rid}: a full block was left unpublished"
        return result

    sim.scheduler.update_from_output = checking_update
    result = sim.run()
    assert result.stats.num_swapped_out > 0
    assert counted["skipped"] > 1000 and counted["registered"] > 50


def test_a_run_makes_no_reference_cycles_so_pausing_the_collector_leaks_nothing():
    """Simulation.run pauses the cyclic GC; that is only safe if the loop leaves no cycles.
    A cramped pool with swap, prefix groups and chunking exercises every path."""
    import gc

    engine = {"max_model_len": 1024, "num_gpu_blocks_override": 110,
              "max_num_batched_tokens": 256, "scheduler_reserve_full_isl": False,
              "preemption_mode": "swap", "swap_space": 0.01, "long_prefill_token_threshold": 64}
    sim = build_simulation(engine, _specs(), SMALL, "h100", itl_counts=True)
    gc.collect()
    assert gc.isenabled()
    result = sim.run()
    assert gc.isenabled()  # restored
    assert result.stats.num_preemptions > 0 and result.stats.num_swapped_out > 0
    assert gc.collect() == 0


def test_a_step_that_only_preempts_is_followed_by_another_not_by_idling():
    """Auto preemption with cost victims on a cramped pool: a step whose requester is its own
    victim schedules nothing. The simulator must step again (the victims can be re-admitted)
    rather than go idle waiting for an arrival: this workload used to stall at its end."""
    specs = synthetic(400, 300.0, seed=2, prompt="lognormal:120:0.9", output="lognormal:40:0.9",
                      arrival="gamma", cv=2.0, num_prefix_groups=4, prefix_len=64,
                      priority_mix="0:0.7,1:0.3", max_model_len=1024)
    engine = {"max_model_len": 1024, "max_num_batched_tokens": 256,
              "num_gpu_blocks_override": 120, "scheduler_reserve_full_isl": False,
              "preemption_mode": "auto", "preemption_policy": "cost", "swap_space": 0.01}
    sim = build_simulation(engine, specs, SMALL, "h100", check=True)
    schedule, preempt_only = sim.scheduler.schedule, []

    def spy(now=0.0):
        out = schedule(now)
        if out.is_empty and out.preempted_req_ids:
            preempt_only.append(now)
        return out

    sim.scheduler.schedule = spy
    result = sim.run()
    assert preempt_only  # the case really happened
    assert all(r.num_finishes == 1 for r in result.requests) and len(result.requests) == 400


def test_runner_decoding_fast_path_gives_what_the_per_row_path_gives():
    """SimRunner's fast path for decoding requests (one small int each, contexts from the
    output) samples, times and leaves state exactly as the per-row path does: a run with it,
    one without it, and one that leaves it every few steps (back to per-row state, then in
    again) come out the same; before every step the runner's counts are the scheduler's."""
    engine = {"max_model_len": 1024, "num_gpu_blocks_override": 120,
              "max_num_batched_tokens": 256, "scheduler_reserve_full_isl": False}
    sims = [build_simulation(engine, _specs(), SMALL, "h100", itl_counts=True)
            for _ in range(3)]
    for sim in sims:  # every step through `execute` (a decode stretch would bypass it)
        sim.instance.stretch = None
    fast, plain, toggled = sims
    plain.runner._fast_path_for = lambda out, predict_totals: False
    moved, steps, left = [0], [0], [0]
    start_decoding = fast.runner._start_decoding

    def counting(*args):
        moved[0] += 1
        start_decoding(*args)

    fast.runner._start_decoding = counting
    fast_path_for = toggled.runner._fast_path_for

    def every_fifth_step_off(out, predict_totals):
        return steps[0] % 5 != 0 and fast_path_for(out, predict_totals)

    leave = toggled.runner._leave_fast_path

    def counting_leave():
        left[0] += 1
        leave()

    toggled.runner._fast_path_for = every_fifth_step_off
    toggled.runner._leave_fast_path = counting_leave
    advance = toggled.runner._advance

    def checked_advance(out, fast):
        steps[0] += 1
        runner, requests = toggled.runner, toggled.scheduler.requests
        computed, known = runner.computed, runner.known
        assert computed.keys() == known.keys() and len(computed) == runner.num_tracked
        for rid in out.num_scheduled_tokens:
            assert computed[rid] == requests[rid].num_computed_tokens
            assert known[rid] == len(requests[rid].all_token_ids)
        return advance(out, fast)

    toggled.runner._advance = checked_advance
    results = [sim.run() for sim in sims]
    assert moved[0] > 100 and left[0] > 10 and steps[0] > 100  # each path really ran
    want = results[1]
    assert want.stats.num_preemptions > 0  # re-admissions after preemption are covered
    for got in (results[0], results[2]):
        assert [dataclasses.asdict(r) for r in got.requests] == \
            [dataclasses.asdict(r) for r in want.requests]
        assert got.steps == want.steps and got.stats == want.stats
        assert list(got.itl) == list(want.itl)


def test_the_hot_decode_run_schedules_what_the_general_loop_schedules(monkeypatch):
    """StepPlan.add_hot_decodes (the scheduler's runs of decodes that need no new block)
    against the general loop alone, on the cramped small cluster (preemptions) with prefix
    caching. Decode stretches off: they would take most pure-decode steps past the loop."""
    from tokenweir.core.sched.step_plan import StepPlan
    from test_sim_scale import _small_cluster_digest

    hot_run = StepPlan.add_hot_decodes
    taken = []

    def counting(self, running, i, block_size):
        end = hot_run(self, running, i, block_size)
        taken.append(end - i)
        return end

    monkeypatch.setattr(StepPlan, "add_hot_decodes", counting)
    fast, fast_preemptions = _small_cluster_digest(stretches=False)
    monkeypatch.setattr(StepPlan, "add_hot_decodes", lambda self, running, i, block_size: i)
    plain, plain_preemptions = _small_cluster_digest(stretches=False)
    assert fast == plain and fast_preemptions == plain_preemptions > 0
    # the probe: the hot run scheduled most decodes, in runs of several
    assert sum(taken) > 50_000 and sum(taken) > 3 * len(taken)


@pytest.mark.parametrize("vocab_size", [32000, 2 * 7919 + 3])
def test_a_stretch_tokens_slice_of_the_walk_is_the_runners_rule(vocab_size):
    """`regular_token_ids` (one slice of `shared_token_walk`) gives, object for object, the
    tokens of the runner's rule, across the walk's period and beyond it; and where STRIDE
    divides the span (no walk), position by position."""
    model = RooflineLatencyModel(get_shape(SMALL), get_hardware("h100"))
    runner = SimRunner(model, vocab_size=vocab_size)
    assert bool(runner._walk) == (vocab_size == 32000)
    ids = runner._regular_ids
    span = len(ids)
    rng = random.Random(11)
    long = [span - 1, span, span + 5, 2 * span + 3]
    for i in range(400):
        request = make_request("r" * rng.randint(1, 12), [5, 6], 4, 100, 0.0)
        computed = rng.randint(0, 3 * span) if i % 2 else span - rng.randint(0, 40)
        count = long[i // 100] if i % 100 == 0 else rng.choice([0, 1, 2, 16, 300])
        start = (computed + 1) * _TOKEN_STRIDE + len(request.request_id)
        want = [ids[(start + k * _TOKEN_STRIDE) % span] for k in range(count)]
        got = runner.regular_token_ids(request, computed, count)
        assert got == want and all(a is b for a, b in zip(got, want))
    for k in range(1, 6):  # each position's token is `_regular_token`'s id
        assert runner.regular_token_ids(make_request("abc", [1], 9, 99, 0.0), k, 1) == \
            [runner._regular_token("abc", k + 1)]


@pytest.mark.parametrize("vocab_size", [32000, 2 * 7919 + 3])
def test_the_block_key_rule_keys_the_regular_tokens_of_a_block(vocab_size):
    """`regular_block_rule(bs)(request, k)` is `block_tokens_key` of block k of the tokens
    `regular_token_ids` gives (positions from k * bs on); None where block k holds a prompt
    position; no rule without a walk."""
    model = RooflineLatencyModel(get_shape(SMALL), get_hardware("h100"))
    runner = SimRunner(model, vocab_size=vocab_size)
    if not runner._walk:
        assert runner.regular_block_rule(16) is None
        return
    rng = random.Random(5)
    for bs in (16, 32):
        rule, pack = runner.regular_block_rule(bs), block_key_packer(bs)
        for _ in range(300):
            prompt = [7] * rng.randint(1, 200)
            request = make_request("q" * rng.randint(1, 30), prompt, 4, 9999, 0.0)
            k = rng.randint(0, 60)
            got = rule(request, k)
            if k * bs < len(prompt):
                assert got is None
            else:  # the token at position p is sampled from p - 1 computed tokens
                tokens = runner.regular_token_ids(request, k * bs - 1, bs)
                assert got == block_tokens_key(pack, tokens)
            # its table form (what a decode stretch reads) gives the same keys
            first, offset = rule.row(request)
            assert (k >= first) == (got is not None)
            if k >= first:
                start = (k * bs + offset) % rule.period
                assert (rule.table[start] or rule.make(start)) == got
