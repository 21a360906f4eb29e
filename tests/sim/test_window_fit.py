"""The runner fit within windows (issue 36, fid6): `step_fit.fit_within_windows` and its use by
`calibrate --from-trace` (`calibrate_trace.fit_runner`, `fit_windows`).

The planted case: synthetic engine traces (test_calibrate_trace.engine_like_trace: a latency
model with KNOWN coefficients) whose machine runs slower in windows where the decodes read
little context and faster where they read much, the confound the real suite showed (its plain
fit put decode attention at 0.56 us per context token, within windows 2.7-4.6 us). The plain
fit takes the drift for the shape; the fit within windows recovers the planted coefficients."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import pytest

import tokenweir.sim.calibrate_trace as ct
from tokenweir.sim.calibrate_trace import calibrate_from_traces, traced_steps
from tokenweir.sim.latency import step_kind
from tokenweir.sim.step_fit import MIN_WINDOW_FIT_STEPS, fit_step_model, fit_within_windows
from tokenweir.timeline.records import load_jsonl, write_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_calibrate_trace import RUNNER, engine_like_trace  # noqa: E402

WINDOW_S = 2.0  # the synthetic runs last ~60 s: ~30 windows each of a few dozen steps
RATE = 2.0  # Poisson arrivals: batches fill and drain, so rows and contexts vary in a window


def _window_context(steps, windows) -> dict:
    """Per window key, the mean decode context per decode request of its decode steps."""
    sums: dict = {}
    for s, w in zip(steps, windows):
        if s.totals.num_decode_reqs:
            acc = sums.setdefault(w, [0, 0])
            acc[0] += s.totals.decode_context
            acc[1] += s.totals.num_decode_reqs
    return {w: c / n for w, (c, n) in sums.items()}


def confounded(steps, windows, swing: float = 0.5):
    """The steps with each window's runner time scaled by a factor that FALLS as the window's
    decodes read more context: from 1 + swing/2 at the shortest mean context to 1 - swing/2
    at the longest (a machine that happened to run fast while contexts were long), then
    rescaled per step kind to a time-weighted mean of 1: the planted coefficients stay the
    runs' mean speed, as the fit defines it. Windows too small for a factor of their own
    (step_fit.MIN_WINDOW_FIT_STEPS) keep 1."""
    ctx = _window_context(steps, windows)
    lo, hi = min(ctx.values()), max(ctx.values())
    size = Counter(windows)

    def factor(w) -> float:
        if size[w] < MIN_WINDOW_FIT_STEPS or w not in ctx:
            return 1.0
        x = (ctx[w] - lo) / (hi - lo) if hi > lo else 0.0
        return 1 + swing / 2 - swing * x

    raw = [factor(w) for w in windows]
    for kind in ("decode", "prefill"):  # sum f p = sum p over the kind's big windows
        mine = [i for i, s in enumerate(steps) if step_kind(s.totals) == kind
                and size[windows[i]] >= MIN_WINDOW_FIT_STEPS]
        scale = (sum(steps[i].runner for i in mine)
                 / sum(raw[i] * steps[i].runner for i in mine)) if mine else 1.0
        for i in mine:
            raw[i] *= scale
    return [dataclasses.replace(s, runner=s.runner * f) for s, f in zip(steps, raw)]


def _shape(coefficients: dict) -> float:
    """Decode attention relative to a decode row: the shape the drift can bend (the level,
    the machine's mean speed, is the normalisation's)."""
    return coefficients["decode_context"] / coefficients["decode_rows"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("window_fit")
    paths = []
    for seed in (11, 12):
        engine_like_trace(d / f"w{seed}.jsonl", seed=seed, rate=RATE)
        paths.append(d / f"w{seed}.jsonl")
    return paths


def test_the_fit_within_windows_recovers_a_planted_decode_context_term(runs):
    per_trace = [traced_steps(load_jsonl(p)) for p in runs]
    windows = ct.fit_windows(per_trace, WINDOW_S)
    drifted = confounded([s for t in per_trace for s in t], windows)
    totals, seconds = [s.totals for s in drifted], [s.runner for s in drifted]
    kinds = [step_kind(t) for t in totals]
    plain = fit_step_model(totals, seconds, 0.5, 3)
    # probe: the confound bends the plain fit (the real suite's failure: decode attention low)
    assert plain.coefficients["decode_context"] < 0.5 * RUNNER["decode_context"]
    windowed = fit_within_windows(totals, seconds, windows, 0.5, 3, kinds)
    assert windowed.num_windows > 40 and windowed.rounds == 4
    for name, value in RUNNER.items():
        assert windowed.fit.coefficients[name] == pytest.approx(value, rel=1e-6), name
    # the factors: time-weighted mean 1 per kind, and they carry the planted swing
    predicted = windowed.fit.predicted
    for kind in ("decode", "prefill"):
        mine = [i for i, k in enumerate(kinds) if k == kind]
        assert sum(windowed.factors[i] * predicted[i] for i in mine) == \
            pytest.approx(sum(predicted[i] for i in mine), rel=1e-9)
    assert max(windowed.factors) / min(windowed.factors) > 1.4
    # one level for both kinds: the planted levels per kind no longer bind, the shape holds
    one = fit_within_windows(totals, seconds, windows, 0.5, 3)
    assert _shape(one.fit.coefficients) == pytest.approx(_shape(RUNNER), rel=0.05)


def test_one_window_or_windows_too_small_are_the_plain_fit(runs):
    """The contract's edge: the same floats as fit_step_model, factors all 1."""
    steps = traced_steps(load_jsonl(runs[0]))
    totals, seconds = [s.totals for s in steps], [s.runner for s in steps]
    plain = fit_step_model(totals, seconds, 0.5, 3)
    for windows in ([0] * len(steps), list(range(len(steps))),
                    [i // (MIN_WINDOW_FIT_STEPS - 1) for i in range(len(steps))]):
        one = fit_within_windows(totals, seconds, windows, 0.5, 3)
        assert one.fit.coefficients == plain.coefficients
        assert one.fit.predicted == plain.predicted
        assert one.factors == [1.0] * len(steps) and one.rounds == 1
    with pytest.raises(ValueError, match="one window key"):
        fit_within_windows(totals, seconds, [0], 0.5, 3)


def _write_confounded(runs, tmp_path) -> list[str]:
    """The runs rewritten as traces whose forward phase carries the confounded drift."""
    out = []
    per_trace = [traced_steps(load_jsonl(p)) for p in runs]
    windows = ct.fit_windows(per_trace, WINDOW_S)
    drifted = iter(confounded([s for t in per_trace for s in t], windows))
    for k, p in enumerate(runs):
        trace = load_jsonl(p)
        kept = {s.start: next(drifted) for s in traced_steps(trace)}
        for s in trace.steps:
            d = kept.get(s["start"])
            if d is not None and s.get("phases"):
                extra = d.runner - sum(s["phases"].get(x, 0.0) for x in ("prepare", "forward",
                                                                          "sample", "execute"))
                s["phases"]["forward"] += extra
                s["duration"] += extra
        write_jsonl(trace, tmp_path / f"c{k}.jsonl")
        out.append(str(tmp_path / f"c{k}.jsonl"))
    return out


def test_calibration_fits_within_windows(runs, tmp_path, monkeypatch):
    """`calibrate --from-trace` on the confounded traces: the profile's main terms are the
    planted ones within 5%, and the profile records its windows. Guard (the broken variant,
    WINDOW_FIT off: one fit over all steps, as before fid6): decode attention under half the
    planted term. Probe: the fit was handed one key per run, window and step kind."""
    paths = _write_confounded(runs, tmp_path)
    monkeypatch.setattr(ct, "FIT_WINDOW_S", WINDOW_S)
    seen = []
    real = ct.fit_runner
    monkeypatch.setattr(ct, "fit_runner",
                        lambda steps, windows, targets=None, hinge_tokens=0:
                        seen.append(list(windows)) or real(steps, windows, targets, hinge_tokens))
    # no held-out steps: a window the split would leave under MIN_WINDOW_FIT_STEPS steps
    # keeps factor 1 in the fit while its steps carry the planted one
    profile = calibrate_from_traces(paths, holdout_every=0)
    assert seen and all(len(set(w)) > 10 for w in seen)
    assert {k for w in seen for (_, _, k) in w} == {"decode", "prefill"}
    for name in ("const", "prefill_tokens", "decode_rows", "decode_context"):  # the terms
        # that carry the time (prefill_attention, 2e-8 s per pair here, is below the noise the
        # held-out split and the few-rows table leave)
        assert profile["coefficients"][name] == pytest.approx(RUNNER[name], rel=0.05), name
    fit = profile["fit"]
    assert fit["num_windows"] > 10 and fit["window_s"] == WINDOW_S
    assert fit["window_factor_max"] / fit["window_factor_min"] > 1.3
    monkeypatch.setattr(ct, "WINDOW_FIT", False)
    broken = calibrate_from_traces(paths, holdout_every=0)
    assert broken["coefficients"]["decode_context"] < 0.5 * RUNNER["decode_context"]
    assert "num_windows" not in broken["fit"]


def test_window_keys_are_per_run_window_and_kind(runs):
    per_trace = [traced_steps(load_jsonl(p)) for p in runs]
    keys = ct.fit_windows(per_trace, 1.0)
    flat = [s for t in per_trace for s in t]
    assert len(keys) == len(flat)
    for (run, window, kind), s, k in zip(keys, flat, [k for k, t in enumerate(per_trace)
                                                       for _ in t]):
        assert run == k and kind == step_kind(s.totals)
        assert window == int((s.start - per_trace[k][0].start) // 1.0)


# The profile that the code before fid6 (main 495a511) fitted to these two traces, every key
# but the wall time and the temp paths: sha256 of its sorted JSON, by the CPU kind it was measured
# on (running that commit's calibrate_trace on the same traces there): the least-squares fit's
# last bits follow the CPU's BLAS kernels. pre_fid6_profile.json holds the Intel one's values,
# which every other CPU must match within PRE_FID6_REL (a value, not a bit, comparison).
PRE_FID6_DIGESTS = {
    "81222f270e92ffd726cb0c740495b4bf91eda5d8e66962a0a549278891ea2413",  # AMD EPYC, AVX2 only
    "145ec712f4a8b83edff51419032715099656f030646482481916d25a13516e55",  # Xeon, AVX-512 + AMX
}
PRE_FID6_PROFILE = Path(__file__).with_name("pre_fid6_profile.json")
PRE_FID6_REL = 1e-9


def assert_values_close(got, want, where: str = "profile") -> None:
    """got == want, floats within PRE_FID6_REL (relative; 1e-15 absolute near zero)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            assert_values_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_values_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=PRE_FID6_REL, abs=1e-15), where
    else:
        assert got == want, where


def test_with_the_window_fit_off_the_profile_is_the_one_before_it(tmp_path, monkeypatch):
    """WINDOW_FIT False is the fit before fid6: its values within PRE_FID6_REL of the old code's
    on every CPU (the
    recording was bit-exact where it was made). Probe: on, the profile differs."""
    import hashlib
    import json

    paths = []
    for seed in (4, 5):
        engine_like_trace(tmp_path / f"{seed}.jsonl", seed=seed, noise=0.03)
        paths.append(str(tmp_path / f"{seed}.jsonl"))

    def comparable(profile: dict) -> dict:
        kept = {k: v for k, v in profile.items() if k not in ("calibration_seconds", "traces")}
        assert kept.pop("forward_phases") is None  # fid9's key: null, these traces carry no phases
        return before_fid7(before_fid15(before_fid16(kept)))

    def sha(profile: dict) -> str:
        return hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()

    on = calibrate_from_traces(paths, holdout_every=5)
    monkeypatch.setattr(ct, "WINDOW_FIT", False)
    monkeypatch.setattr(ct, "FEW_ROWS_RUN_SPEED", False)  # fid15's few_rows fit off as well
    monkeypatch.setattr(ct, "FEW_ROWS_NOISE_SE", 0.0)
    off = calibrate_from_traces(paths, holdout_every=5)
    recorded = json.loads(PRE_FID6_PROFILE.read_text())
    off_profile, on_profile = comparable(off), comparable(on)
    assert sha(recorded) in PRE_FID6_DIGESTS  # the recording is what the old code wrote
    assert_values_close(off_profile, recorded)
    with pytest.raises(AssertionError):
        assert_values_close(on_profile, recorded)
    assert sha(on_profile) not in PRE_FID6_DIGESTS and on["fit"]["num_windows"] > 1


def before_fid16(profile: dict) -> dict:
    """The profile less the hold split fid16 added (`drift.fit_hold_split`: each kind's
    "hold_sigma", the variability's "num_holds"), checked to be there."""
    v = dict(profile["variability"])
    assert v.pop("num_holds") >= 1
    kinds = {k: dict(law) for k, law in v["kinds"].items()}
    for law in kinds.values():
        assert law.pop("hold_sigma") >= 0.0
    return {**profile, "variability": {**v, "kinds": kinds}}


def before_fid15(profile: dict) -> dict:
    """The profile less the per-kind noise law fid15 added to its variability
    (`drift.fit_kind_law`), checked to be there."""
    v = dict(profile["variability"])
    assert set(v.pop("kinds")) == {"decode", "prefill"}
    v.pop("kind_run_rho"), v.pop("kind_drift_rho")
    return {**profile, "variability": v}


def before_fid7(profile: dict) -> dict:
    """The profile less what fid7 added with the decode-context hinge, checked to be its
    no-hinge values (knee 0, coefficient 0, the feature last in the list): what is left is
    the profile as the code before fid7 wrote it."""
    assert profile.pop("decode_hinge_tokens") == 0
    coefficients = dict(profile["coefficients"])
    assert coefficients.pop("decode_context_hinge") == 0.0
    assert profile["features"][-1] == "decode_context_hinge"
    return {**profile, "coefficients": coefficients, "features": profile["features"][:-1]}
