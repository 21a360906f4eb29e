"""benchmarks/sim_fidelity.py's --repeats: the simulator against the MEAN of K real runs, the
real runs' spread beside each error. The "real" runs here are simulator runs at scaled
profiles written in the real runs' format, so the expected figures are known exactly."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import pytest
from fidelity_module import loaded_sim_fidelity  # tests/sim/fidelity_module.py

from tokenweir.sim.latency import FittedLatencyModel
from tokenweir.timeline.records import write_jsonl

PROFILE = {"format": "tokenweir-step-profile/1", "coefficients": {"const": 0.010, "prefill_tokens": 0.0004, "decode_rows": 0.001},
           "overhead": {"const": 0.0004}, "kv_bytes_per_token": 1024, "block_size": 16,
           "max_model_len": 1024, "model": "test", "num_layers": 30}
SCALES = (1.0, 1.25, 0.9)  # "real" validation runs 1..3: the machine at these speeds


@pytest.fixture(scope="module")
def fid():
    yield from loaded_sim_fidelity("sim_fidelity_under_test")


@pytest.fixture(scope="module")
def kept(fid, tmp_path_factory):
    """A trace dir holding three validation runs of `light` (quick), as --trace-dir keeps
    them, each the simulator at PROFILE on a machine whose runner runs at SCALES[k] of the
    profile's time, each step's time split into phases as the engine traces them (the
    profile's overhead, the rest the forward); returns (dir, profile path)."""
    return keep_runs(fid, tmp_path_factory.mktemp("kept"))


# The light workload of `small_kept`: 8 requests at --quick (light's own: 32), ~1/3 of the
# simulator steps per run. For the tests of the replay's plumbing (what is drawn, passed on,
# written and read back), which hold at any size; the tests that measure a spread or a drift
# keep light's 32 requests (their margins were computed there).
SMALL_LIGHT = 16


@pytest.fixture(scope="module")
def small_kept(fid, tmp_path_factory):
    """`kept` on a light workload of SMALL_LIGHT requests (8 at --quick): (dir, profile
    path, that workload). A replay of it runs with the workload in fid.WORKLOADS["light"]
    (`small_light`): the kept runs' requests are rebuilt from their seed by the workload."""
    small = dataclasses.replace(fid.WORKLOADS["light"], num_requests=SMALL_LIGHT)
    with small_light(fid, small):
        d, profile = keep_runs(fid, tmp_path_factory.mktemp("small_kept"))
    return d, profile, small


@contextlib.contextmanager
def small_light(fid, small):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(fid.WORKLOADS, "light", small)
        yield mp


def keep_runs(fid, d: Path) -> tuple[Path, Path]:
    """`kept`'s runs, of fid.WORKLOADS["light"] as it is, written into `d`."""
    w = fid.WORKLOADS["light"]
    specs = fid.make_specs(w, 1, quick=True)
    overhead = PROFILE["overhead"]["const"]
    for k, scale in enumerate(SCALES):
        model = FittedLatencyModel.from_profile(
            {**PROFILE, "runner_scale": {"decode": scale, "prefill": scale}})
        records, trace = fid.run_sim(w, model, specs)
        for s in trace.steps:
            s["phases"] = {"schedule": overhead, "forward": s["duration"] - overhead}
        path = fid.real_path(d, "light", 1, fid.repeat_suffix(k))
        write_jsonl(trace, path)
        fid.records_path(path).write_text(json.dumps(
            {"workload": "light", "seed": 1, "quick": True, "records": records}))
    profile = d / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    return d, profile


def run_main(fid, monkeypatch, tmp_path, *argv) -> dict:
    """main() on argv, its --json; the perfect-simulator suites off unless argv asks."""
    out = tmp_path / "out.json"
    if "--perfect-suites" not in argv:
        argv = (*argv, "--perfect-suites", "0")
    if "--validation-seeds" not in argv:  # the kept runs: one validation seed (seed 1)
        argv = (*argv, "--validation-seeds", "1")
    if "--sim-samples" not in argv:
        # PROFILE has no variability, so each of the default 32 draws is the profile's own
        # deterministic model (latency.sample_machines): one draw has the same mean. The
        # draws themselves: test_sim_samples_draw_the_profiles_variability. A test that
        # replays a profile WITH variability passes its own --sim-samples.
        argv = (*argv, "--sim-samples", "1")
    monkeypatch.setattr(sys, "argv", ["sim_fidelity.py", *argv, "--json", str(out)])
    fid.main()
    return json.loads(out.read_text())


def test_suffixes_keep_the_noise_floor_name(fid):
    assert [fid.repeat_suffix(k) for k in range(4)] == ["", "-repeat", "-repeat2", "-repeat3"]


def test_one_run_reproduces_itself(fid, kept, monkeypatch, tmp_path):
    """Single-run mode: the simulator at the profile that made run 1 matches it exactly."""
    d, profile = kept
    out = run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--profile", str(profile),
                   "--workloads", "light")
    (row,) = out["rows"]
    assert row["runs"] == 1
    assert all(abs(e) < 1e-9 for e in row["rel_error"].values())
    assert all(lo == hi == 0 for lo, hi in row["real_spread"].values())


def test_repeats_compare_with_the_mean(fid, kept, monkeypatch, tmp_path):
    d, profile = kept
    out = run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--profile", str(profile),
                   "--workloads", "light", "--repeats", "3")
    (row,) = out["rows"]
    assert row["runs"] == 3 and len(row["real_runs"]) == 3 and len(row["machine_speed"]) == 3
    runs = row["real_runs"]
    # the runs differ (the probe that the three files were all read) ...
    assert runs[1]["total_s"] > runs[0]["total_s"] > runs[2]["total_s"]
    for k in fid.METRICS:
        mean = sum(r[k] for r in runs) / 3
        assert row["real"][k] == pytest.approx(mean)
        # ... the simulator (every run's arrivals, the unscaled profile) reproduces run 1
        assert row["sim"][k] == pytest.approx(runs[0][k], rel=1e-6)
        assert row["rel_error"][k] == pytest.approx(runs[0][k] / mean - 1, rel=1e-6, abs=1e-12)
        lo, hi = row["real_spread"][k]
        assert lo == pytest.approx(min(r[k] for r in runs) / mean - 1)
        assert hi == pytest.approx(max(r[k] for r in runs) / mean - 1)
    lo, hi = row["real_spread"]["total_s"]
    assert lo < 0 < hi and lo <= row["rel_error"]["total_s"] <= hi


def test_repeats_table_marks_errors_inside_the_spread(fid):
    row = {"workload": "w", "runs": 3,
           "rel_error": {k: 0.02 for k in fid.METRICS} | {"ttft_p50_ms": 0.30},
           "real_spread": {k: (-0.05, 0.04) for k in fid.METRICS},
           "counts_real": {k: 0 for k in fid.COUNTS} | {"preemptions": 10 / 3},
           "counts_sim": {k: 0 for k in fid.COUNTS} | {"preemptions": 3}}
    table = fid.format_table([row])
    line = table.splitlines()[1]
    assert line.count("*") == len(fid.METRICS) - 1  # all but ttft p50 (+30% outside)
    assert "+30.0% [ -5.0.. +4.0]" in line and "3.3/3" in line
    assert "4/5 inside the real runs' own spread" in table
    assert "*" not in fid.format_table([{**row, "runs": 1}])


def test_noise_floor_is_the_second_run_against_the_first(fid, kept, monkeypatch, tmp_path):
    d, profile = kept
    out = run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--profile", str(profile),
                   "--workloads", "light", "--noise-floor")
    (noise,) = out["noise_floor"]
    assert noise["rel_error"]["tpot_p50_ms"] == pytest.approx(
        noise["sim"]["tpot_p50_ms"] / noise["real"]["tpot_p50_ms"] - 1)
    assert noise["rel_error"]["tpot_p50_ms"] > 0.1  # run 2 ran at 1.25x


def test_missing_repeat_is_an_error(fid, kept, monkeypatch, tmp_path):
    d, profile = kept
    with pytest.raises(SystemExit, match="no kept run"):
        run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--profile", str(profile),
                 "--workloads", "light", "--repeats", "4")


def test_stalled_steps_finds_a_descheduled_run(fid, kept):
    """A kept run with phases (each step's time all `forward`) has no stall; one decode step
    at 20x, or a prefill step at 1.5 s (~40x its chunk's time in this run), is one."""
    from tokenweir.timeline.records import load_jsonl

    d, _ = kept
    trace = load_jsonl(fid.real_path(d, "light", 1))
    for s in trace.steps:
        s["phases"] = {"forward": s["duration"]}
    path = d / "phased.jsonl"
    write_jsonl(trace, path)
    assert fid.stalled_steps(path) == []
    decode = next(s for s in trace.steps if len(s["reqs"]) == 1 and s["reqs"][0]["decode"])
    decode["phases"]["forward"] *= 20
    prefill = next(s for s in trace.steps if s["reqs"][0]["prefill"] > 1)
    prefill["phases"]["forward"] = 1.5
    write_jsonl(trace, path)
    assert sorted(fid.stalled_steps(path)) == pytest.approx(
        sorted([decode["phases"]["forward"], 1.5]))


def test_a_slow_machine_is_not_a_stall(fid, kept):
    """Every step of a run 6x slower than the kept one (this suite's AVX2 machine against
    the AVX-512 one of issue 16: a 512-token slo step took 2.4 s) is no stall: the limit
    follows the run's own speed. Probe: the run has steps over 2 s, what the absolute limit
    of one thread called a stall (every slo run of issue 36's first suite was flagged), and
    a 20x decode step in it is still found."""
    from tokenweir.timeline.records import load_jsonl

    d, _ = kept
    trace = load_jsonl(fid.real_path(d, "light", 1))
    big = max(trace.steps, key=lambda s: sum(r["prefill"] for r in s["reqs"]))
    for s in trace.steps:
        s["phases"] = {"forward": 6 * s["duration"] * (40 if s is big else 1)}
        if s is big:  # a chunk 40x longer than its own, as slow per token as the others
            s["reqs"] = [dict(r, prefill=40 * r["prefill"], context=r["context"]
                              + 39 * r["prefill"]) for r in s["reqs"]]
    path = d / "slow.jsonl"
    write_jsonl(trace, path)
    assert big["phases"]["forward"] > 2.0  # the probe: the old one-thread limit's stall
    assert fid.stalled_steps(path) == []
    decode = next(s for s in trace.steps if len(s["reqs"]) == 1 and s["reqs"][0]["decode"])
    decode["phases"]["forward"] *= 20
    write_jsonl(trace, path)
    assert fid.stalled_steps(path) == pytest.approx([decode["phases"]["forward"]])


def test_wait_for_quiet_waits_while_the_machine_is_busy(fid, monkeypatch):
    jiffies = iter([(0, 100), (90, 200), (90, 200), (95, 300)])  # 90% busy, then 5%
    monkeypatch.setattr(fid, "_cpu_times", lambda: next(jiffies))
    monkeypatch.setattr(fid.time, "sleep", lambda s: None)
    fid.wait_for_quiet(sample_s=0.0)
    assert next(jiffies, None) is None  # sampled twice: busy, then idle


def test_cpu_times_count_niced_time_as_idle_only_without_autogroup(fid, tmp_path):
    """A niced job (nice column) gives its CPU up to the engine only where the kernel's
    autogroup is off: idle to wait_for_quiet there, busy with autogroup on (sessions share the
    CPU first) or where the setting cannot be read; user and system time are busy."""
    stat = tmp_path / "stat"
    # cpu  user nice system idle iowait irq softirq steal
    stat.write_text("cpu  10 500 20 400 30 0 0 0\ncpu0 1 2 3 4 5 0 0 0\n")
    off, on = tmp_path / "off", tmp_path / "on"
    off.write_text("0\n")
    on.write_text("1\n")
    assert fid._cpu_times(stat, off) == (30, 960)  # nice 500, idle 400, iowait 30 are idle
    assert fid._cpu_times(stat, on) == (530, 960)
    assert fid._cpu_times(stat, tmp_path / "missing") == (530, 960)


def test_run_orders(fid):
    """--order workload: each workload's runs back to back; round-robin: every calibration
    run, then the validation runs in rounds. Both run the same set of runs."""
    import argparse

    args = argparse.Namespace(seed=0, repeats=2, noise_floor=False, order="workload",
                              calibration_runs=1)
    names = ["light", "slo"]
    by_workload = fid.real_runs(args, names, calibrate=True)
    assert [(r[1], r[2], r[3]) for r in by_workload] == [
        ("light", 0, ""), ("light", 1, ""), ("light", 1, "-repeat"),
        ("slo", 0, ""), ("slo", 1, ""), ("slo", 1, "-repeat")]
    args.order = "round-robin"
    rounds = fid.real_runs(args, names, calibrate=True)
    assert [(r[1], r[2], r[3]) for r in rounds] == [
        ("light", 0, ""), ("slo", 0, ""), ("light", 1, ""), ("slo", 1, ""),
        ("light", 1, "-repeat"), ("slo", 1, "-repeat")]
    assert sorted(rounds) == sorted(by_workload)
    assert [r[1] for r in fid.real_runs(args, names, calibrate=False)] == [
        "light", "slo", "light", "slo"]


def test_calibration_runs_never_use_the_validation_seed(fid):
    """--calibration-runs N: seeds seed, seed+2, seed+3, ... (seed+1 validates); in workload
    order each workload's calibration runs precede its validation runs."""
    import argparse

    args = argparse.Namespace(seed=5, repeats=1, noise_floor=False, order="workload",
                              calibration_runs=3)
    assert fid.calibration_seeds(args) == [5, 7, 8]
    runs = fid.real_runs(args, ["light", "slo"], calibrate=True)
    assert [(r[0], r[1], r[2]) for r in runs] == [
        ("calibration", "light", 5), ("calibration", "light", 7), ("calibration", "light", 8),
        ("validation", "light", 6),
        ("calibration", "slo", 5), ("calibration", "slo", 7), ("calibration", "slo", 8),
        ("validation", "slo", 6)]
    args.order = "round-robin"
    # calibration rounds at 0, 1/3, 2/3 of the suite, the validation round at 1/2
    assert [(r[1], r[2]) for r in fid.real_runs(args, ["light", "slo"], calibrate=True)] == [
        ("light", 5), ("slo", 5), ("light", 7), ("slo", 7), ("light", 6), ("slo", 6),
        ("light", 8), ("slo", 8)]
    args.calibration_runs, args.repeats = 2, 3  # the suite's: cal, val, cal, val, val
    assert [(r[0][:3], r[2], r[3]) for r in fid.real_runs(args, ["light"], calibrate=True)] == [
        ("cal", 5, ""), ("val", 6, ""), ("cal", 7, ""), ("val", 6, "-repeat"),
        ("val", 6, "-repeat2")]
    args.calibration_runs = 0
    with pytest.raises(SystemExit, match="calibration-runs"):
        fid.calibration_seeds(args)


def test_replay_calibrates_on_every_calibration_seed(fid, kept, monkeypatch, tmp_path):
    """The fit reads the traces of every calibration seed; a missing one is an error."""
    d, _ = kept
    import shutil

    for seed in (0, 2):  # "calibration runs": copies of validation run 1 under their names
        shutil.copy(fid.real_path(d, "light", 1), fid.real_path(d, "light", seed))
    seen = []  # the paths fitted (simulated traces have no phase times to fit: PROFILE)
    from tokenweir.sim import calibrate_trace
    monkeypatch.setattr(calibrate_trace, "calibrate_from_traces",
                        lambda paths, hinge_tokens=0: seen.append(list(paths)) or dict(PROFILE))
    monkeypatch.setattr("tokenweir.sim.calibrate.format_report", lambda profile: "")
    run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--workloads", "light")
    assert seen == [[str(fid.real_path(d, "light", 0)), str(fid.real_path(d, "light", 2))]]
    with pytest.raises(SystemExit, match="no calibration run"):
        run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--workloads", "light",
                 "--calibration-runs", "3")


def test_sim_samples_draw_the_profiles_variability(fid, kept, monkeypatch, tmp_path):
    """--sim-samples N: N simulations per real run, each a draw of the profile's variability,
    their mean compared. Probe: the draws differ; with N 1 the deterministic model."""
    d, _ = kept
    noisy = tmp_path / "noisy.json"
    noisy.write_text(json.dumps({**PROFILE, "variability": {"run_sigma": 0.05,
                                                            "step_sigma": 0.03}}))
    argv = ("--replay", str(d), "--profile", str(noisy), "--workloads", "light")
    (row,) = run_main(fid, monkeypatch, tmp_path, *argv, "--sim-samples", "4")["rows"]
    totals = [r["total_s"] for r in row["sim_runs"]]
    assert len(totals) == 4 and len(set(totals)) == 4
    (det,) = run_main(fid, monkeypatch, tmp_path, *argv, "--sim-samples", "1")["rows"]
    assert len(det["sim_runs"]) == 1 and det["rel_error"]["total_s"] == pytest.approx(0, abs=1e-9)
    assert row["sim"]["total_s"] == pytest.approx(statistics.fmean(totals))
    assert min(totals) < det["sim"]["total_s"] < max(totals)


def test_speed_matched_takes_the_drift_between_runs_out(fid, kept, monkeypatch, tmp_path):
    """Each kept run measures its machine at SCALES[k] (run_speed); simulated at that speed
    (at_run_speed) it is reproduced, while the prediction at the profile's speed is not (the
    probe: the drift is there to take out)."""
    d, profile = kept
    out = run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--profile", str(profile),
                   "--workloads", "light", "--repeats", "3", "--sim-samples", "1")
    (row,) = out["rows"]
    for speed, scale in zip(row["machine_speed"], SCALES):
        assert {k: s["ratio"] for k, s in speed.items()} == pytest.approx(
            {"decode": scale, "prefill": scale}, rel=1e-6)
    assert abs(row["rel_error"]["tpot_p50_ms"]) > 0.02
    matched = row["speed_matched"]
    assert matched["rel_error"] == pytest.approx({k: 0.0 for k in fid.METRICS}, abs=1e-6)
    for sim, real in zip(matched["sim_runs"], matched["real_runs"]):
        assert sim == pytest.approx(real, rel=1e-6)


def test_at_run_speed_keeps_the_step_jitter_and_drops_the_run_draw(fid):
    noisy = {**PROFILE, "variability": {"run_sigma": 0.05, "step_sigma": 0.02}}
    speed = {"decode": {"ratio": 1.2}, "prefill": {"ratio": 0.9}}
    at = fid.at_run_speed(noisy, speed)
    assert at["runner_scale"] == {"decode": 1.2, "prefill": 0.9}
    assert at["variability"] == {"run_sigma": 0.0, "step_sigma": 0.02}
    assert noisy["variability"]["run_sigma"] == 0.05  # the profile itself is untouched
    assert fid.at_run_speed(PROFILE, speed)["variability"] == {}


def test_a_perfect_simulator_of_a_machine_without_variability_scores_zero(
        fid, small_kept, monkeypatch, tmp_path, capsys):
    """The real engine exactly the profile and no variability: every synthetic run is the
    deterministic model, so is the prediction, and every error is 0. The probe: with the
    profile's variability, the same suites err, each its own way, and the same on every call
    (the draws are seeded by suite and run). On the small kept runs."""
    d, profile, small = small_kept
    monkeypatch.setitem(fid.WORKLOADS, "light", small)
    # --matched-suites 0: the speed-matched floor (perfect_speed_matched, ~60% of this test's
    # time, and none of its assertions) is left to the tests of that floor below
    # (and --sim-samples 1: the prediction is then the profile's deterministic model, which
    # the noisy profile's synthetic suites still miss, each its own way)
    argv = ("--replay", str(d), "--workloads", "light", "--repeats", "3", "--perfect-suites", "3",
            "--matched-suites", "0", "--sim-samples", "1")
    out = run_main(fid, monkeypatch, tmp_path, *argv, "--profile", str(profile))
    assert out["rows"][0]["requests"] == SMALL_LIGHT // 2  # the small runs were replayed
    suites = out["perfect_simulator"]["light"]
    assert len(suites) == 3
    assert all(e[k] == pytest.approx(0, abs=1e-12) for e in suites for k in fid.METRICS)
    assert "it meets every |error| <= 5% in 3/3 suites" in capsys.readouterr().out

    noisy = tmp_path / "noisy.json"
    noisy.write_text(json.dumps({**PROFILE, "variability": {"run_sigma": 0.05,
                                                            "step_sigma": 0.03}}))
    first, again = (run_main(fid, monkeypatch, tmp_path, *argv, "--profile", str(noisy))
                    ["perfect_simulator"]["light"] for _ in range(2))
    assert first == again
    totals = [e["total_s"] for e in first]
    assert len(set(totals)) == 3 and max(abs(x) for x in totals) > 1e-4


def test_a_perfect_simulators_errors_grow_with_the_machines_run_to_run_spread(fid, kept,
                                                                             det_total):
    """The synthetic real runs draw each run's speed from run_sigma: a machine spread 10%
    run to run leaves the prediction further from their mean than one spread 0.5%."""
    d, _ = kept
    # 4 suites (the benchmark's default is 12): 0.00071 against 0.00019 here (3.7x; 3.6x
    # with 3, 4.4x with 6, 4.8x with 12), the same seeded draws on every run
    args = argparse.Namespace(repeats=3, perfect_suites=4, seed=0)

    def p90_total(run_sigma: float) -> float:
        profile = {**PROFILE, "variability": {"run_sigma": run_sigma, "step_sigma": 0.0}}
        suites = fid.perfect_simulator(args, "light", profile, d,
                                       {k: 1.0 for k in fid.METRICS} | {
                                           "total_s": det_total})
        return fid._p90([abs(e["total_s"]) for e in suites])

    assert p90_total(0.10) > 3 * p90_total(0.005)


@pytest.fixture(scope="module")
def det_total(fid, kept) -> float:
    """The mean total time of the deterministic model over the three kept runs' arrivals."""
    d, _ = kept
    model = FittedLatencyModel.from_profile(PROFILE)
    args = argparse.Namespace(repeats=3, seed=0)
    return statistics.fmean(
        fid.summarize(fid.run_sim(fid.WORKLOADS["light"], model, fid.run_specs("light", t))[0])
        ["total_s"] for t in fid.validation_paths(args, d, "light", 3))


def test_perfect_table_counts_suites_and_names_the_cells_beyond_it(fid):
    zero = {k: 0.0 for k in fid.METRICS}
    perfect = {"w": [zero | {"tpot_p50_ms": x} for x in (0.01, -0.02, 0.06, 0.03, -0.08)]}
    rows = [{"workload": "w", "runs": 6,
             "rel_error": zero | {"tpot_p50_ms": -0.09, "ttft_p50_ms": 0.07,
                                  "total_s": 0.04}}]
    profile = {"variability": {"run_sigma": 0.02, "step_sigma": 0.015}}
    text = fid.format_perfect(profile, rows, perfect)
    assert "run_sigma 2.0% and step_sigma 1.5%) in 5 synthetic suites of 6 runs" in text
    # tpot_p50's p90 over the 5 suites (metrics.percentile: 6% + 0.6 * (8% - 6%)), 2 of
    # them over 5%
    assert "7.2% ( 2)" in text
    assert "in 3/5 suites (its worst cell per suite: median 3.0%, max 8.0%)" in text
    # ttft p50 +7% is beyond a perfect simulator (0% there); tpot p50 -9% beyond its 7.2%;
    # total +4% is within the target, so not named
    assert text.endswith("beyond a perfect simulator's p90: w ttft_p50_ms +7.0% (p90 0.0%), "
                         "w tpot_p50_ms -9.0% (p90 7.2%)")


def test_p90_is_the_projects_percentile(fid):
    from tokenweir.sim.metrics import percentile

    xs = [0.08, 0.01, 0.06, 0.02, 0.03]
    assert fid._p90(xs) == percentile(sorted(xs), 90) == pytest.approx(0.072)


def test_validation_seeds_and_calibration_seeds_never_meet(fid):
    """--validation-seeds 3 (the default): validation on seed+1..seed+3, each --repeats
    times; calibration on seed, then after the validation seeds."""
    args = argparse.Namespace(seed=5, repeats=2, noise_floor=False, order="workload",
                              calibration_runs=2, validation_seeds=3)
    assert fid.validation_seeds(args) == [6, 7, 8] and fid.calibration_seeds(args) == [5, 9]
    runs = fid.real_runs(args, ["light"], calibrate=True)
    assert [(r[2], r[3]) for r in runs] == [(5, ""), (9, ""), (6, ""), (7, ""), (8, ""),
                                            (6, "-repeat"), (7, "-repeat"), (8, "-repeat")]
    assert [p.name for p in fid.validation_paths(args, Path("d"), "light", 2)] == [
        "light-seed6.jsonl", "light-seed6-repeat.jsonl", "light-seed7.jsonl",
        "light-seed7-repeat.jsonl", "light-seed8.jsonl", "light-seed8-repeat.jsonl"]
    args.order = "round-robin"
    assert sorted(fid.real_runs(args, ["light"], calibrate=True)) == sorted(runs)
    args.validation_seeds = 0
    with pytest.raises(SystemExit, match="validation-seeds"):
        fid.validation_seeds(args)


def _row(workload: str, errors: dict, matched: dict, real: dict, sim: dict) -> dict:
    return {"workload": workload, "rel_error": errors, "speed_matched": {"rel_error": matched},
            "counts_real": real, "counts_sim": sim}


def test_criterion_allows_a_perfect_simulators_p90_and_checks_counts(fid):
    """Issue 36's criterion: a cell within max(5%, the perfect simulator's p90 for it);
    speed-matched within 5%; counts within 10% or 1. Each rule, met and missed."""
    zero = {k: 0.0 for k in fid.METRICS}
    counts = {k: 0.0 for k in fid.COUNTS}
    perfect = {"w": [zero | {"tpot_p50_ms": x} for x in (0.01, -0.02, 0.06, 0.03, -0.08)]}
    ok = _row("w", zero | {"tpot_p50_ms": -0.07, "total_s": 0.049}, zero | {"total_s": -0.05},
              counts | {"preemptions": 20.0, "cuts": 0.5},
              counts | {"preemptions": 22.0, "cuts": 1.5})
    assert fid.criterion([ok], perfect) == []
    assert fid.criterion([ok], {}) == ["w tpot_p50_ms -7.0% (allowed 5.0%)"]  # no floor
    bad = _row("w", zero | {"tpot_p50_ms": -0.073, "ttft_p50_ms": 0.051},
               zero | {"ttft_p90_ms": 0.051}, counts | {"preemptions": 20.0, "swap_outs": 3.0},
               counts | {"preemptions": 22.5, "swap_outs": 1.9})
    assert fid.criterion([bad], perfect) == [
        "w ttft_p50_ms +5.1% (allowed 5.0%)", "w ttft_p90_ms speed-matched +5.1%",
        "w tpot_p50_ms -7.3% (allowed 7.2%)", "w preemptions real 20 vs sim 22.5",
        "w swap_outs real 3 vs sim 1.9"]
    assert fid.format_criterion([]).endswith(": MET")
    assert "MISSED in 5" in fid.format_criterion(fid.criterion([bad], perfect))


def test_every_validation_seed_is_judged_together(fid, kept, monkeypatch, tmp_path):
    """--validation-seeds 3: the runs of seeds 1, 2, 3 pooled into one row (each simulated
    at its own arrivals); with the profile that made them, every cell meets the criterion.
    The probe: the three seeds' runs differ."""
    d, profile = kept
    w = fid.WORKLOADS["light"]
    model = FittedLatencyModel.from_profile(PROFILE)
    overhead = PROFILE["overhead"]["const"]
    for seed in (2, 3):
        records, trace = fid.run_sim(w, model, fid.make_specs(w, seed, quick=True))
        for s in trace.steps:
            s["phases"] = {"schedule": overhead, "forward": s["duration"] - overhead}
        path = fid.real_path(d, "light", seed)
        write_jsonl(trace, path)
        fid.records_path(path).write_text(json.dumps(
            {"workload": "light", "seed": seed, "quick": True, "records": records}))
    out = run_main(fid, monkeypatch, tmp_path, "--replay", str(d), "--profile", str(profile),
                   "--workloads", "light", "--validation-seeds", "3", "--sim-samples", "1")
    (row,) = out["rows"]
    assert row["runs"] == 3 and len({r["total_s"] for r in row["real_runs"]}) == 3
    assert all(abs(e) < 1e-9 for e in row["rel_error"].values())
    assert out["criterion_misses"] == []


def test_the_slo_workload_cuts_more_on_a_slower_machine(fid):
    """Issue 36's "the real engine cuts ~0.5 more per run": the slo workload predicts TTFT
    by a FIXED line on both sides (one per suite; here the suites' old LEGACY_SLO_LINE), so a machine slower than the profile
    leaves urgent waiters less slack and the monitor cuts more. Seeds 1-8 with this profile
    (recorded: 62 cuts at 1.0x, 68 at 1.10x); the suites' validation runs ran 1.00-1.07x the
    profile, so a speed-matched simulation (at_run_speed) carries that share of the gap."""
    profile = {"coefficients": {"const": 0.012, "prefill_tokens": 0.0011,
                                "decode_rows": 0.0004, "prefill_attention": 2e-8,
                                "decode_context": 2e-7},
               "overhead": {"const": 0.0008}, "kv_bytes_per_token": 46080,
               "max_model_len": 1024, "num_layers": 30}
    w = fid.WORKLOADS["slo"]

    def cuts(scale: float) -> int:
        model = FittedLatencyModel.from_profile(
            {**profile, "runner_scale": {"decode": scale, "prefill": scale}})
        line = fid.LEGACY_SLO_LINE
        return sum(fid.step_counts(fid.run_sim(w, model, fid.make_specs(w, seed, False, line),
                                               line)[1])["cuts"] for seed in range(1, 9))

    assert (cuts(1.0), cuts(1.10)) == (62, 68)


def test_collect_only_runs_the_real_engine_and_nothing_else(fid, monkeypatch, tmp_path):
    """--collect-only: the real runs of the named workloads into --trace-dir, no calibration
    and no simulation (the suite is collected in short quiet holds, then replayed). Probe:
    the runs were asked for, into that dir; without --trace-dir it refuses (a temp dir would
    lose them)."""
    calls = []
    monkeypatch.setattr(fid, "run_real", lambda args, names, d, calibrate:
                        calls.append((names, d, calibrate)))

    def never(*a, **k):
        raise AssertionError("collect-only calibrated or simulated")

    monkeypatch.setattr(fid, "calibrate_on_traces", never)
    monkeypatch.setattr(fid, "validate", never)
    d = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["sim_fidelity.py", "--collect-only", "--trace-dir",
                                      str(d), "--workloads", "slo"])
    assert fid.main() == 0
    assert calls == [(["slo"], d, True)] and d.is_dir()
    monkeypatch.setattr(sys, "argv", ["sim_fidelity.py", "--collect-only", "--workloads", "slo"])
    with pytest.raises(SystemExit, match="needs --trace-dir"):
        fid.main()
    assert len(calls) == 1


def test_a_perfect_simulator_draws_the_drift_inside_runs(fid, kept, det_total):
    """The profile's measured drift inside runs (variability's drift_sigma, drift_tau_s:
    drift.fit_drift) enters the synthetic real runs, so a machine that wanders inside runs
    leaves the prediction further from their mean (the floor widens). Probe: the same
    profile without the drift (`without_drift`, --no-floor-drift) scores as a profile that
    never measured any."""
    d, _ = kept
    # 2 suites: 0.00089 against 0.000015 here (61x; 12x with 3, 16x with 6, 27x with 12),
    # seeded draws
    args = argparse.Namespace(repeats=3, perfect_suites=2, seed=0)
    prediction = {k: 1.0 for k in fid.METRICS} | {"total_s": det_total}
    steady = {**PROFILE, "variability": {"run_sigma": 0.0, "step_sigma": 0.01}}
    wandering = {**PROFILE, "variability": {**steady["variability"], "drift_sigma": 0.15,
                                            "drift_tau_s": 2.0}}

    def p90_total(profile: dict) -> float:
        suites = fid.perfect_simulator(args, "light", profile, d, prediction)
        return fid._p90([abs(e["total_s"]) for e in suites])

    steady_p90 = p90_total(steady)
    assert p90_total(wandering) > 3 * steady_p90
    assert p90_total(fid.without_drift(wandering)) == steady_p90
    text = fid.format_perfect(wandering, [{"workload": "light", "runs": 3,
                                           "rel_error": {k: 0.0 for k in fid.METRICS}}],
                              {"light": [{k: 0.0 for k in fid.METRICS}]})
    assert "step_sigma 1.0%, drifting 15.0% inside runs over 2.0 s) in 1 synthetic" in text


def test_floored_criterion_allows_the_speed_matched_and_counts_floors(fid):
    """fid7: a speed-matched cell within max(5%, its floor's p90: `perfect_speed_matched`),
    counts within 10% or 1 or their floor's p90 (|predicted - synthetic| per suite, from
    `perfect_simulator` with counts). Each floor, wide enough and too narrow."""
    zero = {k: 0.0 for k in fid.METRICS}
    counts = {k: 0.0 for k in fid.COUNTS}
    row = _row("w", zero, zero | {"tpot_p90_ms": 0.07}, counts | {"cuts": 10.0},
               counts | {"cuts": 13.0})
    wide = {"w": [zero | {"tpot_p90_ms": x} for x in (0.02, -0.09, 0.09)]}
    narrow = {"w": [zero | {"tpot_p90_ms": x} for x in (0.02, -0.06, 0.06)]}
    with_counts = {"w": [zero | counts | {"cuts": x} for x in (3.5, -3.5, 0.5)]}
    assert fid.criterion([row], with_counts, wide) == []
    assert fid.criterion([row], with_counts, narrow) == [
        "w tpot_p90_ms speed-matched +7.0% (allowed 6.0%)"]
    assert fid.criterion([row], {"w": [zero]}, wide) == ["w cuts real 10 vs sim 13"]
    assert fid.criterion([row], {}, {}) == ["w tpot_p90_ms speed-matched +7.0%",
                                           "w cuts real 10 vs sim 13"]
    # the issue's verdict judges both flat, whatever the floors say; floored_criterion is fid7's
    assert fid.criterion([row], with_counts) == fid.criterion([row], {}, {})
    assert fid.floored_criterion([row], with_counts, wide) == []
    assert fid.format_criterion([], floored=True).startswith("against every noise floor")
    text = fid.format_floors([{**row, "speed_matched": {"rel_error": row["speed_matched"][
        "rel_error"]}}], with_counts, narrow)
    assert text.endswith("beyond their floor: w tpot_p90_ms +7.0% (p90 6.0%)")
    # fid12: each cell's signed median over the floor's suites (centred: near 0) and the
    # suites a perfect simulator passes whole at 5% (here only the first: 2% on TPOT p90)
    assert ("w          its signed median: total_s +0.0% ttft_p50_ms +0.0% ttft_p90_ms +0.0% "
            "tpot_p50_ms +0.0% tpot_p90_ms +2.0%; every cell within 5% in 1/3 suites") in text


def test_perfect_simulator_scores_counts_against_the_prediction(fid, small_kept, monkeypatch):
    """With the row's counts, each synthetic suite carries each count's predicted minus its
    runs' mean; light never preempts, so every difference is the prediction's own count. On
    the small kept runs."""
    d, _, small = small_kept
    monkeypatch.setitem(fid.WORKLOADS, "light", small)
    args = argparse.Namespace(repeats=3, perfect_suites=3, seed=0)
    noisy = {**PROFILE, "variability": {"run_sigma": 0.05, "step_sigma": 0.03}}
    prediction = {k: 1.0 for k in fid.METRICS}
    suites = fid.perfect_simulator(args, "light", noisy, d, prediction,
                                   {k: 2.0 for k in fid.COUNTS})
    assert [{k: e[k] for k in fid.COUNTS} for e in suites] == [{k: 2.0 for k in fid.COUNTS}] * 3
    assert all(set(fid.COUNTS).isdisjoint(e) for e in
               fid.perfect_simulator(args, "light", noisy, d, prediction))


def test_speed_matched_floor_reruns_each_synthetic_run_at_its_measured_speed(fid, kept):
    """`perfect_speed_matched`'s synthetic runs: a first pass on a machine drifting 15%
    inside the run measures away from 1.0x (the probe); run again with its runner time
    divided by that speed it measures ~1.0x, or any target speed asked (`_at_speed`: the
    speed-matched draws of a real run). Without variability its errors are 0, with some
    they are not."""
    d, _ = kept
    wandering = {**PROFILE, "variability": {"run_sigma": 0.0, "step_sigma": 0.02,
                                            "drift_sigma": 0.15, "drift_tau_s": 2.0}}
    model = FittedLatencyModel.from_profile(wandering)
    trace = fid.validation_paths(argparse.Namespace(seed=0), d, "light", 1)[0]
    specs = fid.run_specs("light", trace)
    firsts = []
    target = {"decode": {"ratio": 1.2}, "prefill": {"ratio": 0.9}}
    for key in ("a", "b", "c"):
        _, rerun, first = fid._at_speed("light", wandering, model, specs, None, key)
        again = fid.trace_speed(model, rerun)
        assert {k: s["ratio"] for k, s in again.items()} == pytest.approx(
            {k: 1.0 for k in again}, abs=0.02)
        firsts += [s["ratio"] for s in first.values()]
        _, at_target, _ = fid._at_speed("light", wandering, model, specs, None, key, target)
        measured = fid.trace_speed(model, at_target)
        assert {k: s["ratio"] for k, s in measured.items()} == pytest.approx(
            {k: target[k]["ratio"] for k in measured}, abs=0.02)
    assert max(abs(r - 1) for r in firsts) > 0.03

    args = argparse.Namespace(repeats=3, perfect_suites=1, seed=0, sim_samples=1)
    steady = fid.perfect_speed_matched(args, "light", PROFILE, d)
    assert all(e[k] == pytest.approx(0, abs=1e-9) for e in steady for k in fid.METRICS)
    drifting = fid.perfect_speed_matched(args, "light", wandering, d)
    assert max(abs(e[k]) for e in drifting for k in fid.METRICS) > 1e-3


def test_a_perfect_simulators_speed_matched_errors_are_centred(fid, kept):
    """fid12: the speed-matched prediction draws the machine as the synthetic real runs are
    drawn (step jitter and the drift inside runs, each draw measured and held to the run's
    speed: `matched_runs`), so on a machine drifting 30% inside runs a perfect simulator's
    TPOT p90 is right on average. Before, the prediction had step jitter alone and missed
    the slow stretches' tail: a mean -16% here (fid11's slo suite: TTFT p90 a median -7.7%
    over 40 suites, now -1.6%). The probe: the drift is there (the synthetic runs' first
    passes measure away from 1.0x: test_speed_matched_floor_reruns_each_synthetic_run_...)."""
    d, _ = kept
    wandering = {**PROFILE, "variability": {"run_sigma": 0.0, "step_sigma": 0.02,
                                            "drift_sigma": 0.3, "drift_tau_s": 2.0}}
    args = argparse.Namespace(repeats=3, perfect_suites=4, seed=0, sim_samples=2)
    suites = fid.perfect_speed_matched(args, "light", wandering, d)
    errors = [e["tpot_p90_ms"] for e in suites]
    assert abs(statistics.fmean(errors)) < 0.06, errors
    assert max(abs(x) for x in errors) > 1e-3  # the suites do vary


def test_speed_matched_draws_drift_and_measure_the_runs_speed(fid, kept):
    """Each speed-matched draw of a kept run (`matched_runs`) is a run of its arrivals that
    drifts as the profile says and is held to the speed the run measured: with the drift,
    the draws' TPOT p90 rises over the steady machine's at the same speed (a slow stretch
    slows every request in flight together); without variability the draws are the
    deterministic model at that speed."""
    d, _ = kept
    trace = fid.validation_paths(argparse.Namespace(seed=0), d, "light", 1)[0]
    speed = {"decode": {"ratio": 1.25}, "prefill": {"ratio": 1.25}}
    steady = {**PROFILE, "variability": {"run_sigma": 0.0, "step_sigma": 0.02}}
    wandering = {**PROFILE, "variability": {**steady["variability"], "drift_sigma": 0.3,
                                            "drift_tau_s": 2.0}}

    def tpot_p90(profile: dict, samples: int = 4) -> float:
        runs = fid.matched_runs("light", profile, trace, speed, samples)
        return statistics.fmean(fid.summarize(records)["tpot_p90_ms"] for records, _ in runs)

    assert tpot_p90(wandering) > 1.05 * tpot_p90(steady)
    at_speed = FittedLatencyModel.from_profile(
        {**PROFILE, "runner_scale": {"decode": 1.25, "prefill": 1.25}})
    exact = fid.summarize(fid.run_sim(fid.WORKLOADS["light"], at_speed,
                                      fid.run_specs("light", trace))[0])["tpot_p90_ms"]
    assert tpot_p90(PROFILE, 1) == pytest.approx(exact, rel=1e-9)


def test_speed_matched_floor_runs_at_the_real_runs_speeds(fid, small_kept, monkeypatch):
    """fid12: the floor's synthetic run k and its prediction are held to the speed kept real
    run k measured (SCALES here), not 1.0x: the drift's share of a tail grows with the load,
    so a floor at another speed measures another noise. Probe: the targets differ run to run.
    On the small kept runs."""
    d, _, small = small_kept
    monkeypatch.setitem(fid.WORKLOADS, "light", small)
    wandering = {**PROFILE, "variability": {"run_sigma": 0.0, "step_sigma": 0.02,
                                            "drift_sigma": 0.15, "drift_tau_s": 2.0}}
    targets, at_speed = [], fid._at_speed

    def recording(*a, **kw):
        target = a[6] if len(a) > 6 else kw.get("target")
        targets.append({k: round(s["ratio"], 6) for k, s in (target or {}).items()})
        return at_speed(*a, **kw)

    monkeypatch.setattr(fid, "_at_speed", recording)
    args = argparse.Namespace(repeats=3, perfect_suites=1, seed=0, sim_samples=1)
    fid.perfect_speed_matched(args, "light", wandering, d)
    expected = [{"decode": s, "prefill": s} for s in SCALES]
    assert targets == expected * 2  # the prediction's draws, then the suite's synthetic runs


@pytest.fixture(scope="module")
def floor_runs(fid, small_kept, tmp_path_factory):
    """One drifting profile's replay (3 small kept runs, 1 perfect suite, 2 draws per run)
    three ways, shared by the two tests below: computing the speed-matched floor inline, in a
    --matched-floor-only run of its own, and read back by --matched-floor-from. Returns
    ({way: its --json}, argv, the matched_runs calls after each way: each call is one kept
    run's speed-matched draws)."""
    d, _, small = small_kept
    tmp = tmp_path_factory.mktemp("floor")
    profile = tmp / "drifting.json"
    profile.write_text(json.dumps({**PROFILE, "variability": {
        "run_sigma": 0.05, "step_sigma": 0.03, "drift_sigma": 0.1, "drift_tau_s": 2.0}}))
    argv = ("--replay", str(d), "--profile", str(profile), "--workloads", "light",
            "--repeats", "3", "--perfect-suites", "1", "--sim-samples", "2")
    calls, counts, out, draw = [], {}, {}, fid.matched_runs

    def counted(*a, **kw):
        calls.append(a[2])
        return draw(*a, **kw)

    with small_light(fid, small) as mp:
        mp.setattr(fid, "matched_runs", counted)
        out["inline"] = run_main(fid, mp, tmp, *argv)
        counts["inline"] = len(calls)
        floor_json = tmp / "floor.json"
        mp.setattr(sys, "argv", ["sim_fidelity.py", *argv, "--validation-seeds", "1",
                                 "--matched-floor-only", "--json", str(floor_json)])
        assert fid.main() == 0
        counts["alone"] = len(calls) - counts["inline"]
        out["alone"] = json.loads(floor_json.read_text())
        out["split"] = run_main(fid, mp, tmp, *argv, "--matched-floor-from", str(floor_json))
    return out, argv, counts


def test_matched_floor_in_a_run_of_its_own_is_the_one_computed_inline(fid, floor_runs):
    """--matched-floor-only writes the speed-matched floor's suites, --matched-floor-from
    reads them back: the same suites and verdict as one invocation computing it (a long
    replay split in two). Probe: the floor is there (suites with nonzero errors)."""
    out, _, _ = floor_runs
    alone = out["alone"]["perfect_speed_matched"]
    assert alone == out["inline"]["perfect_speed_matched"]
    assert max(abs(e[k]) for e in alone["light"] for k in fid.METRICS) > 1e-4
    split = out["split"]
    assert split["perfect_speed_matched"] == alone
    assert split["criterion_misses"] == out["inline"]["criterion_misses"]


def test_the_speed_matched_floor_takes_validates_prediction(fid, floor_runs, small_kept,
                                                             monkeypatch, tmp_path):
    """fid14: the speed-matched floor compares its synthetic suites with the prediction
    `validate` already drew (the row's speed-matched "sim"), rather than drawing it again: the
    floor's suites are those of a floor that draws its own (--matched-floor-only), to the last
    bit, and `matched_runs` runs once per kept run (in `validate`), not twice. With
    --no-floor-drift the floor's law is not the rows', so it draws its own (the probe that
    the count tells the two apart)."""
    out, argv, counts = floor_runs
    assert counts["inline"] == 3  # validate's draws of the three kept runs, and no more
    assert counts["alone"] == 3  # a floor of its own draws the prediction itself
    alone = out["alone"]["perfect_speed_matched"]
    assert alone == out["inline"]["perfect_speed_matched"]
    assert max(abs(e[k]) for e in alone["light"] for k in fid.METRICS) > 1e-4
    calls, draw = [], fid.matched_runs

    def counted(*a, **kw):
        calls.append(a[2])
        return draw(*a, **kw)

    monkeypatch.setattr(fid, "matched_runs", counted)
    monkeypatch.setitem(fid.WORKLOADS, "light", small_kept[2])
    run_main(fid, monkeypatch, tmp_path, *argv, "--no-floor-drift")
    assert len(calls) == 6  # the floor's profile lacks the drift: its prediction is its own
