"""`tokenweir calibrate` and the fitted latency model: the fit recovers known coefficients,
the command times a real (tiny, random) model and writes a profile whose model reproduces its
own training points, and `simulate --profile` runs on it."""

from __future__ import annotations

import hashlib
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


# The small random Llama calibrated below, as transformers' LlamaConfig(vocab_size=384,
# hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
# num_key_value_heads=2, head_dim=64, max_position_embeddings=512) and save_pretrained wrote it
# (config.json and generation_config.json less transformers_version). Written without
# transformers: importing it and building the model was most of the fixture's time.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "attention_bias": False,
              "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "float32",
              "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 256,
              "initializer_range": 0.02, "intermediate_size": 768,
              "max_position_embeddings": 512, "mlp_bias": False, "model_type": "llama",
              "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
              "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
              "tie_word_embeddings": False, "use_cache": True, "vocab_size": 384}
TINY_GENERATION = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                   "output_attentions": False, "output_hidden_states": False, "use_cache": True}
# sha256 of the old fixture's model.safetensors (transformers' from_config, randomize_(model,
# 1), save_pretrained), over its tensors by name: names, shapes, dtypes and bytes
# (`_weights_digest`); recorded from that code with transformers 5.24.0
TINY_LLAMA_WEIGHTS = "95af212c6387aca183620ac7cb764b408757aac752d0c0efedddce1b3d21139c"


def _tiny_llama_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of LlamaForCausalLM(c), in its named_parameters() order."""
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = [("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
             ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
             ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)), ("mlp.down_proj", (h, f)),
             ("input_layernorm", (h,)), ("post_attention_layernorm", (h,))]
    return ([("model.embed_tokens.weight", (c["vocab_size"], h))]
            + [(f"model.layers.{i}.{name}.weight", shape)
               for i in range(c["num_hidden_layers"]) for name, shape in layer]
            + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))])


def write_tiny_llama(path, seed: int = 1) -> None:
    """An HF directory (config.json, model.safetensors) of TINY_LLAMA with the weights
    tests/model/tiny_models.randomize_(model, seed) gives that model: randomize_ itself, over
    the same names and shapes in the same order, so the same bits."""
    import torch
    from safetensors.torch import save_file

    from tests.model.tiny_models import randomize_

    class Parameters:  # what randomize_ reads of a model
        def __init__(self, tensors: dict):
            self.named_parameters = tensors.items

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA, indent=2))
    (path / "generation_config.json").write_text(json.dumps(TINY_GENERATION, indent=2))
    tensors = {name: torch.empty(shape) for name, shape in _tiny_llama_shapes(TINY_LLAMA)}
    randomize_(Parameters(tensors), seed)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _weights_digest(path) -> str:
    from safetensors.torch import load_file

    tensors, h = load_file(str(path / "model.safetensors")), hashlib.sha256()
    for name in sorted(tensors):
        x = tensors[name].contiguous()
        h.update(f"{name}{tuple(x.shape)}{x.dtype}".encode())
        h.update(x.numpy().tobytes())
    return h.hexdigest()


def test_the_tiny_llama_is_the_one_transformers_wrote(tmp_path):
    """write_tiny_llama writes the weights the old fixture's transformers model had, to the
    bit (the recorded digest), under the names and in the order of its named_parameters."""
    write_tiny_llama(tmp_path / "tiny")
    assert _weights_digest(tmp_path / "tiny") == TINY_LLAMA_WEIGHTS
    names = [name for name, _ in _tiny_llama_shapes(TINY_LLAMA)]
    assert len(names) == 1 + 4 * 9 + 2 and names[-1] == "lm_head.weight"


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """`tokenweir calibrate --quick` on a small random Llama (HF directory, no tokenizer),
    big enough that its steps take milliseconds rather than scheduler noise."""
    root = tmp_path_factory.mktemp("calibrate")
    write_tiny_llama(root / "tiny")
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
