"""Which of a kept run's real step times carry its outcome (issue 36, fid10).

    python benchmarks/slo_step_residuals.py --profile P.json --draws 16 \
        --variants real/noise,noise/real,shuffled/noise DIR/slo-seed1.jsonl [TRACE ...]

Each step of the simulated run lasts the profile's time at the run's measured speed
(`sim_fidelity.at_run_speed`) times a residual. A step is of class P (it computes prefill
tokens) or D (decode only), and a variant names a source for each class, "P/D":
  real      the kept run's own residuals of that class (real cycle / the profile's time, real
            cut steps left out) in their order: the i-th simulated step of the class gets the
            i-th (1.0 past the end). While the schedules agree this is the real run's clock; once
            they part, each step still gets the residual of its rank in the class.
  shuffled  the same residuals in a seeded random order (their distribution, not their order)
  reversed  the same residuals last to first
  smooth    each residual replaced by the median of the 11 around it (the slow drift only)
  detrended each residual over that median (the step-to-step jitter only, in order)
  early     the real residuals for the first half of the class's steps, jitter after
  late      jitter for the first half, the real residuals after
  noise     a seeded log-normal draw of the profile's step_sigma (what the speed-matched
            draws use: `latency.sample_machines`)
  one       1.0 (the profile at the run's speed)
A variant with noise in it runs --draws times (seeds 0..); the others once. Printed per run:
the real TTFT p90, its rank among --draws speed-matched draws, and each variant's mean; then
the means over the runs, each against the real runs' and the speed-matched draws'.

fid10 on fid7's 12 slo validation runs (profile /tmp/fid9/profile.json), as printed (TTFT
p90 means over the runs; real 11.342 s): --draws 16, speed-matched 12.982 s (+14.5%):
real/noise 11.713 (-9.8% against the speed-matched draws), noise/real 12.987 (+0.0%): the
prefill steps' times carry the lean, the decode-only steps' none; shuffled/noise 13.293,
smooth/noise 13.024, detrended/noise 14.385: neither their distribution, nor their slow drift,
nor their jitter alone. --draws 12, speed-matched 13.047: early/noise 11.468, late/noise
13.318: the first half of the run's prefill steps carries all of it. (reversed/noise 12.923
at 24 draws, from the experiment script this tool was made from.)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sim_fidelity as sf  # noqa: E402
from benchmarks.slo_forced_replay import step_chunks, trace_cycles  # noqa: E402
from tokenweir.sim.latency import FittedLatencyModel, StepTotals, sample_machines  # noqa: E402

SOURCES = ("real", "shuffled", "reversed", "smooth", "detrended", "early", "late", "noise", "one")
LOCAL = 5  # `smooth` / `detrended`: the median of the residual and LOCAL on each side
# A simulated step ranked past the real run's steps of its class: 1.0, or jitter (None) for the
# sources that draw it for half of the run.
PAST_THE_END = {s: None if s in ("early", "late") else 1.0 for s in SOURCES}


def step_class(totals: StepTotals) -> str:
    """P: the step computes prefill tokens (a request with more than one new token); else D."""
    return "P" if totals.num_prefill_tokens > 0 else "D"


def residuals(steps: list[dict], model) -> dict[str, list[float]]:
    """Per class, each non-cut step's real cycle (`trace_cycles`) over `model`'s time for it,
    in the run's order."""
    out: dict[str, list[float]] = {"P": [], "D": []}
    for s, cycle in zip(steps, trace_cycles(steps)):
        if s.get("cut") or not s["reqs"]:
            continue
        totals = StepTotals.of_chunks(step_chunks(s))
        out[step_class(totals)].append(cycle / model.predict_totals(totals))
    return out


def arranged(values: list[float], source: str, seed: int, key: str) -> list[Optional[float]]:
    """The residual sequence a source gives class `key` (None: draw jitter for that step)."""
    n = len(values)
    if source == "shuffled":
        values = list(values)
        random.Random(f"{seed}/{key}").shuffle(values)
        return values
    if source == "reversed":
        return values[::-1]
    if source in ("smooth", "detrended"):
        local = [statistics.median(values[max(0, i - LOCAL):i + LOCAL + 1]) for i in range(n)]
        return local if source == "smooth" else [v / m for v, m in zip(values, local)]
    if source == "early":
        return values[:n // 2] + [None] * (n - n // 2)
    if source == "late":
        return [None] * (n // 2) + values[n // 2:]
    return list(values)


class ResidualClock:
    """A latency model timing each step as `model` times its class's residual (see the module
    doc); forecasts (`predict`, `step_time`) are the model's."""

    def __init__(self, model, res: dict[str, list[float]], sources: dict[str, str],
                 seed: int, step_sigma: float) -> None:
        self.base, self.sources, self.sigma = model, sources, step_sigma
        self.seq = {k: arranged(res[k], sources[k], seed, k) for k in ("P", "D")}
        self.rank = {"P": 0, "D": 0}
        self.rng = random.Random(seed)

    def __getattr__(self, name):  # num_layers, forward_phases, ... of the profile
        return getattr(self.base, name)

    def predict_totals(self, totals: StepTotals) -> float:
        if not totals.num_tokens:
            return 0.0
        k, seconds = step_class(totals), self.base.predict_totals(totals)
        source = self.sources[k]
        if source == "one":
            return seconds
        if source == "noise":
            return seconds * self._jitter()
        i, self.rank[k] = self.rank[k], self.rank[k] + 1
        r = self.seq[k][i] if i < len(self.seq[k]) else PAST_THE_END[source]
        return seconds * (self._jitter() if r is None else r)

    def _jitter(self) -> float:
        return math.exp(self.rng.gauss(-self.sigma * self.sigma / 2, self.sigma))

    def predict(self, scheduler_output, context_lens) -> float:
        return self.base.predict(scheduler_output, context_lens)

    def step_time(self, chunks) -> float:
        return self.base.step_time(chunks)


def parse_variant(text: str) -> dict[str, str]:
    p, d = text.split("/")
    if p not in SOURCES or d not in SOURCES:
        raise SystemExit(f"variant {text!r}: each side one of {', '.join(SOURCES)}")
    return {"P": p, "D": d}


def ttft_p90_s(records: list[dict]) -> float:
    return sf.summarize(records)["ttft_p90_ms"] / 1000


def run_variants(profile: dict, trace: Path, variants: list[str], draws: int,
                 workload: str = "slo") -> dict:
    """One kept run: its real TTFT p90, the speed-matched draws', each variant's (seconds)."""
    from tokenweir.timeline.records import load_jsonl

    at_speed = sf.at_run_speed(profile, sf.run_speed(profile, trace))
    model = FittedLatencyModel.from_profile(at_speed)
    sigma = float((profile.get("variability") or {}).get("step_sigma", 0.0))
    res = residuals(load_jsonl(trace).steps, model)
    specs, line = sf.run_specs(workload, trace), sf.run_line(workload, trace)
    w = sf.WORKLOADS[workload]
    out = {"name": trace.name, "real": ttft_p90_s(sf.load_run(trace)[0]),
           "matched": [ttft_p90_s(sf.run_sim(w, m, specs, line)[0])
                       for m in sample_machines(at_speed, draws)]}
    for v in variants:
        sources = parse_variant(v)
        n = draws if any(s in ("noise", "early", "late") for s in sources.values()) else 1
        out[v] = [ttft_p90_s(sf.run_sim(w, ResidualClock(model, res, sources, seed, sigma),
                                        specs, line)[0]) for seed in range(n)]
    return out


def rank(x: float, draws: list[float]) -> float:
    """The share of `draws` below x."""
    return sum(1 for d in draws if d < x) / len(draws)


def format_results(results: list[dict], variants: list[str]) -> str:
    mean = statistics.mean
    real = mean(r["real"] for r in results)
    matched = mean(mean(r["matched"]) for r in results)
    lines = [f"{r['name']:26s} real {r['real']:6.2f} s (rank {rank(r['real'], r['matched']):.2f}"
             f" among the speed-matched draws, mean {mean(r['matched']):6.2f})"
             + "".join(f" | {v} {mean(r[v]):6.2f}" for v in variants) for r in results]
    lines.append(f"TTFT p90 over {len(results)} runs: real {real:.3f} s, speed-matched "
                 f"{matched:.3f} s ({100 * (matched / real - 1):+.1f}%); real ranks "
                 + " ".join(f"{rank(r['real'], r['matched']):.2f}" for r in results))
    for v in variants:
        m = mean(mean(r[v]) for r in results)
        lines.append(f"  {v:18s} {m:.3f} s: {100 * (m / real - 1):+.1f}% against real, "
                     f"{100 * (m / matched - 1):+.1f}% against speed-matched; its mean's rank "
                     + " ".join(f"{rank(mean(r[v]), r['matched']):.2f}" for r in results))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--draws", type=int, default=16)
    p.add_argument("--variants", default="real/noise,noise/real,shuffled/noise")
    p.add_argument("--workload", default="slo")
    p.add_argument("traces", nargs="+")
    args = p.parse_args()
    profile = json.loads(Path(args.profile).read_text())
    variants = args.variants.split(",")
    for v in variants:
        parse_variant(v)
    results = [run_variants(profile, Path(t), variants, args.draws, args.workload)
               for t in args.traces]
    print(format_results(results, variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
