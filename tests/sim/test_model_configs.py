"""Any model from its Hugging Face config (sim/model_config.py) and the hardware table
(sim/hardware.py): parameter counts against the model cards, the dense roofline equal to the
built-in shapes', the MoE roofline (active parameters, experts touched), GQA, sliding window,
and the command-line flags."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenweir.cli import main as cli_main
from tokenweir.sim.build import build_simulation, engine_setup
from tokenweir.sim.hardware import HARDWARE_PROFILES, get_hardware, get_shape
from tokenweir.sim.latency import RooflineLatencyModel
from tokenweir.sim.metrics import summarize
from tokenweir.sim.model_config import (MODEL_TABLE, load_model_config, published_params,
                                        shape_from_hf_config, shipped_config_paths)
from tokenweir.sim.workload import RequestSpec

SHIPPED = sorted(shipped_config_paths())
MOE = ["mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b"]
STEPS = [[(1, 100)], [(1, 3000)] * 64, [(512, 0)], [(2048, 0)], [(300, 700), (1, 50), (1, 900)]]


def test_the_table_ships_the_models_the_issue_names():
    for name in ("llama-3-8b", "llama-3-70b", "qwen2.5-7b", "qwen2.5-72b", "mixtral-8x7b",
                 "qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mistral-7b"):
        assert name in SHIPPED and name in MODEL_TABLE
        assert "huggingface.co" in get_shape(name).source  # every config cites its card


@pytest.mark.parametrize("name", SHIPPED)
def test_parameter_counts_are_within_two_percent_of_the_model_cards(name):
    shape = get_shape(name)
    total, active = published_params(name)
    assert shape.num_params == pytest.approx(total, rel=0.02)
    assert shape.num_active_params == pytest.approx(active, rel=0.02)


def test_published_figures_the_tests_compare_with():
    # the issue's anchors, independent of the JSON files' own numbers
    assert get_shape("llama-3-8b").num_params == pytest.approx(8.0e9, rel=0.02)
    assert get_shape("llama-3-70b").num_params == pytest.approx(70.6e9, rel=0.02)
    mixtral = get_shape("mixtral-8x7b")
    assert mixtral.num_params == pytest.approx(46.7e9, rel=0.02)
    assert mixtral.num_active_params == pytest.approx(12.9e9, rel=0.02)


@pytest.mark.parametrize("name", MOE)
def test_moe_active_parameters_are_fewer_than_total(name):
    shape = get_shape(name)
    assert shape.num_moe_layers == shape.num_layers > 0
    assert shape.num_active_params < shape.num_params / 3
    dense = dataclasses.replace(shape, num_experts=0, num_experts_per_tok=0, num_moe_layers=0)
    assert dense.num_params < shape.num_params  # the probe: experts were counted at all


@pytest.mark.parametrize("config, builtin", [("smollm2-135m-instruct", "smollm2-135m"),
                                             ("llama-2-7b", "llama-7b")])
@pytest.mark.parametrize("hardware, tp", [("h100", 1), ("a100-80gb", 2), ("cpu-epyc-2c", 1)])
def test_dense_roofline_from_a_config_equals_the_builtin_shape(config, builtin, hardware, tp):
    hw = get_hardware(hardware)
    from_config = RooflineLatencyModel(get_shape(config), hw, tp)
    built_in = RooflineLatencyModel(get_shape(builtin), hw, tp)
    for chunks in STEPS:
        assert from_config.step_time(chunks) == built_in.step_time(chunks)  # exactly


def test_pool_from_a_tied_config_equals_the_builtin_and_an_untied_one_holds_its_embedding():
    same = [engine_setup({}, name).num_blocks for name in ("smollm2-135m-instruct",
                                                           "smollm2-135m")]
    assert same[0] == same[1]
    untied, builtin = (engine_setup({}, name).num_blocks for name in ("llama-2-7b", "llama-7b"))
    embedding_blocks = 32000 * 4096 * 2 // (16 * get_shape("llama-7b").kv_bytes_per_token(2))
    assert builtin - untied in (embedding_blocks, embedding_blocks + 1)


def test_weights_that_do_not_fit_are_refused_and_tensor_parallel_makes_room():
    with pytest.raises(ValueError, match="do not fit"):
        engine_setup({}, "llama-3-70b", "h100")
    assert engine_setup({}, "llama-3-70b", "h100", tp=4).num_blocks > 1000
    with pytest.raises(ValueError, match="do not fit"):  # every expert is held: 93 GB in bf16
        engine_setup({}, "mixtral-8x7b", "h100")
    assert engine_setup({}, "mixtral-8x7b", "h100", tp=2).num_blocks > 1000


def test_gqa_and_head_dim_come_from_the_config():
    assert get_shape("llama-3-8b").kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2
    qwen3 = get_shape("qwen3-30b-a3b")  # head_dim 128 although hidden / heads = 64
    assert (qwen3.head_dim, qwen3.num_kv_heads) == (128, 4)
    assert qwen3.kv_bytes_per_token(2) == 2 * 48 * 4 * 128 * 2


def test_expected_experts_touched_follows_the_stated_formula():
    shape = get_shape("mixtral-8x7b")  # E = 8, k = 2
    assert shape.expected_experts_touched(1) == pytest.approx(2.0)
    assert shape.expected_experts_touched(2) == pytest.approx(8 * (1 - 0.75 ** 2))
    touched = [shape.expected_experts_touched(b) for b in range(1, 200)]
    assert all(a < b for a, b in zip(touched, touched[1:]) if b < 8 - 1e-9)
    assert all(t <= min(8, b * 2) + 1e-12 for b, t in zip(range(1, 200), touched))
    assert touched[-1] == pytest.approx(8.0)


def test_moe_decode_reads_only_the_experts_its_tokens_touch():
    shape, hw = get_shape("mixtral-8x7b"), get_hardware("h100")
    model = RooflineLatencyModel(shape, hw, tp=2)
    bw = hw.effective_bandwidth * 2
    expert_s = shape.num_moe_layers * shape.expert_params * hw.dtype_bytes / bw
    always_s = shape.dense_matmul_params * hw.dtype_bytes / bw
    one = model.step_time([(1, 0)])
    # a lone decode: bandwidth-bound on the always-read weights + k experts per layer
    comm = model._s_allreduce_fixed + model._s_allreduce_per_token
    attention = one - hw.step_overhead_s - comm - (always_s + 2 * expert_s)
    assert 0 <= attention < 1e-5
    # a batch touches more experts: the weight read grows toward all of them
    batch = model.step_time([(1, 0)] * 32)
    assert batch > one
    everything = shape.num_matmul_params * hw.dtype_bytes / bw
    assert batch - hw.step_overhead_s < everything * 1.05
    dense_twin = RooflineLatencyModel(dataclasses.replace(
        shape, num_experts=0, num_experts_per_tok=0, num_moe_layers=0,
        intermediate_size=shape.moe_intermediate_size * 8), hw, tp=2)
    assert one < dense_twin.step_time([(1, 0)]) / 2  # same total weights, dense: all read


def test_moe_prefill_flops_count_active_parameters_only():
    shape, hw = get_shape("qwen3-30b-a3b"), get_hardware("h100")
    model = RooflineLatencyModel(shape, hw)
    per_token = model._s_per_token_linear * hw.effective_flops / 2
    assert per_token == shape.active_layer_params_per_token
    assert shape.active_layer_params_per_token < shape.num_matmul_params / 8


def _decode_tpot(shape, prompt_len: int) -> float:
    spec = RequestSpec("r0", 0.0, prompt_len, 20)
    model = RooflineLatencyModel(shape, get_hardware("h100"))
    sim = build_simulation({"max_model_len": 16384, "num_gpu_blocks_override": 2000},
                           [spec], latency_model=model)
    return summarize(sim.run())["tpot_p50_ms"]


def test_sliding_window_caps_the_attended_context():
    mistral = get_shape("mistral-7b")
    assert mistral.sliding_window == 4096
    no_window = dataclasses.replace(mistral, sliding_window=None)
    # inside the window nothing changes; beyond it the window stops the context's cost
    assert _decode_tpot(mistral, 2000) == _decode_tpot(no_window, 2000)
    assert _decode_tpot(mistral, 12000) < _decode_tpot(no_window, 12000)
    assert _decode_tpot(mistral, 12000) == pytest.approx(_decode_tpot(mistral, 4200), rel=1e-6)


def test_a_window_the_config_switches_off_is_ignored():
    assert get_shape("qwen2.5-7b").sliding_window is None  # use_sliding_window: false


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        shape_from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="'num_hidden_layers'"):
        shape_from_hf_config({"model_type": "llama", "hidden_size": 64,
                              "num_attention_heads": 4})
    with pytest.raises(ValueError, match="does not exist"):
        load_model_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown model shape"):
        get_shape("no-such-model")


def test_a_model_directory_reads_its_config_json(tmp_path):
    config = json.loads(shipped_config_paths()["llama-3-8b"].read_text())
    (tmp_path / "Llama-3-8B").mkdir()
    (tmp_path / "Llama-3-8B" / "config.json").write_text(json.dumps(config))
    shape = get_shape(str(tmp_path / "Llama-3-8B"))
    assert shape.name == "Llama-3-8B"
    assert dataclasses.replace(shape, name="x", source="") == dataclasses.replace(
        get_shape("llama-3-8b"), name="x", source="")


def _cli_metrics(tmp_path, name: str, extra: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    argv = ["simulate", "--num-requests", "40", "--request-rate", "20", "--tp", "2",
            "--json", str(out)] + extra
    assert cli_main(argv) == 0
    metrics = json.loads(out.read_text())
    metrics.pop("wall_seconds")
    return metrics


def test_cli_model_and_model_config_price_the_same_model(tmp_path):
    by_name = _cli_metrics(tmp_path, "name", ["--model", "mixtral-8x7b"])
    by_path = _cli_metrics(tmp_path, "path", ["--model-config",
                                              str(shipped_config_paths()["mixtral-8x7b"])])
    dense = _cli_metrics(tmp_path, "dense", ["--model", "llama-3-8b"])
    assert by_name == by_path
    assert by_name["tpot_p50_ms"] > dense["tpot_p50_ms"]  # the probe: the model mattered


def test_cli_refuses_a_bad_config_and_both_flags(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli_main(["simulate", "--model-config", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert cli_main(["simulate", "--model", "llama-3-8b", "--model-config", str(bad)]) == 2
    assert "not both" in capsys.readouterr().err


def test_every_hardware_profile_names_its_source_and_its_own_peak():
    for name in ("a100-80gb", "h100", "h200", "b200", "mi300x", "cpu-epyc-2c",
                 "cpu-avx512-socket"):
        hw = HARDWARE_PROFILES[name]
        assert hw.source and hw.mem_bandwidth > 0 and hw.memory_bytes > 0
        assert hw.peak_flops in dict(hw.peak_flops_by_dtype).values()


def test_hardware_dtype_switches_peak_and_bytes(tmp_path):
    h100, fp8 = get_hardware("h100"), get_hardware("h100:fp8")
    assert (fp8.peak_flops, fp8.dtype_bytes) == (1979e12, 1)  # the data sheet: 1,979 TFLOPS
    with pytest.raises(ValueError, match="no fp4 peak"):
        get_hardware("h100:fp4")
    shape = get_shape("llama-3-8b")
    assert (RooflineLatencyModel(shape, fp8).step_time([(1, 100)])
            < RooflineLatencyModel(shape, h100).step_time([(1, 100)]))
    bf16 = _cli_metrics(tmp_path, "bf16", ["--model", "llama-3-8b", "--hardware", "b200"])
    fp8m = _cli_metrics(tmp_path, "fp8", ["--model", "llama-3-8b", "--hardware", "b200",
                                          "--hardware-dtype", "fp8"])
    assert fp8m["tpot_p50_ms"] < bf16["tpot_p50_ms"]
