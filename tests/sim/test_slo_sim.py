"""The slo policy in the simulator: an urgent arrival during a long prefill step cuts it (the
step's time is truncated at the layer boundary), every request still finishes exactly once
with its full output, and without cuts the same request waits."""

from __future__ import annotations

import pytest

from tokenweir.sim.build import build_simulation
from tokenweir.sim.workload import RequestSpec

KW = dict(max_num_batched_tokens=4096, num_gpu_blocks_override=2000, max_model_len=8192,
          scheduling_policy="slo")


def _specs():
    # a 4,000-token prompt (a ~14 s step on the CPU roofline profile), then an urgent
    # 200-token one (~0.44 s alone) with a 1 s target
    return [RequestSpec("long", 0.0, 4000, 8, index=0),
            RequestSpec("urgent", 0.3, 200, 8, ttft_slo_ms=1000.0, index=1),
            RequestSpec("later", 0.5, 300, 8, ttft_slo_ms=20_000.0, index=2)]


def _run(**kw):
    sim = build_simulation(dict(KW, **kw), _specs(), model_shape="smollm2-135m",
                           hardware="cpu-epyc-2c", check=True)
    result = sim.run()
    return sim, {r.request_id: r for r in result.requests}


def test_urgent_arrival_cuts_the_long_step():
    sim, records = _run()
    stats = sim.scheduler.stats
    assert stats.slo_cut_steps == 1 and stats.preemptions_by_cause["slo-mid-step"] == 1
    # truncated at the first layer boundary after the arrival (30 layers)
    full = sim.runner.latency_model.step_time([(4000, 0)])
    assert 0.3 <= sim.steps[0].seconds <= 0.3 + full / 30
    assert 0 < stats.slo_wasted_layer_tokens < stats.slo_total_layer_tokens
    urgent = records["urgent"]
    assert urgent.first_token <= urgent.arrival + 1.0
    for r in records.values():
        assert r.num_finishes == 1 and r.num_output == r.target_output_len


def test_without_cuts_the_urgent_request_waits_for_the_step():
    sim, records = _run(slo_mid_step_cut=False)
    assert sim.scheduler.stats.slo_cut_steps == 0
    assert records["urgent"].first_token > records["urgent"].arrival + 1.0
    cut_sim, _ = _run()
    assert cut_sim.steps[0].seconds < sim.steps[0].seconds  # the cut truncated the step


def test_ttft_fit_follows_the_latency_model():
    from tokenweir.sim.hardware import get_hardware, get_shape
    from tokenweir.sim.latency import RooflineLatencyModel
    from tokenweir.sim.slo_cuts import fit_ttft, solo_ttft

    model = RooflineLatencyModel(get_shape("smollm2-135m"), get_hardware("cpu-epyc-2c"))
    quadratic, r2_q = fit_ttft(model, 2048, 8192)
    linear, r2_l = fit_ttft(model, 2048, 8192, quadratic=False)
    assert quadratic.b > 0 and linear.b == 0 and r2_q > r2_l
    for n in (300, 2000, 7000):
        assert quadratic.predict(n) == pytest.approx(solo_ttft(model, n, 2048), rel=0.05)


def test_step_predictor_ttft_line_predicts_steps_as_the_engine_does():
    """slo_step_predictor="ttft_line": the policy predicts the step in flight by its TTFT line
    (the real engine's only way) instead of the simulator's latency model; "auto" keeps the
    latency model. Probe: the two differ on a chunk over a long context (the line ignores the
    context it attends to), and the run with the line still finishes every request."""
    auto, _ = _run()
    line, records = _run(slo_step_predictor="ttft_line")
    assert auto.scheduler.policy.step_latency_model is auto.runner.latency_model
    assert line.scheduler.policy.step_latency_model is None
    predictor = line.scheduler.policy.ttft_predictor
    model = auto.runner.latency_model
    assert predictor.predict(200) < 0.9 * model.step_time([(200, 3800)])
    assert all(r.num_finishes == 1 for r in records.values())
    with pytest.raises(ValueError, match="slo_step_predictor"):
        _run(slo_step_predictor="oracle")


def test_cut_layers_follow_a_profile_num_layers():
    """A fitted profile's num_layers (a real model's: SmolLM2 has 30) sets where the
    simulator's mid-step cut can fall; a profile without it falls back to 32."""
    from tokenweir.sim.latency import FittedLatencyModel
    from tokenweir.sim.slo_cuts import DEFAULT_NUM_LAYERS, model_num_layers

    coefficients = {"const": 0.02, "prefill_tokens": 0.0015}
    profile = {"coefficients": coefficients, "num_layers": 30, "kv_bytes_per_token": 46080}
    assert model_num_layers(FittedLatencyModel.from_profile(profile)) == 30
    assert model_num_layers(FittedLatencyModel(coefficients)) == DEFAULT_NUM_LAYERS == 32
    sim = build_simulation(dict(KW), _specs(), latency_model=FittedLatencyModel.from_profile(
        dict(profile, max_model_len=8192)), check=True)
    sim.run()
    assert sim.instance.cutter.num_layers == 30 and sim.scheduler.stats.slo_cut_steps == 1


def test_a_poll_cuts_when_the_running_prefill_turns_hopeless():
    """The real SLO monitor also looks every POLL_SECONDS, not only at arrivals (slack shrinks
    as time passes); so does the simulator's. Here the urgent arrival's own look holds (the
    running prefill still has slack), and ~0.7 s later that prefill's slack crosses zero: a
    poll cuts it. The probe: with the polls taken away, nothing cuts."""
    from tokenweir.engine.slo_monitor import POLL_SECONDS
    from tokenweir.sim.slo_cuts import SimStepCutter

    specs = [RequestSpec("long", 0.0, 4000, 8, ttft_slo_ms=15_000.0, index=0),
             RequestSpec("urgent", 0.3, 200, 8, ttft_slo_ms=3000.0, index=1)]

    def run():
        sim = build_simulation(dict(KW), specs, model_shape="smollm2-135m",
                               hardware="cpu-epyc-2c", check=True)
        return sim, sim.run()

    sim, result = run()
    stats = sim.scheduler.stats
    assert stats.slo_cut_steps == 1
    cut_at = sim.steps[0].seconds
    full = sim.runner.latency_model.step_time([(4000, 0)])
    # not at the arrival's layer boundary: at one after a later poll, on the timer's chain
    # from the arrival's look
    assert 0.3 + full / 30 < cut_at < full
    polls = [0.3 + k * POLL_SECONDS for k in range(1, 1000)]
    assert any(p <= cut_at <= p + full / 30 for p in polls)
    assert all(r.num_finishes == 1 for r in result.requests)

    original = SimStepCutter.next_poll
    try:
        SimStepCutter.next_poll = lambda self, now: None  # the monitor looks at arrivals only
        blind, _ = run()
    finally:
        SimStepCutter.next_poll = original
    assert blind.scheduler.stats.slo_cut_steps == 0


def _has_prefill(out) -> bool:
    return any(n > 1 for n in out.num_scheduled_tokens.values())


def _monitor_log(monkeypatch, watch_every_step: bool = False) -> dict:
    """Run a slo workload of overlapping prompts and long outputs; per timer poll whether
    its step has a prefill chunk, and the start times of the steps with one and of the
    monitor's looks at a step's start."""
    from tokenweir.sim.instance import Instance
    from tokenweir.sim.slo_cuts import SimStepCutter

    log = {"polls": [], "prefill_starts": [], "start_looks": []}
    poll, start_batch = Instance.poll, Instance.start_batch
    look_at_start, step_started = SimStepCutter.look_at_start, SimStepCutter.step_started

    def spy_poll(self, now):
        log["polls"].append(_has_prefill(self.in_flight[0].out))
        return poll(self, now)

    def spy_start_batch(self, now):
        batch = start_batch(self, now)
        if batch is not None and _has_prefill(batch.out):
            log["prefill_starts"].append(now)
        return batch

    def spy_look_at_start(self, now):
        if self._watched:
            log["start_looks"].append(now)
        return look_at_start(self, now)

    def watch_all(self, start, seconds, out):
        step_started(self, start, seconds, out)
        self._watched = True

    monkeypatch.setattr(Instance, "poll", spy_poll)
    monkeypatch.setattr(Instance, "start_batch", spy_start_batch)
    monkeypatch.setattr(SimStepCutter, "look_at_start", spy_look_at_start)
    if watch_every_step:
        monkeypatch.setattr(SimStepCutter, "step_started", watch_all)
    specs = [RequestSpec(f"r{i}", 0.4 * i, 300 + 97 * i, 48, ttft_slo_ms=2000.0, index=i)
             for i in range(8)]
    build_simulation(dict(KW, max_num_batched_tokens=256), specs, model_shape="smollm2-135m",
                     hardware="cpu-epyc-2c", check=True).run()
    return log


def test_the_monitor_watches_only_steps_with_a_prefill_chunk(monkeypatch):
    """As the engine's monitor (engine/slo_monitor.py), the simulator's looks as a step with a
    prefill chunk begins and polls through such steps only: no timer poll falls in a
    decode-only step. Probe: with every step watched (the monitor before it slept through
    decode-only steps), the same run polls inside decode-only steps."""
    log = _monitor_log(monkeypatch)
    assert log["polls"] and all(log["polls"])  # polls, each in a step with a prefill chunk
    assert log["start_looks"] == log["prefill_starts"] != []
    monkeypatch.undo()
    assert not all(_monitor_log(monkeypatch, watch_every_step=True)["polls"])


# ---- benchmarks/slo_goodput.py: the instrument -----------------------------------------------
def _goodput_bench():
    """benchmarks/slo_goodput.py, imported as the module `slo_goodput`."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("slo_goodput")


def test_goodput_is_the_first_crossing_below_the_goal():
    bench = _goodput_bench()
    loads = [0.1, 0.2, 0.4]
    assert bench.goodput(loads, [1.0, 0.95, 0.85]) == pytest.approx(0.3)
    assert bench.goodput(loads, [0.95, 0.8, 0.95]) == pytest.approx(0.1 + 0.1 * 0.05 / 0.15)
    assert bench.goodput(loads, [0.99, 0.99, 0.99]) == 0.4  # never below: the highest load
    assert bench.goodput(loads, [0.45, 0.4, 0.3]) == pytest.approx(0.05)  # a floor below


def test_reachable_goal_is_what_the_baseline_reaches_at_the_lowest_load():
    bench = _goodput_bench()
    assert bench.reachable_goal([0.87, 0.93, 0.81]) == pytest.approx(0.80)
    assert bench.reachable_goal([0.95, 0.99]) == pytest.approx(0.90)  # never above the goal
    assert bench.reachable_goal([0.85]) == pytest.approx(0.85)  # a step exactly


def test_slo_misses_tell_ttft_from_tpot():
    bench = _goodput_bench()
    item = bench.Item(0, 0.0, 100, 11, False, ttft_s=1.0, tpot_s=0.1)
    assert bench.slo_misses(item, 0.0, 0.9, 0.9 + 10 * 0.1, 11) == (False, False)
    assert bench.slo_misses(item, 0.0, 1.1, 1.2, 11) == (True, False)
    assert bench.slo_misses(item, 0.0, 0.5, 0.5 + 10 * 0.11, 11) == (False, True)
    assert bench.slo_misses(item, 0.0, None, None, 0) == (True, True)


def test_goodput_quick_mode_runs_and_the_tpot_guard_shows(capsys):
    """The quick mode end to end; the probe that the TPOT guard acts: slo with TPOT targets
    misses fewer TPOTs than slo told none, at the highest quick load."""
    bench = _goodput_bench()
    (summary,) = bench.main(["--quick", "--policies", "fcfs", "slo-no-tpot", "slo"])
    policies = summary["policies"]
    assert set(policies) == {"fcfs", "slo-no-tpot", "slo"}
    assert all(len(p["goodput"]) == 2 for p in policies.values())
    tpot = {name: sum(p["tpot_missed"][-1]) for name, p in policies.items()}
    assert tpot["slo"] < tpot["slo-no-tpot"]
    assert "slo/fcfs goodput ratio" in capsys.readouterr().out
