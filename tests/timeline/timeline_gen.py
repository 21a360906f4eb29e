"""Step records generated from real scheduler output: simulations run through the public API
(tokenweir.sim.build.build_simulation) with a StepRecorder attached, on workloads that make
the scheduler preempt (a cramped pool), swap, and cut (the slo policy)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenweir.sim.build import build_simulation
from tokenweir.sim.workload import RequestSpec, synthetic
from tokenweir.timeline.recorder import record_simulation


def slo_specs(n: int = 60, seed: int = 11) -> list[RequestSpec]:
    """Prompts 128-2048 tokens, a third urgent (tight TTFT targets): the slo policy cuts."""
    rng = random.Random(seed)
    now, specs = 0.0, []
    for i in range(n):
        now += rng.expovariate(0.4)
        prompt = rng.randint(128, 2048)
        urgent = rng.random() < 0.33
        slo = prompt * 2.5 + 400 if urgent else prompt * 12 + 8000
        specs.append(RequestSpec(f"r{i}", round(now, 4), prompt, rng.randint(4, 48), 0, slo,
                                 None, 0, i))
    return specs


def run_slo(policy: str = "slo"):
    """(SimResult, Trace) of the slo workload on a small CPU model, `policy` scheduling."""
    kwargs = dict(max_model_len=4096, max_num_batched_tokens=512,
                  num_gpu_blocks_override=1200, scheduling_policy=policy)
    sim = build_simulation(kwargs, slo_specs(), model_shape="smollm2-135m",
                           hardware="cpu-epyc-2c")
    return record_simulation(sim, label=f"simulator, {policy} policy")


def run_cramped(mode: str = "recompute", num_requests: int = 120, blocks: int = 400):
    """(SimResult, Trace) of a bursty workload in a `blocks`-block pool (400: memory
    preemptions)."""
    specs = synthetic(num_requests, 30, seed=0, prompt="lognormal:400:0.6",
                      output="uniform:20:300")
    sim = build_simulation(dict(num_gpu_blocks_override=blocks, preemption_mode=mode), specs)
    return record_simulation(sim, label=f"simulator, cramped pool, {mode}")


def write_synthetic_steps(path: Path, num_steps: int = 100_000, concurrency: int = 3,
                          length: int = 40) -> int:
    """A long step-record file written directly (no scheduler): `concurrency` requests at a
    time, each a 2-step prefill then decodes for `length` steps. Returns the request count."""
    active: list[list] = []  # [id, steps left]
    next_id = 0
    with open(path, "w") as f:
        for step in range(num_steps):
            while len(active) < concurrency:
                active.append([f"q{next_id}", length])
                f.write(json.dumps({"type": "request", "id": f"q{next_id}",
                                    "arrival": step * 0.01}) + "\n")
                next_id += 1
            reqs = []
            for entry in active:
                done = length - entry[1]
                prefill = 64 if done < 2 else 0
                reqs.append({"id": entry[0], "prefill": prefill, "decode": 0 if prefill else 1,
                             "context": 64 * min(done + 1, 2) + max(0, done - 1)})
                entry[1] -= 1
            f.write(json.dumps({"step": step, "start": step * 0.01, "duration": 0.01,
                                "reqs": reqs, "running": len(active), "waiting": 0,
                                "kv_usage": 0.5, "prefix_hits": 0}) + "\n")
            active = [e for e in active if e[1] > 0]
    return next_id
