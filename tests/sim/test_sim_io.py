"""Workload traces (import, export, bad lines), Chrome traces, and the simulate/sweep CLI."""

from __future__ import annotations

import csv
import json

import pytest

from tokenweir.cli import main as cli_main
from tokenweir.sim.build import build_simulation
from tokenweir.sim.cli import parse_sets
from tokenweir.sim.trace import chrome_trace_events, write_chrome_trace
from tokenweir.sim.workload import TraceError, load_trace, save_trace, synthetic


def _cli(argv: list[str]) -> int:
    return cli_main(argv)


def test_synthetic_workloads_are_seeded():
    a = synthetic(50, 10.0, seed=7, prompt="lognormal:100:0.3", output="uniform:5:9",
                  arrival="gamma", cv=3.0, num_prefix_groups=2, prefix_len=32,
                  priority_mix="0:1,2:1", max_model_len=512)
    assert a == synthetic(50, 10.0, seed=7, prompt="lognormal:100:0.3", output="uniform:5:9",
                          arrival="gamma", cv=3.0, num_prefix_groups=2, prefix_len=32,
                          priority_mix="0:1,2:1", max_model_len=512)
    assert all(s.prompt_len + s.output_len <= 512 and 5 <= s.output_len <= 9 for s in a)
    assert {s.priority for s in a} == {0, 2}
    same_group = [s for s in a if s.prefix_group == a[0].prefix_group][:2]
    p0, p1 = (s.prompt_tokens() for s in same_group)
    assert p0[:32] == p1[:32] and p0[32] != p1[32]


def test_trace_round_trip(tmp_path):
    specs = synthetic(30, 5.0, seed=1, num_prefix_groups=2, prefix_len=16,
                      priority_mix="0:1,1:1", ttft_slo_ms=250.0)
    path = tmp_path / "w.jsonl"
    save_trace(specs, str(path))
    assert load_trace(str(path)) == specs


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"arrival": 0, "prompt_len": 5}', "missing required field 'output_len'"),
    ('{"arrival": -1, "prompt_len": 5, "output_len": 3}', "arrival must be"),
    ('{"arrival": 0, "prompt_len": 0, "output_len": 3}', "prompt_len must be >= 1"),
    ('{"arrival": 0, "prompt_len": "5", "output_len": 3}', "'prompt_len' has bad type"),
    ('{"arrival": 0, "prompt_len": 5, "output_len": 3, "colour": 1}', "unknown field"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_trace_lines_name_their_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 5, "output_len": 3}\n\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        load_trace(str(path))
    assert "bad.jsonl:3:" in str(info.value)


def test_chrome_trace_is_valid_json_with_steps_and_request_spans(tmp_path):
    specs = synthetic(20, 50.0, seed=0, prompt="fixed:40", output="fixed:6")
    result = build_simulation({"num_gpu_blocks_override": 200, "max_model_len": 256}, specs,
                              "smollm2-135m", "cpu-epyc-2c").run()
    path = tmp_path / "trace.json"
    write_chrome_trace(result, str(path))
    events = json.loads(path.read_text())["traceEvents"]
    steps = [e for e in events if e["ph"] == "X"]
    assert len(steps) == len(result.steps) and all(e["dur"] > 0 for e in steps)
    begins = [e for e in events if e["ph"] == "b"]
    ends = [e for e in events if e["ph"] == "e"]
    assert len(begins) == len(ends) == 20 * 4  # the request span and its three phases
    for e in begins + ends:
        assert {"cat", "id", "name", "ts", "pid"} <= set(e)
    assert {e["name"] for e in begins} >= {"queued", "prefill", "decode"}
    assert chrome_trace_events(result, max_requests=5).count  # bounded export works


def test_simulate_cli_prints_metrics(tmp_path, capsys):
    trace = tmp_path / "t.json"
    saved = tmp_path / "w.jsonl"
    rc = _cli(["simulate", "--model-shape", "smollm2-135m", "--hardware", "a100-80gb",
               "--num-requests", "30", "--request-rate", "20", "--prompt-len", "fixed:64",
               "--output-len", "uniform:2:10", "--max-num-batched-tokens", "256",
               "--num-gpu-blocks-override", "300", "--max-model-len", "512",
               "--ttft-slo-ms", "100", "--chrome-trace", str(trace),
               "--save-trace", str(saved)])
    out = capsys.readouterr().out
    assert rc == 0 and "ttft_p99_ms" in out and "goodput" in out
    assert json.loads(trace.read_text())["traceEvents"]
    rc = _cli(["simulate", "--model-shape", "smollm2-135m", "--trace", str(saved),
               "--num-gpu-blocks-override", "300", "--max-model-len", "512"])
    assert rc == 0 and "num_finished                 30" in capsys.readouterr().out


def test_simulate_cli_reports_a_bad_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0}\n')
    assert _cli(["simulate", "--trace", str(bad)]) == 2
    assert "bad.jsonl:1: missing required field" in capsys.readouterr().err


def test_sweep_writes_one_row_per_point(tmp_path, capsys):
    out = tmp_path / "s.csv"
    rc = _cli(["sweep", "--set", "max_num_batched_tokens=128,512", "--set",
               "enable_prefix_caching=true,false", "--model-shape", "smollm2-135m",
               "--num-requests", "20", "--request-rate", "100", "--prompt-len", "fixed:100",
               "--output-len", "fixed:4", "--num-gpu-blocks-override", "200",
               "--max-model-len", "256", "--jobs", "2", "--out", str(out)])
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["max_num_batched_tokens"], r["enable_prefix_caching"]) for r in rows] == [
        ("128", "True"), ("128", "False"), ("512", "True"), ("512", "False")]
    assert all(r["num_finished"] == "20" for r in rows)


def test_parse_sets_rejects_unknown_fields_and_bad_values():
    assert parse_sets(["max_num_seqs=1,2"]) == [("max_num_seqs", [1, 2])]
    with pytest.raises(ValueError, match="unknown config field"):
        parse_sets(["max_num_sequences=1"])
    with pytest.raises(ValueError, match="expected int"):
        parse_sets(["max_num_seqs=lots"])
