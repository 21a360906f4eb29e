"""A kept real slo run replayed in the simulator on the real run's own clock (issue 36, fid8).

    python benchmarks/slo_forced_replay.py --profile P.json DIR/slo-seed1.jsonl [TRACE ...]

Every simulated step takes the time the same step took in the real run (`TraceClock`: from
its start to the next step's start, or its own duration where the engine then idled), so the
scheduler, the slo policy and the simulator's model of the SLO monitor (sim/slo_cuts.py:
its looks at arrivals, at a watched step's start and on its 20-ms timer; the layer an order
lands on; the layer-fraction refusal) see the times the engine saw, at the arrival offsets
the engine recorded. Where the simulator's mechanism is the engine's, the replay follows the
real run step for step: the same requests, chunks, cuts, victims and prefix-cache hits
(`step_key`). The first step where they part (`first_divergence`) is printed with the
monitor's looks in it: a mechanism error of the simulator, or a knife edge that the real
run's timing decided and the replay's cannot.

Two times are not in a trace and come from the profile: a real cut step's full length (the
profile's step time at the run's measured prefill speed; it places the layer boundaries),
and, once the runs have parted, every step (the profile at the run's speed, so the replay
completes). A simulated cut of a step the real run also cut ends when the real one did
(`_hold_cuts_to_trace`), so one cut's layer rounding does not shift every later step.

fid8, fid7's kept suite (16 slo runs: 12 validation, 4 calibration; profile
/tmp/fid7/final/profile.json): 14 runs followed to their last step (every schedule, cut,
victim and prefix hit the real run's); 106 real cuts matched; prefix hits over the compared
steps 3312 real, 3312 replayed. The two runs that parted did so where the simulator cut and
the engine did not, each on a margin of milliseconds: seed 1 (repeat) step 21, an arrival
21 ms before the simulator's layer-26 boundary (27 is refused) and ~11 ms before the
engine's (its layers span the forward alone, the simulator's the whole step); seed 5 step
215, a cut whose victim would still meet its deadline by 1.3 ms after waiting the waiter's
service (`slo.gate`'s VICTIM_WOULD_MISS test), which a monitor looking 1.3 ms later refuses
(the engine's looks wait for the GIL: its recorded arrivals lag the workload's offsets by
3-10 ms at the median, up to 38 ms, in these runs).

fid9: with the profile's `forward_phases` (sim/forward_phases.py: the layer boundaries span
the forward alone, as the engine's) the same 14 runs follow, 106 cuts match, and the same two
part. Seed 1 step 21: the simulator's boundary 26 now falls 1.787 s into the step (was
1.800), the engine's, from that step's own phases, 1.7895 s (0.38 ms of schedule and
prepare, then 26/30 of a 2.064-s forward); the look at the arrival, 1.779 s, precedes both,
so the engine did not look there: its look came >= 10.5 ms after the recorded arrival
(the C++ kernels hold the GIL: model/kernels/cpu_kernels.cpp releases it nowhere). Over the
106 matched cuts the real forward ended (0.55, median) of a layer after the simulator's
ordering look, 93% within [0, 1] layer: where the engine cut, it cut at the boundary the
simulator predicts (8 of them 0.3-1.1 ms after the look, ~40 of them 11-20 ms).

fid11, a fresh suite on an Intel AVX-512 machine (5 slo runs: 2 calibration, 3 validation;
profile /tmp/fid11/profile.json): 2 of 5 followed to the end at first; two parted where an
arrival came 3 and 5 ms before the engine's step start and after the replay's, because the
engine had woken 5-6 ms late from an idle stretch earlier in that busy stretch (0.2-0.5 ms
is usual) and the replay's clock started that step at the arrival. With `woken_specs` (the
step after an idle stretch starts when the engine's did): 4 of 5 to the end, 33 real cuts
(26 margin-beaten, 7 running-hopeless yields) and 8 pauses matched; seed 3 parts at step 195
of 229, a real cut at 1.530 s into a step the profile times at 1.496 s (the cut step's full
length, which the trace does not hold).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sim_fidelity as sf  # noqa: E402
from tokenweir.sim.calibrate_trace import idle_after  # noqa: E402
from tokenweir.sim.latency import FittedLatencyModel, StepTotals  # noqa: E402

WORKLOAD = "slo"


def step_chunks(step: dict) -> list[tuple[int, int]]:
    """(new tokens, cached tokens) per request of a step record."""
    return [(r["prefill"] + r["decode"], r["context"] - r["prefill"] - r["decode"])
            for r in step["reqs"]]


def step_key(step: dict) -> tuple:
    """What must agree between a real step and its replay: each request's prefill and decode
    tokens, the cut's victim, the prefix-cache hits of its admissions."""
    reqs = tuple(sorted((r["id"], r["prefill"], r["decode"]) for r in step["reqs"]))
    return reqs, tuple(step.get("cut", [])), step.get("prefix_hits", 0)


def trace_cycles(steps: list[dict]) -> list[float]:
    """Per step: seconds from its start to the next step's start, or its own duration where
    the engine idled after it (`idle_after`) or it is the last."""
    out = []
    for k, s in enumerate(steps):
        busy = k + 1 < len(steps) and not idle_after(s)
        out.append(steps[k + 1]["start"] - s["start"] if busy else s["duration"])
    return out


class TraceClock:
    """A latency model that times the k-th non-empty step as the real run's k-th step while
    the replay's steps are the real ones (same token totals); a real cut step, and every step
    once they part, as `fallback` (the profile at the run's speed). The scheduler's
    forecasts (`predict`, `step_time`) are the fallback's too."""

    def __init__(self, steps: list[dict], fallback: FittedLatencyModel) -> None:
        self.steps, self.base = steps, fallback  # named as NoisyLatencyModel's (is_fitted)
        self.cycles = trace_cycles(steps)
        self.k = 0  # steps timed so far
        self.parted_at: Optional[int] = None  # the first step whose totals differ

    def __getattr__(self, name):  # num_layers, kv_bytes_per_token, ... of the profile
        return getattr(self.base, name)

    def predict_totals(self, totals: StepTotals) -> float:
        if not totals.num_tokens:
            return 0.0
        k, self.k = self.k, self.k + 1
        if self.parted_at is None and (k >= len(self.steps) or StepTotals.of_chunks(
                step_chunks(self.steps[k])) != totals):
            self.parted_at = k
        if self.parted_at is not None or self.steps[k].get("cut"):
            return self.base.predict_totals(totals)
        return self.cycles[k]

    def predict(self, scheduler_output, context_lens) -> float:
        return self.base.predict(scheduler_output, context_lens)

    def step_time(self, chunks) -> float:
        return self.base.step_time(chunks)

    def real_cut_end(self) -> Optional[float]:
        """The real length of the step just timed, if the real run cut it too (else None)."""
        k = self.k - 1
        if self.parted_at is not None or not self.steps[k].get("cut"):
            return None
        return self.cycles[k]


def _hold_cuts_to_trace(cutter, clock: TraceClock, cuts: list) -> None:
    """The simulated cut of a step the real run also cut lasts as long as the real one; each
    cut is listed as (step index, layer, full step seconds)."""
    cut = cutter.cut_step

    def held(out, step_seconds, layer_index, order):
        runner_out = cut(out, step_seconds, layer_index, order)
        cuts.append((clock.k - 1, layer_index, step_seconds))
        real = clock.real_cut_end()
        return runner_out if real is None else dataclasses.replace(runner_out,
                                                                   step_seconds=real)

    cutter.cut_step = held


def _watch_looks(policy, clock: TraceClock, looks: list) -> None:
    """Each mid-step gate decision of the monitor: (time, step index, case, waiter, victim)."""
    decide = policy.slo_decide

    def watched(prefills, waiters, now, wait_seconds, pause=False):
        decision, waiter_id = decide(prefills, waiters, now, wait_seconds, pause)
        if not pause:
            looks.append((now, clock.k - 1, decision.case, waiter_id, decision.victim_id))
        return decision, waiter_id

    policy.slo_decide = watched


def replay(profile: dict, trace_path: Path) -> dict:
    """The kept run at `trace_path` replayed on its own clock (see the module doc): its steps
    and the replay's, the first step where they part (None: followed to the end), the cuts
    (step, layer, full seconds) and the monitor's looks."""
    from tokenweir.sim.build import build_simulation
    from tokenweir.timeline.recorder import record_simulation
    from tokenweir.timeline.records import load_jsonl

    steps = load_jsonl(trace_path).steps
    speed = sf.run_speed(profile, trace_path)
    clock = TraceClock(steps, FittedLatencyModel.from_profile(sf.at_run_speed(profile, speed)))
    specs, line = sf.run_specs(WORKLOAD, trace_path), sf.run_line(WORKLOAD, trace_path)
    specs = woken_specs(specs, steps, _first_arrival(trace_path))
    sim = build_simulation(sf.engine_kwargs(sf.WORKLOADS[WORKLOAD], line), specs,
                           latency_model=clock, itl_counts=True)
    cuts, looks = [], []
    _hold_cuts_to_trace(sim.cutter, clock, cuts)
    _watch_looks(sim.scheduler.policy, clock, looks)
    _, trace = record_simulation(sim)
    first = first_divergence(steps, trace.steps)
    return {"name": trace_path.name, "real": steps, "sim": trace.steps, "first": first,
            "cuts": cuts, "looks": looks, "t0": _first_arrival(trace_path)}


def woken_specs(specs: list, steps: list[dict], t0: float) -> list:
    """The specs with each arrival that found the engine idle (after a step it drained, or
    before the first) moved to the start of the step that admitted it, its TTFT target
    shortened alike (the deadline stays where the engine had it). The simulator starts a step
    at such an arrival; the engine wakes a little later (fid11's 5 kept slo runs: 0.2-0.5 ms
    from an idle arrival to the step's start, 2-6 ms in 11 of 105), and the replay's clock,
    which times steps but not that wake-up, would run that much early for the rest of the
    busy stretch (two of those runs parted on it: an arrival 3 and 5 ms before the engine's
    step start and after the replay's). `t0`: the run's first arrival (the specs' zero)."""
    from dataclasses import replace

    wakes = [s["start"] - t0 for k, s in enumerate(steps)
             if k == 0 or idle_after(steps[k - 1])]
    ends = [0.0] + [s["start"] + s["duration"] - t0 for k, s in enumerate(steps[:-1])
                    if idle_after(s)]
    out = []
    for spec in specs:
        start = next((w for e, w in zip(ends, wakes) if e <= spec.arrival <= w), None)
        if start is None or start == spec.arrival:
            out.append(spec)
            continue
        shift = start - spec.arrival
        target = None if spec.ttft_slo_ms is None else spec.ttft_slo_ms - 1000 * shift
        out.append(replace(spec, arrival=start, ttft_slo_ms=target))
    return out


def first_divergence(real: list[dict], sim: list[dict]) -> Optional[int]:
    """The index of the first step whose `step_key` differs (or that one side lacks)."""
    for k, (a, b) in enumerate(zip(real, sim)):
        if step_key(a) != step_key(b):
            return k
    return None if len(real) == len(sim) else min(len(real), len(sim))


def _first_arrival(trace_path: Path) -> float:
    records = json.loads(sf.records_path(trace_path).read_text())["records"]
    return min(r["arrival"] for r in records)


def matched_cuts(result: dict) -> int:
    """Real cut steps before the first divergence (each one the replay cut alike)."""
    end = result["first"] if result["first"] is not None else len(result["real"])
    return sum(1 for s in result["real"][:end] if s.get("cut"))


def format_replay(result: dict) -> str:
    real, sim, k = result["real"], result["sim"], result["first"]
    head = (f"{result['name']}: {len(real)} real steps, {len(sim)} replayed; "
            f"{matched_cuts(result)} real cuts matched; ")
    if k is None:
        return head + "followed to the end"
    lines = [head + f"parted at step {k}"]
    for side, steps in (("real", real), ("sim", sim)):
        if k < len(steps):
            s = steps[k]
            start = s["start"] - (result["t0"] if side == "real" else 0.0)
            lines.append(f"  {side:4} t={start:.3f}s {s['duration']:.3f}s "
                         f"{step_key(s)[0]} cut {s.get('cut', [])}")
    lines += [f"  look t={t:.3f}s {case} waiter {waiter} victim {victim}"
              for t, step, case, waiter, victim in result["looks"]
              if step == k and case != "waiter-meets-deadline-by-waiting"]
    lines += [f"  replay cut: layer {layer} of a {full:.3f}-s step"
              for step, layer, full in result["cuts"] if step == k]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="the profile the suite was replayed with")
    p.add_argument("traces", nargs="+", help="kept slo runs (<dir>/slo-seed<k>*.jsonl)")
    args = p.parse_args()
    profile = json.loads(Path(args.profile).read_text())
    results = [replay(profile, Path(t)) for t in args.traces]
    for r in results:
        print(format_replay(r))
    followed = sum(1 for r in results if r["first"] is None)
    print(f"{followed}/{len(results)} runs followed to the end; "
          f"{sum(matched_cuts(r) for r in results)} real cuts matched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
