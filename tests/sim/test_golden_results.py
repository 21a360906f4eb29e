"""Simulator results recorded before the issue-13 redesign: every configuration here must give
byte-identical metrics and the same chrome-trace events (steps, counters, request spans) as
the recording. A refactor that changes one of them changed behaviour.

Re-record only for an intended behaviour change, and say so in the commit:
    .venv/bin/python tests/sim/test_golden_results.py --record
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import pytest

from tokenweir.cli import main as cli_main

GOLDEN = Path(__file__).parent / "golden"

_BURSTY = ["--num-requests", "200", "--request-rate", "30", "--num-gpu-blocks-override", "400",
           "--prompt-len", "lognormal:400:0.6", "--output-len", "uniform:20:300"]

CONFIGS: dict[str, list[str]] = {
    "single": ["--num-requests", "300", "--request-rate", "40", "--num-prefix-groups", "4",
               "--prefix-len", "256", "--max-num-batched-tokens", "1024"],
    "swap_cost": _BURSTY + ["--preemption-mode", "swap", "--preemption-policy", "cost"],
    "auto_cost": _BURSTY + ["--preemption-mode", "auto", "--preemption-policy", "cost"],
    "priority_preempt": _BURSTY + ["--scheduling-policy", "priority",
                                   "--priority-mix", "0:0.7,1:0.3"],
    "cluster_prefix4": ["--num-requests", "300", "--request-rate", "80", "--num-instances", "4",
                        "--router", "prefix-aware", "--num-prefix-groups", "8",
                        "--prefix-len", "512"],
    "pd": ["--num-requests", "200", "--request-rate", "40", "--pd", "1:2",
           "--link-gbps", "100"],
    "sessions": ["--sessions", "40", "--turns", "fixed:3", "--tool-delay-ms", "fixed:500",
                 "--num-instances", "2", "--router", "prefix-aware", "--request-rate", "10"],
    "pp2_cramped": _BURSTY + ["--pp-size", "2", "--num-instances", "2"],
    "slo_cuts": ["--model-shape", "smollm2-135m", "--hardware", "cpu-epyc-2c",
                 "--max-model-len", "4096", "--max-num-batched-tokens", "512",
                 "--num-gpu-blocks-override", "1200", "--scheduling-policy", "slo",
                 "--trace", "{slo_trace}"],
}


def _slo_trace(path: Path) -> None:
    """60 requests, prompts 128-2048 tokens, a third urgent (1.5 x their solo time)."""
    rng = random.Random(11)
    now, lines = 0.0, []
    for i in range(60):
        now += rng.expovariate(0.4)
        prompt = rng.randint(128, 2048)
        urgent = rng.random() < 0.33
        slo = prompt * 2.5 + 400 if urgent else prompt * 12 + 8000
        lines.append(json.dumps({"arrival": round(now, 4), "prompt_len": prompt,
                                 "output_len": rng.randint(4, 48), "ttft_slo_ms": slo}))
    path.write_text("\n".join(lines) + "\n")


def _trace_digest(path: Path) -> str:
    """sha256 of the trace's timed events, in order, without pids (process metadata aside)."""
    events = json.loads(path.read_text())["traceEvents"]
    timed = [{k: v for k, v in e.items() if k not in ("pid", "tid")}
             for e in events if e.get("ph") != "M"]
    return hashlib.sha256(json.dumps(timed, sort_keys=True).encode()).hexdigest()


def _drop_wall(obj):
    if isinstance(obj, dict):
        return {k: _drop_wall(v) for k, v in obj.items() if k != "wall_seconds"}
    if isinstance(obj, list):
        return [_drop_wall(v) for v in obj]
    return obj


def run_config(name: str, tmp: Path) -> dict:
    trace = tmp / f"{name}.slo.jsonl"
    _slo_trace(trace)
    args = [a.replace("{slo_trace}", str(trace)) for a in CONFIGS[name]]
    out_json, chrome = tmp / f"{name}.json", tmp / f"{name}.trace.json"
    rc = cli_main(["simulate", *args, "--json", str(out_json), "--chrome-trace", str(chrome)])
    assert rc in (0, None)
    return {"metrics": _drop_wall(json.loads(out_json.read_text())),
            "chrome_trace_sha256": _trace_digest(chrome)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_simulator_results_are_unchanged(name, tmp_path, capsys):
    recorded = json.loads((GOLDEN / f"{name}.json").read_text())
    got = run_config(name, tmp_path)
    capsys.readouterr()
    assert got["metrics"] == recorded["metrics"]
    assert got["chrome_trace_sha256"] == recorded["chrome_trace_sha256"]


def test_the_recordings_exercise_what_they_claim():
    """Probes: the pressured configurations really preempt, the slo one really cuts."""
    def load(name):
        return json.loads((GOLDEN / f"{name}.json").read_text())["metrics"]
    for name in ("swap_cost", "auto_cost", "priority_preempt"):
        assert load(name)["preemptions"] > 0, name
    assert load("cluster_prefix4")["overall"]["prefix_hit_rate"] > 0.3
    slo = load("slo_cuts")
    # the pool never fills (kv_usage_max < 1): these preemptions are the slo policy's pauses and cuts
    assert slo["preemptions"] > 0 and slo["kv_usage_max"] < 1.0


if __name__ == "__main__" and "--record" in sys.argv:
    import tempfile
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for config in sorted(CONFIGS):
            result = run_config(config, Path(tmp))
            (GOLDEN / f"{config}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            print(config, "recorded")
