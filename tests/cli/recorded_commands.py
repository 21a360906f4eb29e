"""Command lines whose parsed namespaces were recorded on the commit before the
`tokenweir/cli/` package (b2e2d84): README's examples, the golden simulator configurations and
the command lines the tests run. Re-record (only for an intended change):
    PYTHONPATH=. .venv/bin/python tests/cli/recorded_commands.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RECORDING = Path(__file__).parent / "recorded_namespaces.json"

_BURSTY = ["--num-requests", "200", "--request-rate", "30", "--num-gpu-blocks-override", "400",
           "--prompt-len", "lognormal:400:0.6", "--output-len", "uniform:20:300"]
_SIM_TEST = ["simulate", "--model-shape", "smollm2-135m", "--num-requests", "40",
             "--request-rate", "200", "--prompt-len", "fixed:200", "--output-len", "fixed:8",
             "--num-gpu-blocks-override", "300", "--max-model-len", "512"]

COMMANDS: list[list[str]] = [
    # README
    ["generate", "--prompt", "Why is the sky blue?", "--max-tokens", "64", "--summary",
     "--max-num-batched-tokens", "256", "--num-gpu-blocks-override", "64"],
    ["generate"],
    ["generate", "--no-chat", "--prompt", "a", "--prompt", "b", "--temperature", "0.5",
     "--top-p", "0.9", "--top-k", "5", "--no-enable-prefix-caching", "--dtype", "float32"],
    ["simulate", "--num-requests", "2000", "--request-rate", "40"],
    ["simulate", "--num-instances", "4", "--router", "prefix-aware", "--num-prefix-groups", "8",
     "--prefix-len", "512", "--request-rate", "80"],
    ["simulate", "--pd", "1:3", "--link-gbps", "100", "--request-rate", "40"],
    ["simulate", "--pp-size", "4", "--request-rate", "40"],
    ["simulate", "--sessions", "200", "--turns", "fixed:4", "--tool-delay-ms", "fixed:500",
     "--num-instances", "2", "--router", "prefix-aware"],
    ["sweep", "--set", "max_num_batched_tokens=512,2048,8192", "--out", "sweep.csv"],
    ["study", "frontier", "--out-dir", "study"],
    ["study", "pool", "--out-dir", "study"],
    ["study", "policies", "--out-dir", "study"],
    ["calibrate", "smollm2-135m", "--out", "step_profile.json"],
    ["calibrate"],
    ["simulate", "--profile", "step_profile.json", "--max-model-len", "2048", "--request-rate",
     "2"],
    ["serve"],
    ["serve", "smollm2-135m", "--dtype", "float32", "--port", "8123", "--api-key", "k",
     "--served-model-name", "a", "--served-model-name", "b", "--max-waiting-requests", "4",
     "--drain-timeout", "5", "--log-level", "warning", "--num-gpu-blocks-override", "64"],
    ["bench", "serve", "--base-url", "http://127.0.0.1:8000", "--model", "m"],
    ["bench", "serve", "--base-url", "u", "--model", "m", "--num-prompts", "8",
     "--goodput", "ttft:500", "tpot:50", "--no-progress", "--length-dist", "uniform"],
    # tests/sim/test_golden_results.py CONFIGS
    ["simulate", "--num-requests", "300", "--request-rate", "40", "--num-prefix-groups", "4",
     "--prefix-len", "256", "--max-num-batched-tokens", "1024"],
    ["simulate", *_BURSTY, "--preemption-mode", "swap", "--preemption-policy", "cost"],
    ["simulate", *_BURSTY, "--preemption-mode", "auto", "--preemption-policy", "cost"],
    ["simulate", *_BURSTY, "--scheduling-policy", "priority", "--priority-mix", "0:0.7,1:0.3"],
    ["simulate", "--num-requests", "300", "--request-rate", "80", "--num-instances", "4",
     "--router", "prefix-aware", "--num-prefix-groups", "8", "--prefix-len", "512"],
    ["simulate", "--num-requests", "200", "--request-rate", "40", "--pd", "1:2",
     "--link-gbps", "100"],
    ["simulate", "--sessions", "40", "--turns", "fixed:3", "--tool-delay-ms", "fixed:500",
     "--num-instances", "2", "--router", "prefix-aware", "--request-rate", "10"],
    ["simulate", *_BURSTY, "--pp-size", "2", "--num-instances", "2"],
    ["simulate", "--model-shape", "smollm2-135m", "--hardware", "cpu-epyc-2c",
     "--max-model-len", "4096", "--max-num-batched-tokens", "512",
     "--num-gpu-blocks-override", "1200", "--scheduling-policy", "slo", "--trace", "t.jsonl",
     "--json", "m.json", "--chrome-trace", "c.json"],
    # the tests' command lines
    [*_SIM_TEST, "--pd", "1:2", "--link-gbps", "25", "--json", "out.json"],
    [*_SIM_TEST, "--sessions", "5", "--turns", "fixed:2", "--num-instances", "2"],
    [*_SIM_TEST, "--prioritize-prefill", "--tp", "2", "--hardware", "a100-80gb"],
    [*_SIM_TEST, "--no-prioritize-prefill", "--ttft-slo-ms", "100", "--tpot-slo-ms", "20",
     "--save-trace", "w.jsonl", "--arrival", "gamma", "--cv", "2"],
    ["sweep", "--set", "max_num_batched_tokens=128,512", "--set",
     "enable_prefix_caching=true,false", "--model-shape", "smollm2-135m", "--jobs", "2"],
    ["study", "frontier", "--jobs", "1", "--long-prompt", "8000", "--num-decodes", "8",
     "--decode-output", "300", "--chunks", "256,1024"],
    ["study", "pool", "--jobs", "2", "--num-requests", "60", "--blocks", "100,200"],
    ["study", "policies", "--jobs", "2", "--num-requests", "60", "--blocks", "300",
     "--priority-mix", "0:0.5,1:0.5", "--seed", "3", "--tp", "2"],
    ["calibrate", "tiny", "--quick", "--repeats", "5", "--out", "p.json", "--threads", "2",
     "--dtype", "bfloat16", "--device", "cpu", "--block-size", "32"],
]


def parsed(argv: list[str]) -> dict[str, str]:
    from tokenweir.cli import build_parser

    return {k: repr(v) for k, v in sorted(vars(build_parser().parse_args(argv)).items())}


def main() -> int:
    table = [{"argv": argv, "namespace": parsed(argv)} for argv in COMMANDS]
    if "--record" in sys.argv:
        RECORDING.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {RECORDING} ({len(table)} command lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
