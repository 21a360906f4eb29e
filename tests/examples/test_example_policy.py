"""The example plug-in policy (examples/shortest_prompt_first.py), named as `module:Class`, runs
unchanged in the simulator (through the generated CLI flags and through build_simulation) and
in the real engine. Each run is probed against fcfs: the admission order really changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokenweir import LLM, SamplingParams
from tokenweir.cli import main as cli_main
from tokenweir.sim.build import build_simulation
from tokenweir.sim.workload import RequestSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

POLICY = "examples.shortest_prompt_first:ShortestPromptFirst"
VICTIM = "examples.shortest_prompt_first:MostWorkLeftVictim"
PROMPT_LENS = [300, 40, 200, 10, 120, 60]  # arrival order; shortest-first admits 10, 40, 60...


def _first_scheduled_order(policy: dict) -> list[int]:
    specs = [RequestSpec(f"r{i}", arrival=0.0, prompt_len=n, output_len=8, index=i)
             for i, n in enumerate(PROMPT_LENS)]
    sim = build_simulation(dict(max_num_seqs=1, **policy), specs)
    records = sorted(sim.run().requests, key=lambda r: r.first_scheduled)
    return [r.prompt_len for r in records]


def test_example_policy_runs_in_the_simulator():
    assert _first_scheduled_order({}) == PROMPT_LENS  # probe: fcfs keeps arrival order
    assert _first_scheduled_order({"scheduling_policy": POLICY,
                                   "preemption_policy": VICTIM}) == sorted(PROMPT_LENS)


def _simulate_cli(tmp_path: Path, extra: list[str]) -> dict:
    out = tmp_path / f"run{len(extra)}.json"
    args = ["simulate", "--num-requests", "60", "--request-rate", "30",
            "--num-gpu-blocks-override", "300", "--prompt-len", "lognormal:400:0.6",
            "--output-len", "uniform:20:300", "--no-scheduler-reserve-full-isl",
            "--json", str(out), *extra]
    assert cli_main(args) in (0, None)
    return json.loads(out.read_text())


def test_example_policy_runs_through_the_generated_cli_flags(tmp_path, capsys):
    fcfs = _simulate_cli(tmp_path, [])
    mine = _simulate_cli(tmp_path, ["--scheduling-policy", POLICY, "--preemption-policy", VICTIM])
    capsys.readouterr()
    assert fcfs["preemptions"] > 0  # probe: the pool is cramped, so victims are chosen
    assert mine["num_finished"] == fcfs["num_finished"] == 60
    assert mine != fcfs  # probe: the plug-in changed the run


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-policy")
    make_tiny_model("llama", str(path), seed=5)
    save_tiny_tokenizer(str(path), "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return str(path)


def _first_token_order(path: str, **policy) -> list[int]:
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=512, block_size=8,
              num_gpu_blocks_override=200, max_num_seqs=1, **policy)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + k) % 300 for k in range(n)]}
               for i, n in enumerate(PROMPT_LENS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert type(llm.llm_engine.scheduler.policy).__name__ == (
        "ShortestPromptFirst" if policy else "FCFSPolicy")
    ordered = sorted(outs, key=lambda o: o.metrics.first_token_time)
    return [len(o.prompt_token_ids) for o in ordered]


def test_example_policy_runs_in_the_real_engine(tiny_llama):
    assert _first_token_order(tiny_llama) == PROMPT_LENS  # probe: fcfs keeps arrival order
    assert _first_token_order(tiny_llama, scheduling_policy=POLICY,
                              preemption_policy=VICTIM) == sorted(PROMPT_LENS)
