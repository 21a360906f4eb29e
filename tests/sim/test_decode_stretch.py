"""Decode stretches (core/sched/decode_stretch.py, sim/decode_stretch.py) decide exactly what
the general per-step paths decide: the same seeded workloads, with stretches on and off, give
the same request records, step records, counters, inter-token gaps, router decisions and
digests, under preemption (recompute and swap), the prefix cache, the priority policy, slo
pauses and cuts, a sliding window, pipelining, a noisy latency model, sessions and a
prefix-aware cluster. Probes: stretches really advanced steps where their conditions stand
(and the general path took the others), the configurations really preempted, swapped, hit the
cache, paused or cut, and the stretch really declined where it must. Guards: a stretch that
samples EOS a step late, or that allocates a block one step after its boundary, is caught by
the same comparison."""

from __future__ import annotations

import dataclasses

import pytest

from tokenweir.core.sched import decode_stretch as stretch_module
from tokenweir.core.sched.decode_stretch import DecodeStretch
from tokenweir.core.sched.step_plan import StepPlan
from tokenweir.sim.build import build_simulation
from tokenweir.sim.cluster import build_cluster
from tokenweir.sim.digest import cluster_digest, instance_digest
from tokenweir.sim.hardware import get_hardware, get_shape
from tokenweir.sim.latency import NoisyLatencyModel, RooflineLatencyModel
from tokenweir.sim.sim_runner import RegularBlockKeys, SimRunner
from tokenweir.sim.sessions import synthetic_sessions
from tokenweir.sim.workload import synthetic

SMALL = "smollm2-135m"
CRAMPED = {"max_model_len": 1024, "num_gpu_blocks_override": 130,
           "max_num_batched_tokens": 256, "scheduler_reserve_full_isl": False}


# benchmarks/vs_vidur.py's engine (Sarathi-like: a small budget, chunked prompts, no prefix cache)
VIDURISH = {"max_num_batched_tokens": 128, "max_num_seqs": 32, "enable_prefix_caching": False,
            "scheduler_reserve_full_isl": False, "max_num_partial_prefills": 32,
            "watermark": 0.01, "preemption_mode": "recompute", "max_model_len": 1024}


def _specs(seed: int, n: int = 160, rate: float = 300.0, prompt: str = "lognormal:90:0.7",
           **kw):
    return synthetic(n, rate, seed=seed, prompt=prompt, output="lognormal:40:0.9",
                     num_prefix_groups=3, prefix_len=48, max_model_len=1024, **kw)


# name -> (engine args, workload kwargs, build kwargs, what must have happened, stretches?)
CASES = {
    "recompute+prefix, gaps in order": (
        CRAMPED, {}, {}, ("preemptions", "prefix_hits"), True),
    "recompute+prefix, gap times (declines)": (
        CRAMPED, {}, {"record_itl_times": True}, ("preemptions",), False),
    "swap, gaps as counts": (
        dict(CRAMPED, preemption_mode="swap", swap_space=0.01), {}, {"itl_counts": True},
        ("swaps",), True),
    "priority, no prefix cache": (
        dict(CRAMPED, scheduling_policy="priority", enable_prefix_caching=False),
        {"priority_mix": "0:0.3,1:0.7"}, {}, ("preemptions",), True),
    "checked (declines)": (CRAMPED, {}, {"check": True}, ("preemptions",), False),
    "roomy, no gaps": (dict(CRAMPED, num_gpu_blocks_override=600), {}, {"record_itl": False},
                       ("prefix_hits",), True),
    "slo pauses and cuts (declines)": (
        dict(CRAMPED, scheduling_policy="slo", num_gpu_blocks_override=400,
             max_num_batched_tokens=512),
        {"slo_mix": True}, {"itl_counts": True}, ("slo", "preemptions"), False),
    "chunked prefills beside the rows": (
        dict(CRAMPED, num_gpu_blocks_override=400, long_prefill_token_threshold=64), {},
        {"itl_counts": True}, ("prefix_hits", "tail"), True),
    "vs_vidur's engine, no prefix cache": (
        dict(VIDURISH, num_gpu_blocks_override=160), {"prompt": "lognormal:300:0.8"}, {},
        ("preemptions", "tail"), True),
    "pipelined, chunked (declines)": (
        dict(CRAMPED, num_gpu_blocks_override=400, long_prefill_token_threshold=64), {},
        {"pp_size": 2}, ("prefix_hits",), False),
}


def _slo_specs(seed: int):
    """Every third request urgent, the others relaxed, at a load that makes the CPU profile's
    prefills pause and cut for them."""
    specs = synthetic(120, 8.0, seed=seed, prompt="lognormal:300:0.7", output="lognormal:30:0.9",
                      num_prefix_groups=3, prefix_len=48, max_model_len=1024)
    return [dataclasses.replace(s, ttft_slo_ms=s.prompt_len * 2.5 + 400 if i % 3 == 0
                                else s.prompt_len * 12 + 8000) for i, s in enumerate(specs)]


def _simulation(engine, workload, build, seed, on: bool, **kw):
    if workload.get("slo_mix"):
        specs, hardware = _slo_specs(seed), "cpu-epyc-2c"
    else:
        specs, hardware = _specs(seed, **workload), "h100"
    sim = build_simulation(engine, specs, SMALL, hardware, **build, **kw)
    if not on:
        sim.instance.stretch = None
    return sim


def _everything(sim, result) -> dict:
    """What a run decided, field by field (a mismatch names the field)."""
    engine = sim.engine
    return {"records": [dataclasses.asdict(r) for r in result.requests],
            "steps": result.steps, "stats": result.stats, "itl": list(result.itl),
            "itl_times": list(engine.itl_times or ()), "itl_ids": engine.itl_ids,
            "end": result.end_time, "prefix": (result.prefix_hit_tokens,
                                                result.prefix_query_tokens),
            "digest": instance_digest(result), "cached": _content_map(sim.instance)}


def _content_map(instance) -> dict:
    """The instance's prefix cache: published key -> block id (a stretch publishes output
    blocks by the runner's block-key rule, without their token lists)."""
    return {key: block.block_id for key, block in instance.kv.pool.cached.items()}


def _stretch_steps(instances, probe: str = "num_steps") -> int:
    return sum(getattr(i.stretch.core, probe) for i in instances if i.stretch is not None)


def _check_happened(what, stats, result) -> None:
    if "preemptions" in what:
        assert stats.num_preemptions > 0
    if "swaps" in what:
        assert stats.num_swapped_out > 0
    if "prefix_hits" in what:
        assert result.prefix_hit_tokens > 0
    if "slo" in what:
        assert stats.preemptions_by_cause["slo-between-steps"] > 0 and stats.slo_cut_steps > 0


def _compare(case: str, seed: int) -> None:
    engine, workload, build, what, stretches = CASES[case]
    plain = _simulation(engine, workload, build, seed, on=False)
    want = _everything(plain, plain.run())
    fast = _simulation(engine, workload, build, seed, on=True)
    result = fast.run()
    got = _everything(fast, result)
    for key in want:
        assert got[key] == want[key], key
    _check_happened(what, result.stats, result)
    steps = _stretch_steps([fast.instance])
    if stretches:  # probe: stretches advanced steps (some beside the rows), the general path
        assert 0 < steps < result.stats.num_steps  # took the others
        assert _stretch_steps([fast.instance], "num_beside_steps") > 0
        if "tail" in what:
            assert _stretch_steps([fast.instance], "num_tail_steps") > 0
    else:
        assert steps == 0


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_stretches_decide_as_the_general_path(case, seed):
    _compare(case, seed)


def test_a_noisy_sliding_window_run_decides_as_the_general_path():
    """A sliding window declines (the runner's fast path does not hold); a noisy model draws
    once per step in the same order either way."""
    shape = dataclasses.replace(get_shape("mistral-7b"), sliding_window=128)
    specs = synthetic(12, 50.0, seed=3, prompt="lognormal:200:0.5", output="lognormal:300:0.5",
                      max_model_len=1024)
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "num_gpu_blocks_override": 600,
              "max_model_len": 1024}
    for window, want_steps in ((shape, False), (get_shape("llama-7b"), True)):
        runs = []
        for on in (False, True):
            model = NoisyLatencyModel(RooflineLatencyModel(window, get_hardware("h100")), 0.2,
                                      seed=5)
            sim = build_simulation(engine, specs, window.name, latency_model=model)
            if not on:
                sim.instance.stretch = None
            runs.append(_everything(sim, sim.run()))
        assert runs[0] == runs[1]
        assert (_stretch_steps([sim.instance]) > 100) == want_steps


def _cluster(on: bool, specs, sessions=None, num_instances: int = 6):
    sim = build_cluster({"max_num_seqs": 64, "max_num_batched_tokens": 512,
                         "num_gpu_blocks_override": 300, "max_model_len": 1024}, specs, SMALL,
                        "h100", num_instances=num_instances, router="prefix-aware",
                        record_steps=False, itl_counts=True, sessions=sessions)
    if not on:
        for inst in sim.instances:
            inst.stretch = None
    return sim


def _compare_clusters(specs, sessions=None) -> None:
    plain_sim = _cluster(False, specs, sessions)
    plain, plain_insts = plain_sim.run(), plain_sim.instances
    sim = _cluster(True, specs, sessions)
    fast = sim.run()
    assert cluster_digest(fast) == cluster_digest(plain)
    assert fast.routed == plain.routed
    assert [_content_map(i) for i in sim.instances] == [_content_map(i) for i in plain_insts]
    assert [dataclasses.asdict(r) for r in fast.overall.requests] == \
        [dataclasses.asdict(r) for r in plain.overall.requests]
    assert 0 < _stretch_steps(sim.instances) < fast.overall.stats.num_steps
    assert fast.overall.prefix_hit_tokens > 0


def test_a_prefix_aware_cluster_decides_as_the_general_path():
    _compare_clusters(_specs(4, n=600, rate=900.0))


def test_a_cluster_with_sessions_decides_as_the_general_path():
    sessions = synthetic_sessions(24, 40.0, seed=2, prompt="fixed:120", output="fixed:30",
                                  turns="fixed:3", user_len="fixed:20", tool_delay_ms="fixed:20",
                                  max_model_len=1024)
    _compare_clusters(_specs(5, n=200, rate=400.0), sessions)


def _differs_when(case: str, breaking) -> bool:
    """The case's run with stretches and `breaking()` applied (a monkeypatch) differs from,
    or crashes against, the general path's."""
    engine, workload, build, _, _ = CASES[case]
    plain = _simulation(engine, workload, build, 1, on=False)
    want = _everything(plain, plain.run())
    breaking()
    fast = _simulation(engine, workload, build, 1, on=True)
    try:
        got = _everything(fast, fast.run())
    except (AssertionError, IndexError, KeyError, ValueError):  # caught by crashing
        return True
    return got != want


def _broken_run_differs(monkeypatch, breaking) -> bool:
    enter = DecodeStretch.enter

    def broken_enter(self, rows, eos_steps):
        enter(self, rows, eos_steps)
        breaking(self)

    return _differs_when("recompute+prefix, gaps in order",
                         lambda: monkeypatch.setattr(DecodeStretch, "enter", broken_enter))


def test_a_stretch_sampling_eos_a_step_late_is_caught(monkeypatch):
    def late(stretch):
        stretch._eos_step[:] = [s + 1 for s in stretch._eos_step]
        slow = {}
        for step, rows in stretch._slow_at.items():
            slow.setdefault(step + 1, []).extend(rows)
        stretch._slow_at = {step: sorted(rows) for step, rows in slow.items()}
    assert _broken_run_differs(monkeypatch, late)


def test_a_stretch_allocating_a_step_late_is_caught(monkeypatch):
    def late(stretch):
        stretch._buckets.insert(0, stretch._buckets.pop())
    assert _broken_run_differs(monkeypatch, late)


def test_a_joined_row_sampling_eos_a_step_late_is_caught(monkeypatch):
    join = DecodeStretch.join
    late = lambda: monkeypatch.setattr(DecodeStretch, "join",  # noqa: E731
                                       lambda self, r, left: join(self, r, left + 1))
    assert _differs_when("roomy, no gaps", late)


def test_passes_beside_the_rows_given_the_rows_budget_too_are_caught(monkeypatch):
    """The tail's running pass and admission with one token more than the rows leave."""
    def one_more(budget, now):
        return StepPlan(budget + 1, now)
    wide = lambda: monkeypatch.setattr(stretch_module, "StepPlan", one_more)  # noqa: E731
    assert _differs_when("vs_vidur's engine, no prefix cache", wide)


def test_a_step_beside_the_rows_timed_without_them_is_caught(monkeypatch):
    execute_beside = SimRunner.execute_beside
    without = lambda: monkeypatch.setattr(  # noqa: E731
        SimRunner, "execute_beside", lambda self, out, n, context: execute_beside(self, out, 0, 0))
    assert _differs_when("chunked prefills beside the rows", without)


def test_a_stretch_publishing_a_blocks_neighbour_key_is_caught(monkeypatch):
    """A block-key rule one position off (the next block's walk offset) publishes keys no
    token list holds: the content maps differ (and, where later prompts would hit, the
    records)."""
    rule = SimRunner.regular_block_rule

    def shifted(self, block_size):
        key = rule(self, block_size)
        return lambda request, k: key(request, k + 1) if k * block_size >= \
            request.num_prompt_tokens else None
    off = lambda: monkeypatch.setattr(SimRunner, "regular_block_rule", shifted)  # noqa: E731
    assert _differs_when("roomy, no gaps", off)


def test_stretches_publish_most_output_blocks_by_the_block_key_rule(monkeypatch):
    """Probe for the comparisons above: the rule's keys, not token lists, published most of
    a stretch run's output blocks."""
    rule, given = SimRunner.regular_block_rule, []

    def counting(self, block_size):
        key = rule(self, block_size)

        def counted(request, k):
            ids = key(request, k)
            given.append(ids is not None)
            return ids
        return counted
    monkeypatch.setattr(SimRunner, "regular_block_rule", counting)
    _compare("roomy, no gaps", 1)
    assert sum(given) > 0.6 * len(given) > 100


def test_a_table_rule_one_block_off_is_caught(monkeypatch):
    """The stretch reads the runner's rule as a table (TableBlockKeyRule) for the rows' fills:
    a row offset one block off there (the callable form left right) publishes keys no token
    list holds, and the run differs."""
    row = RegularBlockKeys.row

    def shifted(self, request):
        first, offset = row(self, request)
        return first, (offset + self.block_size) % self.period
    off = lambda: monkeypatch.setattr(RegularBlockKeys, "row", shifted)  # noqa: E731
    assert _differs_when("roomy, no gaps", off)


def test_stretches_publish_most_output_blocks_through_the_table(monkeypatch):
    """Probe for the comparisons above: most of a stretch run's output blocks were keyed by
    a table read (the rows' path), not by calling the rule (the path of steps with a finish)."""
    reads, calls = [], []

    class CountingTable(list):
        def __getitem__(self, start):
            reads.append(start)
            return list.__getitem__(self, start)
    init, call = RegularBlockKeys.__init__, RegularBlockKeys.__call__

    def counting_init(self, walk, span, block_size, inverse, table):
        init(self, walk, span, block_size, inverse, CountingTable(table))

    def counting_call(self, request, k):
        calls.append(k)
        return call(self, request, k)
    monkeypatch.setattr(RegularBlockKeys, "__init__", counting_init)
    monkeypatch.setattr(RegularBlockKeys, "__call__", counting_call)
    _compare("roomy, no gaps", 1)
    assert len(reads) > 100 and len(reads) > len(calls)


def test_steps_with_a_finish_publish_the_other_rows_fills_through_the_table(monkeypatch):
    """A step where a row takes the stop rules publishes the blocks its other rows fill by
    the table read too (the runs between the slow tokens), not by calling the rule: a row
    never preempted is never keyed by a call. Probe: such steps happened, and the comparison
    with the general path held (`_compare`)."""
    calls, mixed = [], []
    call, update = RegularBlockKeys.__call__, DecodeStretch.update_step

    def counting_call(self, request, k):
        if not request.num_preemptions:
            calls.append(k)
        return call(self, request, k)

    def watching(self, now):
        slow = self._slow_at.get(self.j)
        if slow and set(self._buckets[(self.j + 1) % len(self._buckets)]) - set(slow):
            mixed.append(self.j)
        return update(self, now)
    monkeypatch.setattr(RegularBlockKeys, "__call__", counting_call)
    monkeypatch.setattr(DecodeStretch, "update_step", watching)
    _compare("roomy, no gaps", 1)
    assert len(mixed) > 10 and calls == []
