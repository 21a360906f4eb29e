"""How much of a cluster run a "decode run" fast path could take: runs of pure-decode steps.

Issue 36 proposes advancing runs of decode-only steps of an instance in one pass. This counts,
on `sim_speed.py --cluster`'s workload (same lengths, prefix groups, 30 req/s per instance,
prefix-aware router), the steps such a pass could take and the request-steps inside them, per
instance, two ways:

- pure: every scheduled request is a running one computing exactly one token, no request gets
  its first token or finishes (the scheduler's update returns no output in counts mode), and
  no request is given a new block;
- pure but allocating: the same, new blocks allowed (a pass that also replays allocations).

A run ends at any other step (an arrival's prefill, a first token, a finish; for "pure" also a
block boundary). The share of request-steps in pure steps bounds what such a pass can save of
the per-request work (schedule's running pass, the runner's advance, update_from_output).

    python benchmarks/sim_decode_runs.py [--num-requests 10000] [--num-instances 64]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenweir.sim import sim_engine  # noqa: E402
from tokenweir.sim.cluster import build_cluster  # noqa: E402

from sim_speed import ENGINE_ARGS, chat_workload  # noqa: E402

KINDS = ("pure", "pure but allocating")


class RunCounter:
    """Per engine, the length of the current run of each kind; finished runs by length."""

    def __init__(self) -> None:
        self.current: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.runs = [Counter(), Counter()]
        self.request_steps = [0, 0, 0]  # all, in pure steps, in pure-but-allocating steps

    def step(self, engine_id: int, out, outputs) -> None:
        counts = out.num_scheduled_tokens
        decodes_only = (not outputs and not out.scheduled_new_reqs
                        and all(n == 1 for n in counts.values()))
        allocates = any(out.new_block_ids.get(rid) for rid in counts)
        flags = (decodes_only and not allocates, decodes_only)
        current = self.current[engine_id]
        self.request_steps[0] += len(counts)
        for k, pure in enumerate(flags):
            if pure:
                current[k] += 1
                self.request_steps[k + 1] += len(counts)
            elif current[k]:
                self.runs[k][current[k]] += 1
                current[k] = 0

    def close(self) -> None:
        for current in self.current.values():
            for k in range(2):
                if current[k]:
                    self.runs[k][current[k]] += 1

    def report(self) -> None:
        for k, kind in enumerate(KINDS):
            runs = self.runs[k]
            n, steps = sum(runs.values()), sum(length * c for length, c in runs.items())
            share = self.request_steps[k + 1] / max(1, self.request_steps[0])
            print(f"{kind}: {n} runs, mean {steps / max(1, n):.2f} steps, "
                  f"{steps} steps in runs, {share:.1%} of request-steps")
        print(f"request-steps (requests scheduled, summed over steps): {self.request_steps[0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--num-instances", type=int, default=64)
    args = parser.parse_args()
    specs = chat_workload(args.num_requests, 30.0 * args.num_instances, prefix_groups=256,
                          prefix_len=128)
    sim = build_cluster(ENGINE_ARGS, specs, model_shape="llama-7b", hardware="h100",
                        num_instances=args.num_instances, router="prefix-aware",
                        record_steps=False, itl_counts=True)
    for inst in sim.instances:  # every step through complete_step (a stretch plans none)
        inst.stretch = None
    counter = RunCounter()
    complete_step = sim_engine.SimEngine.complete_step

    def counting(engine, out, runner_out, now):  # the step as it ends: what it did
        outputs = complete_step(engine, out, runner_out, now)
        counter.step(id(engine), out, outputs)
        return outputs

    sim_engine.SimEngine.complete_step = counting
    try:
        sim.run()
    finally:
        sim_engine.SimEngine.complete_step = complete_step
    counter.close()
    counter.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
