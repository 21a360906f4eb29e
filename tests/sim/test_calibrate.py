"""`tokenweir calibrate` and the fitted latency model: the fit recovers known coefficients,
the command times a real (tiny, random) model and writes a profile whose model reproduces its
own training points, and `simulate --profile` runs on it."""

from __future__ import annotations

import json
import random

import pytest

from tokenweir.cli import main as cli_main
from tokenweir.sim.build import build_simulation
from tokenweir.sim.calibrate import (PROFILE_FORMAT, GridPoint, build_profile, default_grid,
                                     fit_line, fit_step_model, load_profile, quick_grid)
from tokenweir.sim.latency import (FITTED_FEATURES, FittedLatencyModel, StepTotals,
                                   fitted_features)
from tokenweir.sim.workload import RequestSpec

TRUE = {"const": 0.04, "prefill_tokens": 0.0025, "decode_rows": 0.004,
        "prefill_attention": 3e-6, "decode_context": 7e-6, "prefill_rows": 0.02,
        "multi_decode": 0.025, "prefill_self_attention": 1.5e-6}


def test_the_fit_recovers_known_coefficients_exactly():
    model = FittedLatencyModel(TRUE)
    grid = default_grid()
    seconds = [model.predict_totals(p.totals()) for p in grid]
    fit = fit_step_model([p.totals() for p in grid], seconds)
    for name in FITTED_FEATURES:  # the grid fit has no hinge (knee 0): its coefficient 0
        assert fit.coefficients[name] == pytest.approx(TRUE.get(name, 0.0), rel=1e-6)
    assert fit.max_rel_error < 1e-9 and fit.r2 == pytest.approx(1.0)


def test_the_fit_keeps_coefficients_non_negative_under_noise():
    """Times with no multi-decode cost plus noise: its coefficient may not go below 0 (a
    negative cost would predict negative time for some steps); the others stay close."""
    truth = {**TRUE, "multi_decode": 0.0}
    model, rng = FittedLatencyModel(truth), random.Random(3)
    grid = default_grid()
    seconds = [model.predict_totals(p.totals()) * rng.uniform(0.97, 1.03) for p in grid]
    fit = fit_step_model([p.totals() for p in grid], seconds)
    assert all(c >= 0 for c in fit.coefficients.values())
    assert fit.coefficients["prefill_tokens"] == pytest.approx(truth["prefill_tokens"], rel=0.1)
    assert fit.mean_rel_error < 0.03


def test_ttft_line_and_profile_layout():
    assert fit_line([1, 2, 3], [5, 7, 9]) == pytest.approx((2.0, 3.0, 1.0))
    points = quick_grid()
    model = FittedLatencyModel(TRUE)
    profile = build_profile(points, [model.predict_totals(p.totals()) for p in points],
                            {"model": "m", "threads": 1})
    assert profile["format"] == PROFILE_FORMAT
    solo = [p for p in points if p.prefill_tokens and not p.prefill_context
            and not p.decode_requests]
    assert len(solo) >= 2
    # Solo prefills cost const + prefill_rows + tokens * per-token + self-attention: the
    # line's slope is at least the per-token coefficient.
    assert profile["ttft"]["a"] >= TRUE["prefill_tokens"]
    assert [q["predicted"] for q in profile["points"]] == pytest.approx(
        [q["seconds"] for q in profile["points"]], rel=1e-6)


def test_features_split_prefill_and_decode_attention():
    t = StepTotals.of_chunks([(100, 20), (1, 50), (1, 60), (7, 3)])
    const, prefill_tokens, decode_rows, prefill_attn, decode_ctx, prefill_rows, multi, \
        self_attn, hinge = fitted_features(t)
    assert hinge == 0.0  # no knee (test_decode_hinge.py)
    assert (const, prefill_tokens, decode_rows, prefill_rows, multi) == (1, 107, 2, 2, 1)
    assert prefill_attn == 100 * (20 + 101 / 2) + 7 * (3 + 8 / 2)
    assert self_attn == 100 * 101 / 2 + 7 * 8 / 2  # within the chunks only
    assert decode_ctx == 110
    assert fitted_features(StepTotals.of_chunks([(1, 9)]))[6] == 0.0  # a lone decode


def test_a_profile_without_the_newest_feature_predicts_the_same_floats():
    """Profiles fitted before prefill_self_attention existed load with it at 0 and predict
    exactly what they did (the feature is summed last: + 0.0 changes no float)."""
    old = {k: v for k, v in TRUE.items() if k != "prefill_self_attention"}
    model = FittedLatencyModel(old)
    t = StepTotals.of_chunks([(100, 20), (1, 50), (1, 60), (7, 3)])
    features = fitted_features(t)[:7]
    expected = 0.0
    for name, x in zip(FITTED_FEATURES, features):
        expected += old[name] * x
    assert model.runner_seconds(t) == expected
    assert model.coefficients["prefill_self_attention"] == 0.0


def test_fitted_model_drives_the_simulator_and_rejects_non_profiles(tmp_path):
    model = FittedLatencyModel(TRUE, kv_bytes_per_token=4096, max_model_len=512)
    spec = RequestSpec("only", arrival=1.0, prompt_len=200, output_len=4)
    sim = build_simulation({"max_num_batched_tokens": 256, "enable_prefix_caching": False},
                           [spec], latency_model=model, check=True)
    result = sim.run()
    (record,) = result.requests
    assert record.first_token - record.arrival == pytest.approx(model.step_time([(200, 0)]))
    assert [s.seconds for s in result.steps[1:]] == pytest.approx(
        [model.step_time([(1, 200 + j)]) for j in range(3)])
    # The pool is sized as the real engine sizes it: kv_cache_space (1 GiB) / block bytes.
    assert sim.scheduler.kv.num_usable_blocks == 2**30 // (16 * 4096)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"coefficients": {"const": 1}}))
    with pytest.raises(ValueError, match="not a tokenweir-step-profile"):
        load_profile(str(bad))
    with pytest.raises(ValueError, match="unknown fitted-model coefficients"):
        FittedLatencyModel({"bogus": 1.0})


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """`tokenweir calibrate --quick` on a small random Llama (HF directory, no tokenizer),
    big enough that its steps take milliseconds rather than scheduler noise."""
    import torch
    import transformers as tf

    from tests.model.tiny_models import randomize_

    root = tmp_path_factory.mktemp("calibrate")
    torch.manual_seed(1)
    config = tf.LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=768,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, max_position_embeddings=512)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, 1)
    model.save_pretrained(str(root / "tiny"))
    out = root / "profile.json"
    assert cli_main(["calibrate", str(root / "tiny"), "--quick", "--repeats", "5",
                     "--out", str(out)]) == 0
    return out


def test_calibrate_writes_a_profile_that_predicts_its_training_points(tiny_profile, capsys):
    profile = load_profile(str(tiny_profile))
    assert profile["grid"] == "quick" and profile["dtype"] == "float32"
    assert profile["fit"]["num_points"] == len(quick_grid()) == len(profile["points"])
    assert profile["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4  # K+V, layers, kv heads, dim, f32
    assert set(profile["ttft"]) == {"a", "c", "r2"} and profile["ttft"]["a"] > 0
    model = FittedLatencyModel.from_profile(str(tiny_profile))
    relative = []
    for point in profile["points"]:
        grid_point = GridPoint(point["prefill_tokens"], point["prefill_context"],
                               point["decode_requests"], point["decode_context"])
        predicted = model.predict_totals(grid_point.totals())
        assert predicted == pytest.approx(point["predicted"], rel=1e-9)
        relative.append(abs(predicted - point["seconds"]) / point["seconds"])
        # Millisecond steps of a tiny model on a shared machine are noisy: a loose bound,
        # which a broken fit or broken timing still misses by far.
        assert point["seconds"] / 3 < predicted < point["seconds"] * 3
    assert profile["fit"]["mean_rel_error"] == pytest.approx(sum(relative) / len(relative))
    assert profile["fit"]["max_rel_error"] == pytest.approx(max(relative))
    assert profile["fit"]["mean_rel_error"] < 0.6


def test_simulate_cli_runs_on_a_calibrated_profile(tiny_profile, capsys):
    assert cli_main(["simulate", "--profile", str(tiny_profile), "--num-requests", "20",
                     "--request-rate", "50", "--prompt-len", "fixed:40", "--output-len",
                     "fixed:5", "--max-model-len", "256", "--num-gpu-blocks-override",
                     "200"]) == 0
    out = capsys.readouterr().out
    assert "fitted profile" in out and "num_finished                 20" in out
    # cluster mode takes the profile too (it used to refuse it: single instance only)
    assert cli_main(["simulate", "--profile", str(tiny_profile), "--num-requests", "20",
                     "--request-rate", "50", "--prompt-len", "fixed:40", "--output-len",
                     "fixed:5", "--max-model-len", "256", "--num-gpu-blocks-override",
                     "200", "--num-instances", "2"]) == 0
    out = capsys.readouterr().out
    assert "fitted profile" in out and "per instance" in out
    assert "num_finished                 20" in out
